/* Linear layers past the small-batch kernel: y[M, N] = x[M, K] W[N, K]^T (+ bias), W an
 * nn.Linear weight packed once (gemm_pack) into panels of NR output columns, k-major
 * ([panel][k][NR], the last panel padded with zeros). x, W, the bias and y are of one element
 * kind, fp32, bf16 or fp16 (convert.h); kernels/cpu_gemm.py packs and calls it.
 *
 * Loops as in BLIS (Goto's GEMM): per block of KC values of k and MC rows of x, the rows are
 * packed into MR-row tiles (gemm_micro.h's pack_a, about 1% of the work), then every weight
 * panel this thread owns runs over all the row tiles: a panel's slice of W stays in L1 while
 * the packed rows come from L2. Threads split the panels (or the rows, when there are too few
 * panels), on the kernels' thread pool, whose threads then stay awake for the step's next
 * kernel: oneDNN's GEMM ran on torch's OpenMP threads, which sleep between calls, and a wake-up
 * costs up to half a millisecond on a virtual machine (thread_pool.h).
 *
 * bf16 and fp16: the packed weight keeps the kind (half the bytes of fp32) and a panel's slice
 * becomes fp32 in a buffer in L1 before it runs over the row tiles (KC x NR values converted
 * for up to MC x KC x NR FMAs), the rows become fp32 as they are packed, the products sum in
 * fp32 into an fp32 copy of y, and each thread rounds its part of y to the kind once at the
 * end: the micro-kernel is the fp32 one.
 *
 * Each output is one FMA chain over k in order (gemm_micro.h): a row's result is the same
 * whatever the batch it comes in and the number of threads. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "entry_points.h"
#include "gemm_micro.h"
#include "thread_pool.h"

#define KC 512          /* a panel's slice: 512 x 16 floats, 32 KiB */
#define MC 96           /* packed rows: 96 x 512 floats, 192 KiB, in L2 */

/* Elements of W [n, k] packed (of its kind). */
int64_t gemm_packed_size(int n, int k) { return (int64_t)((n + NR - 1) / NR) * NR * k; }

/* wp[p][k][j] = w[p * NR + j][k], zero past the last row of w; w and wp of `kind`. */
void gemm_pack(const void *w, int64_t ws, int n, int k, void *wp, int kind) {
    for (int p = 0; p < (n + NR - 1) / NR; p++) {
        const int64_t base = (int64_t)p * NR * k;
        for (int j = 0; j < NR; j++) {
            const int o = p * NR + j;
            if (kind == KIND_F32) {
                const float *src = (const float *)w + (int64_t)o * ws;
                float *dst = (float *)wp + base + j;
                for (int kk = 0; kk < k; kk++) dst[kk * NR] = o < n ? src[kk] : 0.0f;
            } else {
                const uint16_t *src = (const uint16_t *)w + (int64_t)o * ws;
                uint16_t *dst = (uint16_t *)wp + base + j;
                for (int kk = 0; kk < k; kk++) dst[kk * NR] = o < n ? src[kk] : 0;
            }
        }
    }
}

typedef struct {
    const void *x; int64_t xs;
    const void *wp; const float *bias;   /* bias: fp32 (the caller's, or converted from it) */
    float *y; int64_t ys;                /* fp32: the caller's, or the copy rounded into out */
    void *out; int64_t outs;             /* y of a bf16/fp16 call, else NULL */
    int m, k, n, split_n, kind;
} Gemm;

/* The last panel's columns past N: through a full tile on the stack. */
static void micro_tail(int R, int kc, const float *a, const float *b, float *c, int64_t ldc,
                       int first, const float *bias, int cols) {
    float t[MR * NR] __attribute__((aligned(32))), tb[NR];
    memset(t, 0, sizeof(t));
    if (!first)
        for (int r = 0; r < R; r++) memcpy(t + r * NR, c + r * ldc, sizeof(float) * cols);
    if (bias) {
        memset(tb, 0, sizeof(tb));
        memcpy(tb, bias, sizeof(float) * cols);
    }
    micro(R, kc, a, b, NR, t, NR, first, bias ? tb : NULL);
    for (int r = 0; r < R; r++) memcpy(c + r * ldc, t + r * NR, sizeof(float) * cols);
}

/* pack_a of R rows of x from element `at` (row stride xs), any kind: bf16/fp16 rows are
 * converted a row at a time (vector lanes) on the way. */
static void pack_rows(const Gemm *g, int64_t at, int R, int kc, float *dst) {
    if (g->kind == KIND_F32) {
        pack_a((const float *)g->x + at, g->xs, 1, R, kc, dst);
        return;
    }
    float row[KC] __attribute__((aligned(32)));
    for (int r = 0; r < MR; r++) {
        if (r < R) row_to_f32(row, (const uint16_t *)g->x + at + r * g->xs, kc, g->kind);
        for (int k = 0; k < kc; k++) dst[k * MR + r] = r < R ? row[k] : 0.0f;
    }
}

static void gemm_task(void *ctx, int id, int threads) {
    const Gemm *g = (const Gemm *)ctx;
    const int panels = (g->n + NR - 1) / NR;
    int p0 = 0, p1 = panels, m0 = 0, m1 = g->m;
    if (g->split_n) {
        int chunk = (panels + threads - 1) / threads;
        p0 = id * chunk < panels ? id * chunk : panels;
        p1 = p0 + chunk < panels ? p0 + chunk : panels;
    } else {
        int rows = ((g->m + threads - 1) / threads + MR - 1) / MR * MR;
        m0 = id * rows < g->m ? id * rows : g->m;
        m1 = m0 + rows < g->m ? m0 + rows : g->m;
    }
    float apack[MC * KC] __attribute__((aligned(32)));
    float bconv[KC * NR] __attribute__((aligned(32)));
    const int esize = kind_size(g->kind);
    for (int pc = 0; pc < g->k; pc += KC) {
        const int kc = g->k - pc < KC ? g->k - pc : KC;
        const int first = pc == 0, last = pc + kc == g->k;
        for (int ic = m0; ic < m1; ic += MC) {
            const int mc = m1 - ic < MC ? m1 - ic : MC;
            for (int ir = 0; ir < mc; ir += MR)
                pack_rows(g, (int64_t)(ic + ir) * g->xs + pc, mc - ir < MR ? mc - ir : MR, kc, apack + ir * kc);
            for (int p = p0; p < p1; p++) {
                const void *panel = (const char *)g->wp + ((int64_t)p * NR * g->k + (int64_t)pc * NR) * esize;
                const float *b = (const float *)panel;
                if (g->kind != KIND_F32) {
                    row_to_f32(bconv, panel, kc * NR, g->kind);
                    b = bconv;
                }
                const int cols = g->n - p * NR < NR ? g->n - p * NR : NR;
                const float *bias = last && g->bias ? g->bias + p * NR : NULL;
                for (int ir = 0; ir < mc; ir += MR) {
                    const int R = mc - ir < MR ? mc - ir : MR;
                    float *c = g->y + (int64_t)(ic + ir) * g->ys + p * NR;
                    if (cols == NR) micro(R, kc, apack + ir * kc, b, NR, c, g->ys, first, bias);
                    else micro_tail(R, kc, apack + ir * kc, b, c, g->ys, first, bias, cols);
                }
            }
        }
    }
    if (g->out) {   /* this thread's part of y, rounded to the kind */
        const int c0 = p0 * NR, c1 = p1 * NR < g->n ? p1 * NR : g->n;
        for (int r = m0; r < m1 && c0 < c1; r++)
            row_from_f32((uint16_t *)g->out + (int64_t)r * g->outs + c0, g->y + (int64_t)r * g->ys + c0,
                         c1 - c0, g->kind);
    }
}

/* x [m, k] (row stride xs), wp packed by gemm_pack, bias [n] or NULL, y [m, n] (ys), all of
 * `kind`. Returns 0 on success, 1 for shapes or a kind it does not take, 2 when out of memory. */
int gemm_cpu(const void *x, int64_t xs, const void *wp, const void *bias, void *y, int64_t ys,
             int m, int k, int n, int threads, int kind) {
    if (m < 1 || k < 1 || n < 1 || threads < 1 || kind < KIND_F32 || kind > KIND_F16) return 1;
    const int panels = (n + NR - 1) / NR;
    /* a thread per 16 tiles of work at least: a tiny product is not worth a hand-off */
    int64_t most = ((int64_t)(m + MR - 1) / MR) * panels / 16;
    if (threads > most) threads = most < 1 ? 1 : (int)most;
    Gemm g = {x, xs, wp, bias, y, ys, NULL, 0, m, k, n, panels >= 4 * threads, kind};
    float *y32 = NULL;
    if (kind != KIND_F32) {     /* fp32 sums and bias, rounded into y at the end */
        if (!(y32 = malloc(sizeof(float) * ((int64_t)m * n + n)))) return 2;
        if (bias) {
            row_to_f32(y32 + (int64_t)m * n, bias, n, kind);
            g.bias = y32 + (int64_t)m * n;
        }
        g.y = y32, g.ys = n, g.out = y, g.outs = ys;
    }
    pool_run(gemm_task, &g, threads, 1);
    free(y32);
    return 0;
}
