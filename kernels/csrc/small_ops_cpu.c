/* The elementwise parts of a decoder layer, one C call each instead of a chain of torch ops
 * (kernels/cpu_ops.py loads and calls them; kernels/reference.py defines the semantics): RMSNorm
 * with its residual add, neox rotary in place, the KV-cache write, and SiLU(gate) * up.
 *
 * Each is one pass over its rows where the torch chains made four to eight (a temporary per op)
 * and paid microseconds of dispatch per op: at a decode step of a few sequences the dispatch
 * was a third of the step, at large batches the passes a fifth. Rows are split over the
 * kernels' thread pool (thread_pool.h) when there are enough of them to be worth a thread.
 *
 * fp32 only; no -ffast-math. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "thread_pool.h"
#include "vec.h"

#define SMALL_STEP_ROWS 8        /* as gemv_cpu.c's GEMV_MAX_M: a small step spins the pool */
#define MIN_FLOATS_PER_THREAD 16384

static int threads_for(int64_t rows, int64_t floats_per_row, int threads) {
    int64_t most = rows * floats_per_row / MIN_FLOATS_PER_THREAD;
    if (most < 1) most = 1;
    if (most > rows) most = rows;
    return threads < most ? threads : (int)most;
}

static void row_range(int64_t rows, int id, int threads, int64_t *r0, int64_t *r1) {
    int64_t chunk = (rows + threads - 1) / threads;
    *r0 = id * chunk;
    *r1 = *r0 + chunk < rows ? *r0 + chunk : rows;
}

/* ---- RMSNorm (+ residual) ---- */

typedef struct {
    const float *x; int64_t x_st;
    const float *res; int64_t r_st;
    const float *w; float eps;
    float *out; int64_t o_st;
    float *h; int64_t h_st;
    int T, D;
} Norm;

static void norm_task(void *ctx, int id, int threads) {
    const Norm *n = (const Norm *)ctx;
    const int D = n->D;
    int64_t t0, t1;
    row_range(n->T, id, threads, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float *src = n->x + t * n->x_st;
        if (n->res) {
            const float *rr = n->res + t * n->r_st;
            float *hr = n->h + t * n->h_st;
            for (int i = 0; i < D; i++) hr[i] = src[i] + rr[i];
            src = hr;
        }
        float part[8] = {0};
        int i = 0;
        for (; i + 8 <= D; i += 8)
            for (int l = 0; l < 8; l++) part[l] += src[i + l] * src[i + l];
        float ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
        for (; i < D; i++) ss += src[i] * src[i];
        float inv = 1.0f / sqrtf(ss / (float)D + n->eps);
        float *o = n->out + t * n->o_st;
        for (i = 0; i < D; i++) o[i] = n->w[i] * (src[i] * inv);
    }
}

/* out = RMSNorm(x + residual) * weight and h = x + residual (residual NULL: h = x, not written).
 * As add_rms_norm_ref: the sum of squares in fp32, the normalised row times the weight. */
int add_rms_norm_f32(const float *x, int64_t x_st, const float *res, int64_t r_st,
                     const float *w, float eps, float *out, int64_t o_st, float *h, int64_t h_st,
                     int T, int D, int threads) {
    Norm n = {x, x_st, res, r_st, w, eps, out, o_st, h, h_st, T, D};
    pool_run(norm_task, &n, threads_for(T, 3 * D, threads), T <= SMALL_STEP_ROWS);
    return 0;
}

/* ---- rotary ---- */

typedef struct {
    const int64_t *pos;
    float *q; int64_t q_st, q_sh; int hq;
    float *k; int64_t k_st, k_sh; int hk;
    const float *cos_t, *sin_t; int64_t cs_st;
    int T, D;
} Rotary;

static void rotate_head(float *x, const float *c, const float *s, int half) {
    float tmp[512];
    for (int i = 0; i < half; i++) tmp[i] = x[i];
    for (int i = 0; i < half; i++) x[i] = x[i] * c[i] - x[i + half] * s[i];
    for (int i = 0; i < half; i++) x[i + half] = x[i + half] * c[i + half] + tmp[i] * s[i + half];
}

static void rotary_task(void *ctx, int id, int threads) {
    const Rotary *r = (const Rotary *)ctx;
    int64_t t0, t1;
    row_range(r->T, id, threads, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float *c = r->cos_t + r->pos[t] * r->cs_st, *s = r->sin_t + r->pos[t] * r->cs_st;
        for (int h = 0; h < r->hq; h++) rotate_head(r->q + t * r->q_st + h * r->q_sh, c, s, r->D / 2);
        for (int h = 0; h < r->hk; h++) rotate_head(r->k + t * r->k_st + h * r->k_sh, c, s, r->D / 2);
    }
}

/* Neox rotary in place: q [T, Hq, D] and k [T, Hk, D] (strides per token and head, D contiguous)
 * by the cos/sin rows [positions[t]] of a [max_pos, D] table whose two halves are equal.
 * Returns 1 for a head size it does not take, 2 for a position outside the table (nothing
 * written then). */
int rotary_neox_f32(const int64_t *pos, float *q, int64_t q_st, int64_t q_sh, int hq,
                    float *k, int64_t k_st, int64_t k_sh, int hk,
                    const float *cos_t, const float *sin_t, int64_t cs_st, int64_t max_pos,
                    int T, int D, int threads) {
    if (D % 2 || D / 2 > 512) return 1;
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return 2;
    Rotary r = {pos, q, q_st, q_sh, hq, k, k_st, k_sh, hk, cos_t, sin_t, cs_st, T, D};
    pool_run(rotary_task, &r, threads_for(T, (int64_t)(hq + hk) * D, threads), T <= SMALL_STEP_ROWS);
    return 0;
}

/* ---- KV-cache write ---- */

typedef struct {
    const float *key; int64_t k_st, k_sh;
    const float *value; int64_t v_st, v_sh;
    float *kc; int64_t kc_sb, kc_so, kc_sh;
    float *vc; int64_t vc_sb, vc_so, vc_sh;
    const int64_t *slots;
    int T, H, D, bs;
} WriteKV;

static void write_kv_task(void *ctx, int id, int threads) {
    const WriteKV *w = (const WriteKV *)ctx;
    int64_t t0, t1;
    row_range(w->T, id, threads, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        int64_t slot = w->slots[t];
        if (slot < 0) continue;
        int64_t b = slot / w->bs, o = slot % w->bs;
        for (int h = 0; h < w->H; h++) {
            memcpy(w->kc + b * w->kc_sb + o * w->kc_so + h * w->kc_sh, w->key + t * w->k_st + h * w->k_sh,
                   (size_t)w->D * sizeof(float));
            memcpy(w->vc + b * w->vc_sb + o * w->vc_so + h * w->vc_sh, w->value + t * w->v_st + h * w->v_sh,
                   (size_t)w->D * sizeof(float));
        }
    }
}

/* key/value [T, H, D] into the caches at slots[t] (-1: skip): block slots[t] / bs, offset
 * slots[t] % bs, cache strides per block, offset and head (D contiguous). Returns 1 for a slot
 * past n_slots (nothing written then). */
int write_kv_f32(const float *key, int64_t k_st, int64_t k_sh, const float *value, int64_t v_st,
                 int64_t v_sh, float *kc, int64_t kc_sb, int64_t kc_so, int64_t kc_sh, float *vc,
                 int64_t vc_sb, int64_t vc_so, int64_t vc_sh, const int64_t *slots, int64_t n_slots,
                 int T, int H, int D, int bs, int threads) {
    for (int t = 0; t < T; t++)
        if (slots[t] >= n_slots) return 1;
    WriteKV w = {key, k_st, k_sh, value, v_st, v_sh, kc, kc_sb, kc_so, kc_sh, vc, vc_sb, vc_so, vc_sh,
                 slots, T, H, D, bs};
    pool_run(write_kv_task, &w, threads_for(T, 2 * (int64_t)H * D, threads), T <= SMALL_STEP_ROWS);
    return 0;
}

/* ---- SiLU(gate) * up ---- */

typedef struct {
    const float *gu; int64_t gu_st;
    float *out; int64_t o_st;
    int T, I;
} SiluMul;

static void silu_mul_task(void *ctx, int id, int threads) {
    const SiluMul *m = (const SiluMul *)ctx;
    int64_t t0, t1;
    row_range(m->T, id, threads, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float *g = m->gu + t * m->gu_st, *u = g + m->I;
        float *o = m->out + t * m->o_st;
        int i = 0;
        for (; i + 8 <= m->I; i += 8) {
            v8 x = load8(g + i);
            *(v8u *)(o + i) = x / (splat(1.0f) + exp8(-x)) * load8(u + i);
        }
        for (; i < m->I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:], as F.silu(gate) * up. */
int silu_mul_f32(const float *gu, int64_t gu_st, float *out, int64_t o_st, int T, int I, int threads) {
    SiluMul m = {gu, gu_st, out, o_st, T, I};
    pool_run(silu_mul_task, &m, threads_for(T, 3 * (int64_t)I, threads), T <= SMALL_STEP_ROWS);
    return 0;
}
