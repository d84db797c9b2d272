/* Paged attention for CPUs, reading K/V in place from the block pool (kernels/cpu_attention.py
 * builds and loads this file; kernels/reference.py defines the layout and the semantics).
 *
 * One work item = (sequence, KV head, tile of up to QTILE query tokens): the G query heads that
 * share the KV head and the tile's tokens make up to G * QTILE query rows, so every key and value
 * row is loaded once per item and used for all of them. Two passes per item, as the reference:
 * scores over the visible keys into a scratch row, softmax, then the weighted sum of values.
 * The pool is walked block by block through the block table: no gather, no padding.
 *
 * q, out and the pool fp32, bf16 or fp16 (all one `kind`, convert.h): 16-bit rows are widened as
 * they are loaded and everything is summed in fp32; the output is rounded once. head_dim a
 * multiple of 8. Plain C with GCC vector extensions (AVX2 with
 * -march=native, SSE otherwise); no -ffast-math, so NaN/inf behave as in torch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_cpu.h"
#include "convert.h"
#include "entry_points.h"
#include "thread_pool.h"
#include "vec.h"

#define QTILE 8
#define MAX_ROWS 256 /* G * QTILE */
#define MAX_D 256

typedef struct {
    Paged p;
    const int32_t *seq_lens, *qsl;
    const float *sinks;
    /* cascade (gemm_attention_cpu.c): keys before prefix[s] were attended as a shared
     * prefix, whose unnormalised output and (max, sum) per (token, head) are merged here */
    const int32_t *prefix;
    const float *part_o, *part_ml;
    int hq, hkv, d, bs, window, heads_per_item, kind;
    float scale, softcap;
    const int64_t *items; int64_t n_items;
    int64_t next;
} Job;

/* The next block's rows for this head: the pool is read block by block in table order, which a
 * hardware prefetcher cannot follow across blocks. */
static inline void prefetch_block(const char *p, int bs, int64_t st, int D, int es) {
    for (int t = 0; t < bs; t++)
        for (int c = 0; c < D * es; c += 64) __builtin_prefetch(p + (t * st) * es + c, 0, 3);
}

/* r[i] = sum of the lanes of a[i], for 8 vectors at once (a transpose by shuffles). */
static inline v8 hsum8x8(const v8 *a) {
    const v8i ev = {0, 8, 2, 10, 4, 12, 6, 14}, od = {1, 9, 3, 11, 5, 13, 7, 15};
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], ev) + __builtin_shuffle(a[2 * i], a[2 * i + 1], od);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    return __builtin_shuffle(c[0], c[1], lo4) + __builtin_shuffle(c[0], c[1], hi4);
}

/* D is a constant in each instantiation (64, 128, or any multiple of 8), so that a row's
 * query and accumulator stay in registers. */
static inline __attribute__((always_inline)) void run_item_d(const Job *j, int64_t item, float *scores, const int D,
                                                              const int kind) {
    const int64_t es = kind_size(kind);
    const char *qs = (const char *)j->p.q, *ks = (const char *)j->p.k, *vs = (const char *)j->p.v;
    int64_t s = item >> 32;
    int tile = (int)((item >> 8) & 0xFFFFFF);
    const int h0 = (int)(item & 0xFF) * j->heads_per_item, nh = j->heads_per_item;
    const int G = j->hq / j->hkv, bs = j->bs;
    const int q0 = j->qsl[s], q_len = j->qsl[s + 1] - q0, seq_len = j->seq_lens[s];
    const int r0 = tile * QTILE, r1 = r0 + QTILE < q_len ? r0 + QTILE : q_len;
    const int nt = r1 - r0, hrows = nt * G, rows = hrows * nh;
    const int first_pos = seq_len - q_len;
    /* keys visible to any row of the tile: [lo, hi] */
    const int hi = first_pos + r1 - 1;
    int lo = j->prefix ? j->prefix[s] : 0;
    if (j->window > 0) { lo = first_pos + r0 - j->window + 1; if (lo < 0) lo = 0; }
    const int nk = hi - lo + 1;
    const int stride = (nk + 7) & ~7;
    const int32_t *table = j->p.bt + s * j->p.bt_s;

    float qbuf[MAX_ROWS * MAX_D] __attribute__((aligned(32)));
    /* row r = (local head hl, token t, group member g): hl * hrows + t * G + g */
    for (int hl = 0; hl < nh; hl++)
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < G; g++) {
                const char *src = qs + ((int64_t)(q0 + r0 + t) * j->p.q_st + (int64_t)((h0 + hl) * G + g) * j->p.q_sh) * es;
                row_to_f32(qbuf + (hl * hrows + t * G + g) * D, src, D, kind);
            }

    /* pass 1: scaled scores, eight keys at a time where a block has them */
    const v8 vscale = splat(j->scale);
    for (int b = lo / bs; b <= hi / bs; b++) {
        int t0 = b * bs < lo ? lo - b * bs : 0;
        int t1 = (b + 1) * bs - 1 > hi ? hi - b * bs : bs - 1;
        for (int hl = 0; hl < nh; hl++) {
        const int h = h0 + hl;
        const char *kb = ks + ((int64_t)table[b] * j->p.k_sb + (int64_t)h * j->p.k_sh) * es;
        if (b + 2 <= hi / bs) prefetch_block(ks + ((int64_t)table[b + 2] * j->p.k_sb + (int64_t)h * j->p.k_sh) * es, bs, j->p.k_st, D, es);
        for (int r = hl * hrows; r < (hl + 1) * hrows; r++) {
            const float *qr = qbuf + r * D;
            float *srow = scores + r * stride + b * bs - lo;
            int t = t0;
            for (; t + 8 <= t1 + 1; t += 8) {
                v8 acc[8];
                for (int u = 0; u < 8; u++) {
                    const char *kr = kb + (int64_t)(t + u) * j->p.k_st * es;
                    acc[u] = load8(qr) * load8_kind(kr, 0, kind);
                    for (int c = 8; c < D; c += 8) acc[u] += load8(qr + c) * load8_kind(kr, c, kind);
                }
                *(v8u *)(srow + t) = hsum8x8(acc) * vscale;
            }
            for (; t <= t1; t++) {
                const char *kr = kb + (int64_t)t * j->p.k_st * es;
                v8 acc = load8(qr) * load8_kind(kr, 0, kind);
                for (int c = 8; c < D; c += 8) acc += load8(qr + c) * load8_kind(kr, c, kind);
                srow[t] = hsum8(acc) * j->scale;
            }
        }
        }
    }
    /* softmax per row over its own visible range (masked columns get probability 0) */
    float inv[MAX_ROWS], mx[MAX_ROWS], tot[MAX_ROWS];
    for (int r = 0; r < rows; r++) {
        int t = (r % hrows) / G, g = r % G, h = h0 + r / hrows;
        int pos = first_pos + r0 + t;
        int rlo = lo;
        if (j->window > 0) { rlo = pos - j->window + 1; if (rlo < 0) rlo = 0; }
        int a = rlo - lo, z = pos - lo; /* inclusive columns */
        float *row = scores + r * stride;
        if (j->softcap > 0)
            for (int c = a; c <= z; c++) row[c] = tanhf(row[c] / j->softcap) * j->softcap;
        float m = -INFINITY;
        for (int c = a; c <= z; c++) m = row[c] > m ? row[c] : m;
        float sink = 0;
        if (j->sinks) { sink = j->sinks[h * G + g]; m = sink > m ? sink : m; }
        for (int c = 0; c < a; c++) row[c] = -INFINITY;
        for (int c = z + 1; c < stride; c++) row[c] = -INFINITY;
        v8 vm = splat(m);
        v8 sum = {0};
        for (int c = 0; c < stride; c += 8) {
            v8 p = exp8(load8(row + c) - vm);
            *(v8u *)(row + c) = p;
            sum += p;
        }
        float total = hsum8(sum);
        if (j->sinks) total += expf(sink - m);
        inv[r] = 1.0f / total;
        mx[r] = m;
        tot[r] = total;
    }
    /* pass 2: weighted values, a row's accumulator held in registers over a block */
    float acc[MAX_ROWS * MAX_D] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(float) * rows * D);
    for (int b = lo / bs; b <= hi / bs; b++) {
        int t0 = b * bs < lo ? lo - b * bs : 0;
        int t1 = (b + 1) * bs - 1 > hi ? hi - b * bs : bs - 1;
        for (int hl = 0; hl < nh; hl++) {
        const int h = h0 + hl;
        const char *vb = vs + ((int64_t)table[b] * j->p.v_sb + (int64_t)h * j->p.v_sh) * es;
        if (b + 2 <= hi / bs) prefetch_block(vs + ((int64_t)table[b + 2] * j->p.v_sb + (int64_t)h * j->p.v_sh) * es, bs, j->p.v_st, D, es);
        for (int r = hl * hrows; r < (hl + 1) * hrows; r++) {
            const float *prow = scores + r * stride + b * bs - lo;
            float *ar = acc + r * D;
            v8 a[MAX_D / 8];
            for (int c = 0; c < D; c += 8) a[c / 8] = load8(ar + c);
            for (int t = t0; t <= t1; t++) {
                const char *vr = vb + (int64_t)t * j->p.v_st * es;
                v8 p = splat(prow[t]);
                for (int c = 0; c < D; c += 8) a[c / 8] += load8_kind(vr, c, kind) * p;
            }
            for (int c = 0; c < D; c += 8) *(v8u *)(ar + c) = a[c / 8];
        }
        }
    }
    for (int r = 0; r < rows; r++) {
        int t = (r % hrows) / G, g = r % G, h = h0 + r / hrows;
        char *dst = (char *)j->p.out + ((int64_t)(q0 + r0 + t) * j->p.o_st + (int64_t)(h * G + g) * j->p.o_sh) * es;
        float res[MAX_D] __attribute__((aligned(32)));
        if (j->prefix && j->prefix[s] > 0) {
            const int64_t row = (int64_t)(q0 + r0 + t) * j->hq + h * G + g;
            merge_partials(res, j->part_o + row * D, j->part_ml[row * 2], j->part_ml[row * 2 + 1], acc + r * D,
                           mx[r], tot[r], D);
        } else {
            for (int c = 0; c < D; c++) res[c] = acc[r * D + c] * inv[r];
        }
        row_from_f32(dst, res, D, kind);
    }
}

static void run_item_kind(const Job *j, int64_t item, float *scores, const int kind) {
    if (j->d == 64) run_item_d(j, item, scores, 64, kind);
    else if (j->d == 128) run_item_d(j, item, scores, 128, kind);
    else run_item_d(j, item, scores, j->d, kind);
}

static void run_item(const Job *j, int64_t item, float *scores) {
    if (j->kind == KIND_F32) run_item_kind(j, item, scores, KIND_F32);
    else if (j->kind == KIND_BF16) run_item_kind(j, item, scores, KIND_BF16);
    else run_item_kind(j, item, scores, KIND_F16);
}

static void attention_task(void *arg, int id, int threads) {
    (void)id;
    (void)threads;
    Job *j = (Job *)arg;
    float *scores = NULL;
    size_t cap = 0;
    for (;;) {
        int64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->n_items) break;
        int64_t s = j->items[i] >> 32;
        int q_len = j->qsl[s + 1] - j->qsl[s];
        int G = j->hq / j->hkv;
        int rows = (q_len < QTILE ? q_len : QTILE) * G * j->heads_per_item;
        size_t need = (size_t)rows * (size_t)((j->seq_lens[s] + 7 + 8) & ~7);
        if (need > cap) {
            free(scores);
            cap = need * 2;
            scores = aligned_alloc(32, ((cap * sizeof(float)) + 31) & ~(size_t)31);
            if (!scores) { cap = 0; continue; }
        }
        run_item(j, j->items[i], scores);
    }
    free(scores);
}

/* Returns 0 on success; items are (seq << 32) | (tile << 8) | kv_head, heaviest first; spin:
 * whether the pool's threads spin after this job (a small step's, see thread_pool.h). */
int paged_attention_cpu(const void *q, int64_t q_st, int64_t q_sh,
                        void *out, int64_t o_st, int64_t o_sh,
                        const void *k, int64_t k_sb, int64_t k_st, int64_t k_sh,
                        const void *v, int64_t v_sb, int64_t v_st, int64_t v_sh,
                        const int32_t *bt, int64_t bt_s,
                        const int32_t *seq_lens, const int32_t *qsl,
                        const float *sinks, const int32_t *prefix, const float *part_o,
                        const float *part_ml, int hq, int hkv, int d, int bs, int window,
                        float scale, float softcap, int heads_per_item,
                        const int64_t *items, int64_t n_items, int kind, int threads, int spin) {
    if (d % 8 || d > MAX_D || hq % hkv || heads_per_item < 1 || hkv % heads_per_item || kind < KIND_F32 || kind > KIND_F16
        || (hq / hkv) * heads_per_item * QTILE > MAX_ROWS) return 1;
    /* Paged's pointers are typed for the fp32 kernels; here they are read as `kind` */
    Job j = {{(const float *)q, q_st, q_sh, (float *)out, o_st, o_sh, (const float *)k, k_sb, k_st, k_sh,
              (const float *)v, v_sb, v_st, v_sh, bt, bt_s},
             seq_lens, qsl, sinks, prefix, part_o, part_ml, hq, hkv, d, bs, window, heads_per_item, kind, scale,
             softcap, items, n_items, 0};
    if ((int64_t)threads > n_items) threads = (int)n_items;
    pool_run(attention_task, &j, threads, spin);
    return 0;
}

int qtile(void) { return QTILE; }
