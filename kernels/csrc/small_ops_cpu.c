/* The elementwise parts of a decoder layer, one C call each instead of a chain of torch ops
 * (kernels/cpu_ops.py loads and calls them; kernels/reference.py defines the semantics): RMSNorm
 * with its residual add, neox rotary in place, the KV-cache write, and SiLU(gate) * up.
 *
 * Each is one pass over its rows where the torch chains made four to eight (a temporary per op)
 * and paid microseconds of dispatch per op: at a decode step of a few sequences the dispatch
 * was a third of the step, at large batches the passes a fifth. Rows are split over the
 * kernels' thread pool (thread_pool.h) when there are enough of them to be worth a thread.
 *
 * Activations fp32, bf16 or fp16 (`kind`, convert.h), computed in fp32 and rounded once on the
 * way out, except where the torch reference rounds in between (RMSNorm's residual sum and its
 * normalised row): there the same rounding is made. no -ffast-math. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "convert.h"
#include "entry_points.h"
#include "thread_pool.h"
#include "vec.h"

#define SMALL_STEP_ROWS 8        /* as gemv_cpu.c's GEMV_MAX_M: a small step spins the pool */
#define MIN_FLOATS_PER_THREAD 16384
#define WAKE_FLOATS (1 << 20)

static int threads_for(int64_t rows, int64_t floats_per_row, int threads) {
    /* A few hundred microseconds of work at most: not worth waking a sleeping pool thread,
     * which costs up to half a millisecond on a VM (a large step's write_kv waited 0.8 ms for
     * 25 us of copying). An awake pool (a small step's, spinning) still takes it. */
    if (rows * floats_per_row < WAKE_FLOATS && pool_asleep()) return 1;
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
    const void *x; int64_t x_st;
    const void *res; int64_t r_st;
    const void *w; float eps;
    void *out; int64_t o_st;
    void *h; int64_t h_st;
    int T, D, kind;
} Norm;

/* A 16-bit row, as add_rms_norm_ref rounds it: h = round(x + res), normed = round(h * inv),
 * out = round(normed * w); the sum of squares over the rounded h in fp32. */
static void norm_row_16(const Norm *n, int64_t t) {
    const int D = n->D, K = n->kind;
    const uint16_t *x = (const uint16_t *)n->x + t * n->x_st;
    const uint16_t *src = x;
    if (n->res) {
        const uint16_t *rr = (const uint16_t *)n->res + t * n->r_st;
        uint16_t *hr = (uint16_t *)n->h + t * n->h_st;
        for (int i = 0; i < D; i++) put_f32(hr, i, get_f32(x, i, K) + get_f32(rr, i, K), K);
        src = hr;
    }
    float ss = 0;
    for (int i = 0; i < D; i++) {
        float v = get_f32(src, i, K);
        ss += v * v;
    }
    float inv = 1.0f / sqrtf(ss / (float)D + n->eps);
    uint16_t *o = (uint16_t *)n->out + t * n->o_st;
    for (int i = 0; i < D; i++) put_f32(o, i, round_to(get_f32(src, i, K) * inv, K) * get_f32(n->w, i, K), K);
}

static void norm_task(void *ctx, int id, int threads) {
    const Norm *n = (const Norm *)ctx;
    const int D = n->D;
    int64_t t0, t1;
    row_range(n->T, id, threads, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        if (n->kind != KIND_F32) {
            norm_row_16(n, t);
            continue;
        }
        const float *src = (const float *)n->x + t * n->x_st;
        if (n->res) {
            const float *rr = (const float *)n->res + t * n->r_st;
            float *hr = (float *)n->h + t * n->h_st;
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
        float *o = (float *)n->out + t * n->o_st;
        const float *w = (const float *)n->w;
        for (i = 0; i < D; i++) o[i] = w[i] * (src[i] * inv);
    }
}

/* out = RMSNorm(x + residual) * weight and h = x + residual (residual NULL: h = x, not written).
 * As add_rms_norm_ref: the sum of squares in fp32, the normalised row times the weight; x,
 * residual, weight, out and h all of `kind`. */
int add_rms_norm_f32(const void *x, int64_t x_st, const void *res, int64_t r_st,
                     const void *w, float eps, void *out, int64_t o_st, void *h, int64_t h_st,
                     int T, int D, int kind, int threads) {
    if (kind < KIND_F32 || kind > KIND_F16) return 1;
    Norm n = {x, x_st, res, r_st, w, eps, out, o_st, h, h_st, T, D, kind};
    pool_run(norm_task, &n, threads_for(T, 3 * D, threads), T <= SMALL_STEP_ROWS);
    return 0;
}

/* ---- rotary ---- */

typedef struct {
    const int64_t *pos;
    void *q; int64_t q_st, q_sh; int hq;
    void *k; int64_t k_st, k_sh; int hk;
    const float *cos_t, *sin_t; int64_t cs_st;
    int T, D, kind;
} Rotary;

static void rotate_head(float *x, const float *c, const float *s, int half) {
    float tmp[512];
    for (int i = 0; i < half; i++) tmp[i] = x[i];
    for (int i = 0; i < half; i++) x[i] = x[i] * c[i] - x[i + half] * s[i];
    for (int i = 0; i < half; i++) x[i + half] = x[i + half] * c[i + half] + tmp[i] * s[i + half];
}

/* A 16-bit head: widened, rotated in fp32 with the fp32 table, rounded once. */
static void rotate_head_16(uint16_t *x, const float *c, const float *s, int D, int kind) {
    float buf[1024];
    row_to_f32(buf, x, D, kind);
    rotate_head(buf, c, s, D / 2);
    row_from_f32(x, buf, D, kind);
}

static void rotary_task(void *ctx, int id, int threads) {
    const Rotary *r = (const Rotary *)ctx;
    int64_t t0, t1;
    row_range(r->T, id, threads, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float *c = r->cos_t + r->pos[t] * r->cs_st, *s = r->sin_t + r->pos[t] * r->cs_st;
        if (r->kind != KIND_F32) {
            for (int h = 0; h < r->hq; h++)
                rotate_head_16((uint16_t *)r->q + t * r->q_st + h * r->q_sh, c, s, r->D, r->kind);
            for (int h = 0; h < r->hk; h++)
                rotate_head_16((uint16_t *)r->k + t * r->k_st + h * r->k_sh, c, s, r->D, r->kind);
            continue;
        }
        for (int h = 0; h < r->hq; h++) rotate_head((float *)r->q + t * r->q_st + h * r->q_sh, c, s, r->D / 2);
        for (int h = 0; h < r->hk; h++) rotate_head((float *)r->k + t * r->k_st + h * r->k_sh, c, s, r->D / 2);
    }
}

/* Neox rotary in place: q [T, Hq, D] and k [T, Hk, D] (strides per token and head, D contiguous)
 * of `kind` by the cos/sin rows [positions[t]] of a [max_pos, D] fp32 table whose two halves are equal.
 * Returns 1 for a head size it does not take, 2 for a position outside the table (nothing
 * written then). */
int rotary_neox_f32(const int64_t *pos, void *q, int64_t q_st, int64_t q_sh, int hq,
                    void *k, int64_t k_st, int64_t k_sh, int hk,
                    const float *cos_t, const float *sin_t, int64_t cs_st, int64_t max_pos,
                    int T, int D, int kind, int threads) {
    if (D % 2 || D / 2 > 512 || kind < KIND_F32 || kind > KIND_F16) return 1;
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return 2;
    Rotary r = {pos, q, q_st, q_sh, hq, k, k_st, k_sh, hk, cos_t, sin_t, cs_st, T, D, kind};
    pool_run(rotary_task, &r, threads_for(T, (int64_t)(hq + hk) * D, threads), T <= SMALL_STEP_ROWS);
    return 0;
}

/* ---- KV-cache write ---- */

typedef struct {
    const char *key; int64_t k_st, k_sh;
    const char *value; int64_t v_st, v_sh;
    char *kc; int64_t kc_sb, kc_so, kc_sh;
    char *vc; int64_t vc_sb, vc_so, vc_sh;
    const int64_t *slots;
    int T, H, D, bs, es;          /* es: bytes per element (the caches' dtype is the rows') */
} WriteKV;

static void write_kv_task(void *ctx, int id, int threads) {
    const WriteKV *w = (const WriteKV *)ctx;
    int64_t t0, t1;
    row_range(w->T, id, threads, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        int64_t slot = w->slots[t];
        if (slot < 0) continue;
        int64_t b = slot / w->bs, o = slot % w->bs;
        const int64_t es = w->es;
        for (int h = 0; h < w->H; h++) {
            memcpy(w->kc + (b * w->kc_sb + o * w->kc_so + h * w->kc_sh) * es,
                   w->key + (t * w->k_st + h * w->k_sh) * es, (size_t)w->D * es);
            memcpy(w->vc + (b * w->vc_sb + o * w->vc_so + h * w->vc_sh) * es,
                   w->value + (t * w->v_st + h * w->v_sh) * es, (size_t)w->D * es);
        }
    }
}

/* key/value [T, H, D] of `kind` into caches of the same kind at slots[t] (-1: skip): block slots[t] / bs, offset
 * slots[t] % bs, cache strides per block, offset and head (D contiguous). Returns 1 for a slot
 * past n_slots (nothing written then). */
int write_kv_f32(const void *key, int64_t k_st, int64_t k_sh, const void *value, int64_t v_st,
                 int64_t v_sh, void *kc, int64_t kc_sb, int64_t kc_so, int64_t kc_sh, void *vc,
                 int64_t vc_sb, int64_t vc_so, int64_t vc_sh, const int64_t *slots, int64_t n_slots,
                 int T, int H, int D, int bs, int kind, int threads) {
    if (kind < KIND_F32 || kind > KIND_F16) return 2;
    for (int t = 0; t < T; t++)
        if (slots[t] >= n_slots) return 1;
    WriteKV w = {key, k_st, k_sh, value, v_st, v_sh, kc, kc_sb, kc_so, kc_sh, vc, vc_sb, vc_so, vc_sh,
                 slots, T, H, D, bs, kind_size(kind)};
    pool_run(write_kv_task, &w, threads_for(T, 2 * (int64_t)H * D, threads), T <= SMALL_STEP_ROWS);
    return 0;
}

/* ---- SiLU(gate) * up ---- */

typedef struct {
    const void *gu; int64_t gu_st;
    void *out; int64_t o_st;
    int T, I, kind;
} SiluMul;

static inline __attribute__((always_inline)) void silu_mul_row(const void *g, const void *u, void *o, int I,
                                                                int kind) {
    int i = 0;
    for (; i + 8 <= I; i += 8) {
        v8 x = load8_kind(g, i, kind);
        store8_kind(o, i, x / (splat(1.0f) + exp8(-x)) * load8_kind(u, i, kind), kind);
    }
    for (; i < I; i++) {
        float x = get_f32(g, i, kind);
        put_f32(o, i, x / (1.0f + expf(-x)) * get_f32(u, i, kind), kind);
    }
}

static void silu_mul_task(void *ctx, int id, int threads) {
    const SiluMul *m = (const SiluMul *)ctx;
    int64_t t0, t1;
    row_range(m->T, id, threads, &t0, &t1);
    const int64_t es = kind_size(m->kind);
    for (int64_t t = t0; t < t1; t++) {
        const char *g = (const char *)m->gu + t * m->gu_st * es, *u = g + m->I * es;
        char *o = (char *)m->out + t * m->o_st * es;
        if (m->kind == KIND_F32) silu_mul_row(g, u, o, m->I, KIND_F32);
        else if (m->kind == KIND_BF16) silu_mul_row(g, u, o, m->I, KIND_BF16);
        else silu_mul_row(g, u, o, m->I, KIND_F16);
    }
}

/* out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:], as F.silu(gate) * up, both of `kind`
 * (computed in fp32, rounded once). */
int silu_mul_f32(const void *gu, int64_t gu_st, void *out, int64_t o_st, int T, int I, int kind, int threads) {
    if (kind < KIND_F32 || kind > KIND_F16) return 1;
    SiluMul m = {gu, gu_st, out, o_st, T, I, kind};
    pool_run(silu_mul_task, &m, threads_for(T, 3 * (int64_t)I, threads), T <= SMALL_STEP_ROWS);
    return 0;
}
