/* Attention as matrix products for CPUs (kernels/cpu_attention.py plans the jobs;
 * paged_attention_cpu.c computes what is left, one sequence at a time).
 *
 * A job is a set of query rows (tokens x the query heads of one KV head) against one range of
 * keys of one block table, computed as S = Q K^T for all rows at once, softmax per row,
 * O = P V, each in gemm_micro.h's register tiles, KEY_CHUNK keys at a time with a running max
 * and sum per row (flash attention's online softmax), so that the scores, keys and values in
 * use stay in L1 and L2 however long the range. Two kinds:
 *
 * - shared: the members of a cascade group (sequences whose block tables begin with the same
 *   blocks: a system prompt shared through the prefix cache, parallel samples of one prompt,
 *   every query token after those blocks) against the shared keys, unmasked. Each shared key
 *   is read once per group instead of once per member. The result per row is the prefix's
 *   unnormalised output with its max and sum (part_o, part_ml), merged later with the rest.
 * - own: a prefill chunk of one sequence against its keys from its shared prefix (or 0) to
 *   its last token, causal (a row sees keys up to its own position); the result is final,
 *   merged with the shared prefix's partials when it has one.
 *
 * Passes over the pool: the keys and values of each (job, KV head) are packed first (K
 * transposed into 16-key panels, V contiguous, both zero-padded to a multiple of 16 keys),
 * then the shared jobs' items run, then the own jobs' (which read the shared partials).
 * q, out and the pool fp32, bf16 or fp16 (one `kind`, convert.h): 16-bit keys and values
 * become fp32 as they are packed, query rows as they are packed, and each output row is
 * rounded once on the way out; the products are the fp32 ones. Head_dim a multiple of 16, no
 * window, soft-cap or sinks (the planner sends those to paged_attention_cpu.c). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "convert.h"
#include "gemm_micro.h"
#include "attention_cpu.h"
#include "thread_pool.h"
#include "vec.h"

#define JOB_ROWS 48              /* most query rows per item: 8 register tiles */
#define KEY_CHUNK 128            /* keys per online-softmax step: 32 KiB of keys, of values at d 64 */
#define LDS (KEY_CHUNK + NR)     /* a score row's stride: not a multiple of 4 KiB (cache sets) */

enum { TO_PARTIALS = 0, FINAL = 1, FINAL_MERGED = 2 };

typedef struct {
    Paged p;
    int hq, hkv, d, bs;
    float scale;
    int n_jobs, kind;
    /* per job: the sequence whose table holds the keys, the keys [klo, klo + len), its rows'
     * tokens tok[tok_off[j]:tok_off[j + 1]], the position of its first token (causal jobs;
     * -1: unmasked), what becomes of the result, where its packed keys start in scratch */
    const int32_t *j_rep, *j_klo, *j_len, *j_tok_off, *j_pos0, *j_mode, *tok;
    const int64_t *j_pack_off;
    float *part_o, *part_ml;     /* per (token, query head): D floats; max and sum */
    float *scratch;              /* packed keys and values, then per-thread work space */
    int64_t work_floats;         /* per thread */
    const int64_t *items; int64_t n_items;
    int64_t next;
} Jobs;

static inline int padded(int n) { return (n + NR - 1) / NR * NR; }

/* rows per item for a job of `total` rows per KV head: as even as JOB_ROWS allows */
static inline int item_rows(int total) {
    const int chunks = (total + JOB_ROWS - 1) / JOB_ROWS;
    return ((total + chunks - 1) / chunks + MR - 1) / MR * MR;
}

/* (job, KV head) i: its keys transposed into 16-key panels and its values, both padded */
static void pack_task(void *ctx, int id, int threads) {
    Jobs *c = (Jobs *)ctx;
    const int D = c->d, kind = c->kind, es = kind_size(kind);
    for (int64_t i = id; i < (int64_t)c->n_jobs * c->hkv; i += threads) {
        const int j = (int)(i / c->hkv), h = (int)(i % c->hkv);
        const int P = c->j_len[j], Pp = padded(P), klo = c->j_klo[j];
        const int32_t *table = c->p.bt + (int64_t)c->j_rep[j] * c->p.bt_s;
        float *kt = c->scratch + c->j_pack_off[j] + (int64_t)h * Pp * D * 2, *vp = kt + (int64_t)Pp * D;
        for (int t = 0; t < Pp; t++) {
            float *vrow = vp + (int64_t)t * D;
            float *kcol = kt + (int64_t)(t / NR) * D * NR + t % NR;
            if (t >= P) {
                memset(vrow, 0, sizeof(float) * D);
                for (int e = 0; e < D; e++) kcol[e * NR] = 0.0f;
                continue;
            }
            const int key = klo + t;
            const int64_t blk = table[key / c->bs], off = key % c->bs;
            const char *kr = (const char *)c->p.k + (blk * c->p.k_sb + off * c->p.k_st + h * c->p.k_sh) * es;
            row_to_f32(vrow, (const char *)c->p.v + (blk * c->p.v_sb + off * c->p.v_st + h * c->p.v_sh) * es, D,
                       kind);
            for (int e = 0; e < D; e += 8) {
                v8 x = load8_kind(kr, e, kind);
                for (int u = 0; u < 8; u++) kcol[(e + u) * NR] = x[u];
            }
        }
    }
}

/* item = (job << 32) | (chunk << 16) | KV head */
static void run_item(Jobs *c, int64_t item, float *work) {
    const int j = (int)(item >> 32), chunk = (int)((item >> 16) & 0xFFFF), h = (int)(item & 0xFFFF);
    const int D = c->d, G = c->hq / c->hkv, P = c->j_len[j], Pp = padded(P), klo = c->j_klo[j];
    const int32_t *toks = c->tok + c->j_tok_off[j];
    const int total = (c->j_tok_off[j + 1] - c->j_tok_off[j]) * G, causal = c->j_pos0[j] >= 0;
    const int per = item_rows(total), r0 = chunk * per, rows = total - r0 < per ? total - r0 : per;
    const float *kt = c->scratch + c->j_pack_off[j] + (int64_t)h * Pp * D * 2, *vp = kt + (int64_t)Pp * D;
    /* key offsets (from klo) the first and last row see up to; tokens of a job are in order */
    const int see_lo = causal ? c->j_pos0[j] + toks[r0 / G] - toks[0] - klo : P - 1;
    const int see_hi = causal ? c->j_pos0[j] + toks[(r0 + rows - 1) / G] - toks[0] - klo : P - 1;
    /* work: packed queries [tiles][D][MR], scores [rows][LDS], packed probabilities
     * [KEY_CHUNK][MR], the output [rows][D], then max and sum per row */
    float *qp = work, *s = qp + JOB_ROWS * D, *pp = s + JOB_ROWS * LDS;
    float *o = pp + KEY_CHUNK * MR, *mrow = o + JOB_ROWS * D, *lrow = mrow + JOB_ROWS;
    for (int r = 0; r < (rows + MR - 1) / MR * MR; r++) {
        float *dst = qp + (int64_t)(r / MR) * D * MR + r % MR;
        if (r >= rows) {
            for (int e = 0; e < D; e++) dst[e * MR] = 0.0f;
            continue;
        }
        const int row = r0 + r;
        const void *src = (const char *)c->p.q
                          + ((int64_t)toks[row / G] * c->p.q_st + (int64_t)(h * G + row % G) * c->p.q_sh) * kind_size(c->kind);
        for (int e = 0; e < D; e++) dst[e * MR] = get_f32(src, e, c->kind) * c->scale;
        mrow[r] = -INFINITY;
        lrow[r] = 0.0f;
    }
    for (int k0 = 0; k0 < Pp && k0 <= see_hi; k0 += KEY_CHUNK) {
        const int kn = Pp - k0 < KEY_CHUNK ? Pp - k0 : KEY_CHUNK;
        for (int p = 0; p < kn / NR; p++)
            for (int r = 0; r < rows; r += MR)
                micro(rows - r < MR ? rows - r : MR, D, qp + (int64_t)r * D, kt + (int64_t)(k0 / NR + p) * D * NR,
                      NR, s + (int64_t)r * LDS + p * NR, LDS, 1, NULL);
        const int masked = k0 + kn - 1 > see_lo || P < k0 + kn;
        for (int r = 0; r < rows; r++) {
            float *row = s + (int64_t)r * LDS;
            if (masked) {   /* past the range, or past the row's own position */
                int last = P - 1 - k0;
                if (causal) {
                    const int row_id = r0 + r;
                    const int mine = c->j_pos0[j] + toks[row_id / G] - toks[0] - klo - k0;
                    last = mine < last ? mine : last;
                }
                for (int t = last + 1 < 0 ? 0 : last + 1; t < kn; t++) row[t] = -INFINITY;
            }
            v8 vmax = splat(-INFINITY);
            for (int t = 0; t < kn; t += 8) {
                v8 x = load8(row + t);
                vmax = select8(x > vmax, x, vmax);
            }
            float m = mrow[r];
            for (int i = 0; i < 8; i++) m = vmax[i] > m ? vmax[i] : m;
            const v8 vm = splat(m);
            v8 sum = {0};
            for (int t = 0; t < kn; t += 8) {
                v8 e = exp8(load8(row + t) - vm);
                *(v8u *)(row + t) = e;
                sum += e;
            }
            if (k0 > 0) {   /* earlier chunks were summed against a smaller max */
                const float alpha = expf(mrow[r] - m);
                float *orow = o + (int64_t)r * D;
                for (int e = 0; e < D; e += 8) *(v8u *)(orow + e) = load8(orow + e) * splat(alpha);
                lrow[r] *= alpha;
            }
            mrow[r] = m;
            lrow[r] += hsum8(sum);
        }
        for (int r = 0; r < rows; r += MR) {
            const int R = rows - r < MR ? rows - r : MR;
            pack_a(s + (int64_t)r * LDS, LDS, 1, R, kn, pp);
            for (int e = 0; e < D; e += NR)
                micro(R, kn, pp, vp + (int64_t)k0 * D + e, D, o + (int64_t)r * D + e, D, k0 == 0, NULL);
        }
    }
    const int mode = c->j_mode[j];
    for (int r = 0; r < rows; r++) {
        const int row = r0 + r, t = toks[row / G], head = h * G + row % G;
        const int64_t at = (int64_t)t * c->hq + head;
        const float *orow = o + (int64_t)r * D;
        if (mode == TO_PARTIALS) {
            memcpy(c->part_o + at * D, orow, sizeof(float) * D);
            c->part_ml[at * 2] = mrow[r];
            c->part_ml[at * 2 + 1] = lrow[r];
            continue;
        }
        void *dst = (char *)c->p.out + ((int64_t)t * c->p.o_st + (int64_t)head * c->p.o_sh) * kind_size(c->kind);
        float res[D];
        if (mode == FINAL) {
            const float inv = 1.0f / lrow[r];
            for (int e = 0; e < D; e++) res[e] = orow[e] * inv;
        } else {
            merge_partials(res, c->part_o + at * D, c->part_ml[at * 2], c->part_ml[at * 2 + 1], orow, mrow[r],
                           lrow[r], D);
        }
        row_from_f32(dst, res, D, c->kind);
    }
}

static void item_task(void *ctx, int id, int threads) {
    (void)threads;
    Jobs *c = (Jobs *)ctx;
    float *work = c->scratch + c->j_pack_off[c->n_jobs] + (int64_t)id * c->work_floats;
    for (;;) {
        int64_t i = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED);
        if (i >= c->n_items) break;
        run_item(c, c->items[i], work);
    }
}

/* Floats of work space one thread needs (run_item's layout). */
int64_t gemm_attention_work_floats(int d) {
    return (int64_t)JOB_ROWS * d + (int64_t)JOB_ROWS * LDS + KEY_CHUNK * MR + (int64_t)JOB_ROWS * d
           + 2 * JOB_ROWS;
}

/* Returns 0 on success, 1 for what it does not take. scratch holds j_pack_off[n_jobs] floats
 * of packed keys and values, then threads x gemm_attention_work_floats(d). items: as run_item
 * decodes them, the shared jobs' first (n_first of them), the heaviest first in each part. */
int gemm_attention_cpu(const float *q, int64_t q_st, int64_t q_sh, float *out, int64_t o_st, int64_t o_sh,
                       const float *k, int64_t k_sb, int64_t k_st, int64_t k_sh,
                       const float *v, int64_t v_sb, int64_t v_st, int64_t v_sh,
                       const int32_t *bt, int64_t bt_s, int hq, int hkv, int d, int bs, float scale,
                       int n_jobs, const int32_t *j_rep, const int32_t *j_klo, const int32_t *j_len,
                       const int32_t *j_tok_off, const int32_t *j_pos0, const int32_t *j_mode,
                       const int32_t *tok, const int64_t *j_pack_off, float *part_o, float *part_ml,
                       float *scratch, int64_t work_floats, const int64_t *items, int64_t n_first,
                       int64_t n_items, int kind, int threads) {
    if (d % NR || hq % hkv || n_jobs < 1 || bs < 1 || n_first > n_items || kind < KIND_F32 || kind > KIND_F16)
        return 1;
    Jobs c = {{q, q_st, q_sh, out, o_st, o_sh, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh, bt, bt_s},
              hq, hkv, d, bs, scale, n_jobs, kind, j_rep, j_klo, j_len, j_tok_off, j_pos0, j_mode, tok,
              j_pack_off, part_o, part_ml, scratch, work_floats, items, 0, 0};
    pool_run(pack_task, &c, n_jobs * hkv < threads ? n_jobs * hkv : threads, 1);
    /* the shared jobs' partials are complete before any own job merges them */
    if (n_first > 0) {
        c.n_items = n_first;
        pool_run(item_task, &c, n_first < threads ? (int)n_first : threads, 1);
    }
    if (n_items > n_first) {
        c.items = items + n_first;
        c.n_items = n_items - n_first;
        c.next = 0;
        pool_run(item_task, &c, c.n_items < threads ? (int)c.n_items : threads, 1);
    }
    return 0;
}

int gemm_attention_rows(void) { return JOB_ROWS; }
int gemm_attention_key_chunk(void) { return KEY_CHUNK; }
