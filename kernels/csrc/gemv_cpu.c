/* Linear layers for a few rows at a time: y[m] = W x[m] (+ bias) for m < M <= GEMV_MAX_M, W an
 * [N, K] row-major weight (nn.Linear's layout), all of one element kind: fp32, bf16 or fp16
 * (convert.h). kernels/cpu_gemv.py loads and calls it.
 *
 * A decode step of one or a few sequences reads every weight once to use it M times: the
 * matmul is a stream of the weights from memory, and what matters is reading them at memory
 * speed. Each output row is one pass over W's row with four independent accumulators (the
 * FMA chains overlap), the M input rows staying in L1; rows are split over the thread pool in
 * contiguous ranges. The sum over K is in a fixed order for every row (four strided partial
 * sums over 32-wide blocks, then the tail), whatever M or the thread count: a sequence's
 * outputs do not depend on the batch it is in.
 *
 * bf16 and fp16 weights stay so in memory (half the bytes of the stream) and become fp32 in
 * registers (convert.h: bf16 by the 16-bit shift, fp16 by F16C where the compiler targets it);
 * the x rows are converted to fp32 once per call (M x K values, not N x M x K), the sums are
 * fp32 and each output is rounded once to the kind on the way out, the bias added before.
 * bf16 weights are read 16 at a time as their even and odd elements (load16_bf16_split: a
 * load and two integer ops per 16), so the converted x rows hold each block of 16 in that
 * order too (x_to_f32): the same products, summed in another fixed order.
 *
 * Plain C with GCC vector extensions (AVX2 with -march=native), no -ffast-math. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "entry_points.h"
#include "thread_pool.h"
#include "vec.h"

#define GEMV_MAX_M 8

/* AVX512_BF16 (vdpbf16ps: 16 products of bf16 pairs into 8 fp32 sums per instruction) where the
 * compiler targets it: bf16 weights then multiply the caller's bf16 rows as they are (subnormal
 * inputs count as zero there, as the instruction does). tests/test_cpu_gemv.py checks that it
 * compiles to the instruction, and on a CPU with AVX512-BF16 (first run on a Zen 4) that the
 * native build holds it: the bf16 GEMV tests then hold its results. */
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define GEMV_DPBF16 1
#include <immintrin.h>
#else
#define GEMV_DPBF16 0
#endif

typedef struct {
    const float *x; int64_t xs;       /* fp32 rows (the caller's, or converted from them) */
    const void *w; int64_t ws;
    const void *bias;
    void *y; int64_t ys;
    int m, k, n, kind;
    const uint16_t *xh; int64_t xhs;  /* the caller's rows when bf16 (GEMV_DPBF16) */
} Gemv;

#if GEMV_DPBF16
static inline v8 dpbf16(v8 acc, const uint16_t *w, const uint16_t *x) {
    __m256 a;
    memcpy(&a, &acc, sizeof a);
    a = _mm256_dpbf16_ps(a, (__m256bh)_mm256_loadu_si256((const __m256i *)w),
                         (__m256bh)_mm256_loadu_si256((const __m256i *)x));
    memcpy(&acc, &a, sizeof acc);
    return acc;
}
#endif

/* 32 weights from element i of a row, as fp32: in order, or for bf16 each 16 as its even
 * elements, then its odd ones (the order x_to_f32 gives the x rows). */
static inline __attribute__((always_inline)) void load32(const void *wr, int i, const int kind,
                                                         v8 *u0, v8 *u1, v8 *u2, v8 *u3) {
    if (kind == KIND_BF16) {
        load16_bf16_split((const uint16_t *)wr + i, u0, u1);
        load16_bf16_split((const uint16_t *)wr + i + 16, u2, u3);
    } else {
        *u0 = load8_kind(wr, i, kind), *u1 = load8_kind(wr, i + 8, kind);
        *u2 = load8_kind(wr, i + 16, kind), *u3 = load8_kind(wr, i + 24, kind);
    }
}

/* x row of k values of `kind` as fp32 in dst, in the order load32 reads the weights: the
 * blocks of 32 (bf16: each 16 as evens then odds), then the tail in order. */
static void x_to_f32(float *dst, const void *x, int k, int kind) {
    int i = 0;
    if (kind == KIND_BF16)
        for (; i + 32 <= k; i += 32)
            for (int h = i; h < i + 32; h += 16) {
                v8 even, odd;
                load16_bf16_split((const uint16_t *)x + h, &even, &odd);
                *(v8u *)(dst + h) = even;
                *(v8u *)(dst + h + 8) = odd;
            }
    row_to_f32(dst + i, (const uint16_t *)x + i, k - i, kind);
}

/* The dot products of one weight row with x rows m0 and m0 + 1 (pair: both, else only m0);
 * kind is a constant where it is inlined. */
static inline __attribute__((always_inline)) void dot_row(const Gemv *g, const void *wr, int64_t o, int m0,
                                                          int pair, const int kind) {
    const float *xa = g->x + m0 * g->xs, *xb = pair ? xa + g->xs : xa;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    const int K = g->k;
    int i = 0;
#if GEMV_DPBF16
    if (kind == KIND_BF16) {    /* the blocks of 32 from the bf16 rows, a0..a1 and b0..b1 */
        const uint16_t *w16 = (const uint16_t *)wr, *ha = g->xh + m0 * g->xhs, *hb = pair ? ha + g->xhs : ha;
        for (; i + 32 <= K; i += 32) {
            a0 = dpbf16(a0, w16 + i, ha + i), a1 = dpbf16(a1, w16 + i + 16, ha + i + 16);
            if (pair) b0 = dpbf16(b0, w16 + i, hb + i), b1 = dpbf16(b1, w16 + i + 16, hb + i + 16);
        }
    }
#endif
    if (pair) {
        for (; i + 32 <= K; i += 32) {
            v8 u0, u1, u2, u3;
            load32(wr, i, kind, &u0, &u1, &u2, &u3);
            a0 += u0 * load8(xa + i); a1 += u1 * load8(xa + i + 8);
            a2 += u2 * load8(xa + i + 16); a3 += u3 * load8(xa + i + 24);
            b0 += u0 * load8(xb + i); b1 += u1 * load8(xb + i + 8);
            b2 += u2 * load8(xb + i + 16); b3 += u3 * load8(xb + i + 24);
        }
    } else {
        for (; i + 32 <= K; i += 32) {
            v8 u0, u1, u2, u3;
            load32(wr, i, kind, &u0, &u1, &u2, &u3);
            a0 += u0 * load8(xa + i); a1 += u1 * load8(xa + i + 8);
            a2 += u2 * load8(xa + i + 16); a3 += u3 * load8(xa + i + 24);
        }
    }
    float sa = hsum8((a0 + a1) + (a2 + a3)), sb = hsum8((b0 + b1) + (b2 + b3));
    for (; i < K; i++) {
        const float wi = get_f32(wr, i, kind);
        sa += wi * xa[i];
        sb += wi * xb[i];
    }
    if (g->bias) {
        sa += get_f32(g->bias, o, kind);
        sb += get_f32(g->bias, o, kind);
    }
    put_f32(g->y, m0 * g->ys + o, sa, kind);
    if (pair) put_f32(g->y, (m0 + 1) * g->ys + o, sb, kind);
}

static inline __attribute__((always_inline)) void gemv_rows(const Gemv *g, int id, int threads, const int kind) {
    /* contiguous ranges of output rows, 16 at a time so no two threads write one cache line */
    int64_t chunk = ((int64_t)g->n + threads - 1) / threads;
    chunk = (chunk + 15) & ~(int64_t)15;
    int64_t o0 = id * chunk, o1 = o0 + chunk < g->n ? o0 + chunk : g->n;
    const int64_t row_bytes = g->ws * kind_size(kind);
    for (int64_t o = o0; o < o1; o++) {
        const void *wr = (const char *)g->w + o * row_bytes;
        for (int m = 0; m < g->m; m += 2) dot_row(g, wr, o, m, m + 1 < g->m, kind);
    }
}

static void gemv_task(void *ctx, int id, int threads) {
    const Gemv *g = (const Gemv *)ctx;
    switch (g->kind) {
    case KIND_BF16: gemv_rows(g, id, threads, KIND_BF16); break;
    case KIND_F16: gemv_rows(g, id, threads, KIND_F16); break;
    default: gemv_rows(g, id, threads, KIND_F32); break;
    }
}

/* x [m, k] (row stride xs), w [n, k] (ws), bias [n] or NULL, y [m, n] (ys), all of `kind`.
 * Returns 0 on success, 1 for shapes or a kind it does not take, 2 when out of memory. */
int gemv_cpu(const void *x, int64_t xs, const void *w, int64_t ws, const void *bias,
             void *y, int64_t ys, int m, int k, int n, int threads, int kind) {
    if (m < 1 || m > GEMV_MAX_M || k < 1 || n < 1 || kind < KIND_F32 || kind > KIND_F16) return 1;
    float *x32 = NULL;
    if (kind != KIND_F32) {
        if (!(x32 = malloc(sizeof(float) * m * k))) return 2;
        for (int r = 0; r < m; r++) x_to_f32(x32 + (int64_t)r * k, (const uint16_t *)x + r * xs, k, kind);
    }
    Gemv g = {x32 ? x32 : (const float *)x, x32 ? k : xs, w, ws, bias, y, ys, m, k, n, kind, x, xs};
    /* a thread per 64 KiB of weights at least: tiny layers are not worth a wake-up */
    int64_t most = (int64_t)n * k * kind_size(kind) / 65536;
    if (threads > most) threads = most < 1 ? 1 : (int)most;
    pool_run(gemv_task, &g, threads, 1);   /* only small steps come here */
    free(x32);
    return 0;
}

int gemv_max_m(void) { return GEMV_MAX_M; }
