/* fp32 linear layers past the small-batch kernel: y[M, N] = x[M, K] W[N, K]^T (+ bias), W an
 * nn.Linear weight packed once (gemm_pack_f32) into panels of NR output columns, k-major
 * ([panel][k][NR], the last panel padded with zeros). kernels/cpu_gemm.py packs and calls it.
 *
 * Loops as in BLIS (Goto's GEMM): per block of KC values of k and MC rows of x, the rows are
 * packed into MR-row tiles (gemm_micro.h's pack_a, about 1% of the work), then every weight
 * panel this thread owns runs over all the row tiles: a panel's slice of W stays in L1 while
 * the packed rows come from L2. Threads split the panels (or the rows, when there are too few
 * panels), on the kernels' thread pool, whose threads then stay awake for the step's next
 * kernel: oneDNN's GEMM ran on torch's OpenMP threads, which sleep between calls, and a wake-up
 * costs up to half a millisecond on a virtual machine (thread_pool.h).
 *
 * Each output is one FMA chain over k in order (gemm_micro.h): a row's result is the same
 * whatever the batch it comes in and the number of threads. */
#include <stdint.h>
#include <string.h>

#include "gemm_micro.h"
#include "thread_pool.h"

#define KC 512          /* a panel's slice: 512 x 16 floats, 32 KiB */
#define MC 96           /* packed rows: 96 x 512 floats, 192 KiB, in L2 */

int64_t gemm_packed_floats(int n, int k) { return (int64_t)((n + NR - 1) / NR) * NR * k; }

/* wp[p][k][j] = w[p * NR + j][k], zero past the last row of w. */
void gemm_pack_f32(const float *w, int64_t ws, int n, int k, float *wp) {
    for (int p = 0; p < (n + NR - 1) / NR; p++) {
        float *dst = wp + (int64_t)p * NR * k;
        for (int j = 0; j < NR; j++) {
            const int o = p * NR + j;
            for (int kk = 0; kk < k; kk++) dst[kk * NR + j] = o < n ? w[(int64_t)o * ws + kk] : 0.0f;
        }
    }
}

typedef struct {
    const float *x; int64_t xs;
    const float *wp; const float *bias;
    float *y; int64_t ys;
    int m, k, n, split_n;
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
    for (int pc = 0; pc < g->k; pc += KC) {
        const int kc = g->k - pc < KC ? g->k - pc : KC;
        const int first = pc == 0, last = pc + kc == g->k;
        for (int ic = m0; ic < m1; ic += MC) {
            const int mc = m1 - ic < MC ? m1 - ic : MC;
            for (int ir = 0; ir < mc; ir += MR)
                pack_a(g->x + (int64_t)(ic + ir) * g->xs + pc, g->xs, 1, mc - ir < MR ? mc - ir : MR, kc,
                       apack + ir * kc);
            for (int p = p0; p < p1; p++) {
                const float *b = g->wp + (int64_t)p * NR * g->k + (int64_t)pc * NR;
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
}

/* Returns 0 on success, 1 for shapes it does not take. */
int gemm_f32(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t ys,
             int m, int k, int n, int threads) {
    if (m < 1 || k < 1 || n < 1 || threads < 1) return 1;
    const int panels = (n + NR - 1) / NR;
    /* a thread per 16 tiles of work at least: a tiny product is not worth a hand-off */
    int64_t most = ((int64_t)(m + MR - 1) / MR) * panels / 16;
    if (threads > most) threads = most < 1 ? 1 : (int)most;
    Gemm g = {x, xs, wp, bias, y, ys, m, k, n, panels >= 4 * threads};
    pool_run(gemm_task, &g, threads, 1);
    return 0;
}
