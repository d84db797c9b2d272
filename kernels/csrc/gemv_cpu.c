/* fp32 linear layers for a few rows at a time: y[m] = W x[m] (+ bias) for m < M <= GEMV_MAX_M,
 * W an [N, K] row-major weight (nn.Linear's layout). kernels/cpu_gemv.py loads and calls it.
 *
 * A decode step of one or a few sequences reads every weight once to use it M times: the
 * matmul is a stream of the weights from memory, and what matters is reading them at memory
 * speed. Each output row is one pass over W's row with four independent accumulators (the
 * FMA chains overlap), the M input rows staying in L1; rows are split over the thread pool in
 * contiguous ranges. The sum over K is in a fixed order for every row (four strided partial
 * sums over 32-wide blocks, then the tail), whatever M or the thread count: a sequence's
 * outputs do not depend on the batch it is in.
 *
 * Plain C with GCC vector extensions (AVX2 with -march=native), no -ffast-math. */
#include <stdint.h>

#include "thread_pool.h"
#include "vec.h"

#define GEMV_MAX_M 8

typedef struct {
    const float *x; int64_t xs;
    const float *w; int64_t ws;
    const float *bias;
    float *y; int64_t ys;
    int m, k, n;
} Gemv;

/* The dot products of one weight row with x rows m0 and m0 + 1 (pair: both, else only m0). */
static inline void dot_row(const Gemv *g, const float *wr, int o, int m0, int pair) {
    const float *xa = g->x + m0 * g->xs, *xb = pair ? xa + g->xs : xa;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    const int K = g->k;
    int i = 0;
    if (pair) {
        for (; i + 32 <= K; i += 32) {
            v8 u0 = load8(wr + i), u1 = load8(wr + i + 8), u2 = load8(wr + i + 16), u3 = load8(wr + i + 24);
            a0 += u0 * load8(xa + i); a1 += u1 * load8(xa + i + 8);
            a2 += u2 * load8(xa + i + 16); a3 += u3 * load8(xa + i + 24);
            b0 += u0 * load8(xb + i); b1 += u1 * load8(xb + i + 8);
            b2 += u2 * load8(xb + i + 16); b3 += u3 * load8(xb + i + 24);
        }
    } else {
        for (; i + 32 <= K; i += 32) {
            a0 += load8(wr + i) * load8(xa + i); a1 += load8(wr + i + 8) * load8(xa + i + 8);
            a2 += load8(wr + i + 16) * load8(xa + i + 16); a3 += load8(wr + i + 24) * load8(xa + i + 24);
        }
    }
    float sa = hsum8((a0 + a1) + (a2 + a3)), sb = hsum8((b0 + b1) + (b2 + b3));
    for (; i < K; i++) {
        sa += wr[i] * xa[i];
        sb += wr[i] * xb[i];
    }
    if (g->bias) {
        sa += g->bias[o];
        sb += g->bias[o];
    }
    g->y[m0 * g->ys + o] = sa;
    if (pair) g->y[(m0 + 1) * g->ys + o] = sb;
}

static void gemv_task(void *ctx, int id, int threads) {
    const Gemv *g = (const Gemv *)ctx;
    /* contiguous ranges of output rows, 16 at a time so no two threads write one cache line */
    int64_t chunk = ((int64_t)g->n + threads - 1) / threads;
    chunk = (chunk + 15) & ~(int64_t)15;
    int64_t o0 = id * chunk, o1 = o0 + chunk < g->n ? o0 + chunk : g->n;
    for (int64_t o = o0; o < o1; o++) {
        const float *wr = g->w + o * g->ws;
        for (int m = 0; m < g->m; m += 2) dot_row(g, wr, (int)o, m, m + 1 < g->m);
    }
}

/* Returns 0 on success, 1 for shapes it does not take. */
int gemv_f32(const float *x, int64_t xs, const float *w, int64_t ws, const float *bias,
             float *y, int64_t ys, int m, int k, int n, int threads) {
    if (m < 1 || m > GEMV_MAX_M || k < 1 || n < 1) return 1;
    Gemv g = {x, xs, w, ws, bias, y, ys, m, k, n};
    /* a thread per 64 KiB of weights at least: tiny layers are not worth a wake-up */
    int64_t most = ((int64_t)n * k) / 16384;
    if (threads > most) threads = most < 1 ? 1 : (int)most;
    pool_run(gemv_task, &g, threads, 1);   /* only small steps come here */
    return 0;
}

int gemv_max_m(void) { return GEMV_MAX_M; }
