/* What the two CPU attention kernels share (paged_attention_cpu.c, one sequence at a time;
 * gemm_attention_cpu.c, matrix products): the step's query/output rows and the paged pool as
 * they see them, and the merge of two partial softmaxes over disjoint key ranges (cascade). */
#ifndef PAGODA_ATTENTION_CPU_H
#define PAGODA_ATTENTION_CPU_H

#include <math.h>
#include <stdint.h>

/* q and out [T, Hq, D] by token and head stride; the pool [blocks, block size, Hkv, D] by
 * block, token and head stride (any layout with a contiguous head dimension); block tables
 * [S, width] by row stride. */
typedef struct {
    const float *q; int64_t q_st, q_sh;
    float *out; int64_t o_st, o_sh;
    const float *k; int64_t k_sb, k_st, k_sh;
    const float *v; int64_t v_sb, v_st, v_sh;
    const int32_t *bt; int64_t bt_s;
} Paged;

/* dst = softmax-weighted values over both ranges, from each range's unnormalised output o,
 * row max m and sum l: (o1 e^(m1 - M) + o2 e^(m2 - M)) / (l1 e^(m1 - M) + l2 e^(m2 - M)). */
static inline void merge_partials(float *dst, const float *o1, float m1, float l1, const float *o2, float m2,
                                  float l2, int D) {
    const float M = m1 > m2 ? m1 : m2;
    const float a1 = expf(m1 - M), a2 = expf(m2 - M);
    const float norm = 1.0f / (l1 * a1 + l2 * a2);
    for (int e = 0; e < D; e++) dst[e] = (o1[e] * a1 + o2[e] * a2) * norm;
}

#endif
