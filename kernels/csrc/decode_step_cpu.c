/* A whole decode step of a plain Llama-family model in one call: every layer's RMSNorm (+
 * residual), q/k/v linear, rotary, KV-cache write, paged attention, o linear, RMSNorm, gate/up
 * linear, SiLU * up and down linear, then the final norm, through the same entry points and with
 * the same arguments as the Python modules make them (gpu_worker/models/llama.py), so the result
 * is the same to the bit. Each linear is the GEMV (gemv_cpu.c), the GEMM (gemm_cpu.c) where its
 * layer entry has a packed weight, or the caller's (oneDNN, F.linear: whatever the tuner chose that
 * C cannot call): then the step returns naming that linear, its input in the scratch space, and
 * the caller writes its output there and calls again to go on from the next stage. What it saves
 * is the Python between the kernels: at one sequence of the tiny model that was about 2 ms of a
 * 5 ms step (~47 module calls, ~40 ctypes calls, a tensor per op). gpu_worker/models/llama.py's
 * CpuDecodeStep decides when a step may come here (a few rows, no LoRA, one rank, a cache of the
 * model's dtype, no cascade attention) and kernels/cpu_decode.py builds the tables below.
 *
 * DecodeModel and DecodeLayer are mirrored by ctypes structures in kernels/cpu_decode.py, which
 * checks their sizes against decode_step_sizes() when the library loads. */
#include <stddef.h>
#include <stdint.h>

#include "convert.h"
#include "entry_points.h"

typedef struct {
    const void *ln1, *ln2;             /* input and post-attention RMSNorm weights [H] */
    const void *w_qkv, *b_qkv;         /* [(hq + 2 hkv) D, H], bias or NULL */
    const void *w_o, *b_o;             /* [H, hq D] */
    const void *w_gu, *b_gu;           /* [2 I, H] */
    const void *w_down, *b_down;       /* [H, I] */
    const void *p_qkv, *p_o, *p_gu, *p_down;  /* the weights packed by gemm_pack, or NULL: the GEMV */
    int64_t external;                  /* bit s set: linear s (0 qkv, 1 o, 2 gate/up, 3 down) is the caller's */
    void *k_cache, *v_cache;           /* [blocks, bs, hkv, D], the strides below */
    int64_t window;                    /* sliding window, 0: none */
} DecodeLayer;

typedef struct {
    const DecodeLayer *layers;
    int64_t n_layers;
    const void *final_norm;            /* [H] */
    int64_t hidden, hq, hkv, head_dim, inter;
    int64_t k_sb, k_st, k_sh, v_sb, v_st, v_sh, block_size, n_slots;
    const float *cos_t, *sin_t;        /* rotary tables [n_pos, D], row stride cs_st */
    int64_t cs_st, n_pos;
    float eps, scale;
    int64_t kind;                      /* of weights, activations and cache (convert.h) */
} DecodeModel;

typedef struct {
    int64_t m;                         /* token rows, 1..GEMV_MAX_M */
    const void *h;                     /* [m, H]: the tokens' embeddings */
    void *out;                         /* [m, H]: the final norm's output */
    const int64_t *pos, *slots;        /* [m] */
    const int32_t *bt;                 /* block tables [S, bt_s] */
    int64_t bt_s;
    const int32_t *seq_lens, *qsl;     /* [S], [S + 1] */
    const int64_t *items;              /* paged_attention_cpu's work items */
    int64_t n_items, heads_per_item;
    void *scratch;                     /* decode_step_scratch(model, m) elements of `kind` */
    int64_t threads;
    /* Out: the linear p = 4 l + s (layer l's linear s) the caller must compute, or -1: done. In:
     * the stage to start from, 0 for a new step, p + 1 once the caller has computed linear p. */
    int64_t next;
    const void *in, *res;              /* where the stages left the layer input and the residual */
} DecodeStep;

/* y [m, n] = x [m, k] (row stride xs) times w [n, k]^T (+ b): the GEMM on `packed` where given */
static int linear(const void *x, int64_t xs, const void *w, const void *packed, const void *b, void *y, int m,
                  int k, int n, int threads, int kind) {
    return packed ? gemm_cpu(x, xs, packed, b, y, n, m, k, n, threads, kind)
                  : gemv_cpu(x, xs, w, k, b, y, n, m, k, n, threads, kind);
}

/* The scratch space of a step of m rows, as element offsets: two residual rows, the normed rows,
 * q/k/v, the attention output, gate/up, the activation and a linear's output (each [m, its width],
 * starting on 64 bytes as torch's own tensors do), then the total. */
enum { RES_A, RES_B, X, QKV, ATT, GU, ACT, Y, N_BUFFERS };

void decode_step_offsets(const DecodeModel *md, int64_t m, int64_t *off) {
    const int64_t H = md->hidden, D = md->head_dim, align = 64 / kind_size((int)md->kind);
    const int64_t width[N_BUFFERS] = {H, H, H, (md->hq + 2 * md->hkv) * D, md->hq * D, 2 * md->inter, md->inter, H};
    off[0] = 0;
    for (int b = 0; b < N_BUFFERS; b++) off[b + 1] = off[b] + (m * width[b] + align - 1) / align * align;
}

int64_t decode_step_scratch(const DecodeModel *md, int64_t m) {
    int64_t off[N_BUFFERS + 1];
    decode_step_offsets(md, m, off);
    return off[N_BUFFERS];
}

int64_t decode_step_sizes(void) { return (int64_t)sizeof(DecodeModel) << 32 | sizeof(DecodeLayer) << 16 | sizeof(DecodeStep); }

/* Returns 0 (st->next says whether a linear of the caller's comes next), or the first kernel's
 * refusal: 1 shapes, 2 out of memory, 3 a position outside the rotary table, 4 a slot past the
 * cache (nothing of that layer written then). */
int decode_step_cpu(const DecodeModel *md, DecodeStep *st) {
    const int m = (int)st->m, H = (int)md->hidden, hq = (int)md->hq, hkv = (int)md->hkv, D = (int)md->head_dim;
    const int I = (int)md->inter, kind = (int)md->kind, threads = (int)st->threads;
    const int nqkv = (hq + 2 * hkv) * D, es = kind_size(kind);
    int64_t off[N_BUFFERS + 1];
    decode_step_offsets(md, m, off);
    char *s = (char *)st->scratch;
    char *res_a = s + off[RES_A] * es, *res_b = s + off[RES_B] * es, *x = s + off[X] * es;
    char *qkv = s + off[QKV] * es, *att = s + off[ATT] * es, *gu = s + off[GU] * es;
    char *act = s + off[ACT] * es, *y = s + off[Y] * es;
    char *k = qkv + (int64_t)hq * D * es, *v = k + (int64_t)hkv * D * es;
    int64_t p = st->next;
    if (p <= 0) {
        p = 0;
        st->in = st->h;                /* the layer input: the embeddings, then each MLP's output */
        st->res = NULL;                /* the residual stream before it (none before layer 0) */
    }
    int rc;
    for (; p < 4 * md->n_layers; p++) {
        const DecodeLayer *L = &md->layers[p >> 2];
        const int stage = (int)(p & 3), mine = !((L->external >> stage) & 1);
        const void *res = st->res;
        char *res_new = res == res_a ? res_b : res_a;
        switch (stage) {
        case 0:     /* x, res = input_layernorm(in, res); qkv = x W_qkv^T (+ b) */
            if ((rc = add_rms_norm_f32(st->in, H, res, H, L->ln1, md->eps, x, H, res ? res_new : (void *)st->in, H,
                                       m, H, kind, threads))) return rc;
            st->res = res ? res_new : st->in;
            if (mine && (rc = linear(x, H, L->w_qkv, L->p_qkv, L->b_qkv, qkv, m, H, nqkv, threads, kind))) return rc;
            break;
        case 1:     /* rotary, the KV write, attention; y = att W_o^T */
            if ((rc = rotary_neox_f32(st->pos, qkv, nqkv, D, hq, k, nqkv, D, hkv, md->cos_t, md->sin_t, md->cs_st,
                                      md->n_pos, m, D, kind, threads))) return rc == 2 ? 3 : rc;
            if ((rc = write_kv_f32(k, nqkv, D, v, nqkv, D, L->k_cache, md->k_sb, md->k_st, md->k_sh, L->v_cache,
                                   md->v_sb, md->v_st, md->v_sh, st->slots, md->n_slots, m, hkv, D,
                                   (int)md->block_size, kind, threads))) return rc == 1 ? 4 : 1;
            if ((rc = paged_attention_cpu(qkv, nqkv, D, att, (int64_t)hq * D, D, L->k_cache, md->k_sb, md->k_st,
                                          md->k_sh, L->v_cache, md->v_sb, md->v_st, md->v_sh, st->bt, st->bt_s,
                                          st->seq_lens, st->qsl, NULL, NULL, NULL, NULL, hq, hkv, D,
                                          (int)md->block_size, (int)L->window, md->scale, 0.0f,
                                          (int)st->heads_per_item, st->items, st->n_items, kind, threads, 1)))
                return rc;
            if (mine && (rc = linear(att, (int64_t)hq * D, L->w_o, L->p_o, L->b_o, y, m, hq * D, H, threads, kind)))
                return rc;
            break;
        case 2:     /* x, res = post_attention_layernorm(y, res); gate/up = x W_gu^T */
            if ((rc = add_rms_norm_f32(y, H, res, H, L->ln2, md->eps, x, H, res_new, H, m, H, kind, threads)))
                return rc;
            st->res = res_new;
            if (mine && (rc = linear(x, H, L->w_gu, L->p_gu, L->b_gu, gu, m, H, 2 * I, threads, kind))) return rc;
            break;
        default:    /* act = SiLU(gate) * up; the next layer's input y = act W_down^T */
            if ((rc = silu_mul_f32(gu, 2 * I, act, I, m, I, kind, threads))) return rc;
            if (mine && (rc = linear(act, I, L->w_down, L->p_down, L->b_down, y, m, I, H, threads, kind))) return rc;
            st->in = y;
            break;
        }
        if (!mine) {
            st->next = p;
            return 0;
        }
    }
    /* the final norm; its residual sum goes to whichever residual row is free */
    const void *res = st->res;
    st->next = -1;
    return add_rms_norm_f32(st->in, H, res, H, md->final_norm, md->eps, st->out, H,
                            res ? (void *)(res == res_a ? res_b : res_a) : (void *)st->in, H, m, H, kind, threads);
}
