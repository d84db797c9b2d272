/* The entry points of the kernels that decode_step_cpu.c chains, declared once so that the
 * compiler checks each definition against its callers in C (Python's ctypes signatures are in
 * kernels/cpu_lib.py). Each file that defines one includes this header. */
#ifndef PAGODA_ENTRY_POINTS_H
#define PAGODA_ENTRY_POINTS_H

#include <stdint.h>

int gemv_cpu(const void *x, int64_t xs, const void *w, int64_t ws, const void *bias,
             void *y, int64_t ys, int m, int k, int n, int threads, int kind);

int gemm_cpu(const void *x, int64_t xs, const void *wp, const void *bias, void *y, int64_t ys,
             int m, int k, int n, int threads, int kind);

int add_rms_norm_f32(const void *x, int64_t x_st, const void *res, int64_t r_st,
                     const void *w, float eps, void *out, int64_t o_st, void *h, int64_t h_st,
                     int T, int D, int kind, int threads);

int rotary_neox_f32(const int64_t *pos, void *q, int64_t q_st, int64_t q_sh, int hq,
                    void *k, int64_t k_st, int64_t k_sh, int hk,
                    const float *cos_t, const float *sin_t, int64_t cs_st, int64_t max_pos,
                    int T, int D, int kind, int threads);

int write_kv_f32(const void *key, int64_t k_st, int64_t k_sh, const void *value, int64_t v_st,
                 int64_t v_sh, void *kc, int64_t kc_sb, int64_t kc_so, int64_t kc_sh, void *vc,
                 int64_t vc_sb, int64_t vc_so, int64_t vc_sh, const int64_t *slots, int64_t n_slots,
                 int T, int H, int D, int bs, int kind, int threads);

int silu_mul_f32(const void *gu, int64_t gu_st, void *out, int64_t o_st, int T, int I, int kind, int threads);

int paged_attention_cpu(const void *q, int64_t q_st, int64_t q_sh,
                        void *out, int64_t o_st, int64_t o_sh,
                        const void *k, int64_t k_sb, int64_t k_st, int64_t k_sh,
                        const void *v, int64_t v_sb, int64_t v_st, int64_t v_sh,
                        const int32_t *bt, int64_t bt_s,
                        const int32_t *seq_lens, const int32_t *qsl,
                        const float *sinks, const int32_t *prefix, const float *part_o,
                        const float *part_ml, int hq, int hkv, int d, int bs, int window,
                        float scale, float softcap, int heads_per_item,
                        const int64_t *items, int64_t n_items, int kind, int threads, int spin);

#endif
