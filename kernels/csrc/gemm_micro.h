/* The register-blocked inner kernel of the CPU GEMMs (gemm_cpu.c's linears, the shared-prefix
 * attention of paged_attention_cpu.c): C[R x 16] (+)= A[R x kc] B[kc x 16], R <= MR.
 *
 * A comes packed, k-major in MR-row tiles (pack_a: a[k * MR + r]), so one step of k reads MR
 * consecutive floats; B is any array whose row k holds the 16 columns at b + k * ldb (a
 * packed weight panel: ldb = NR). The 6 x 16 tile keeps 12 accumulators, two B vectors and
 * one broadcast in the 16 AVX2 registers: each k is 12 FMAs on 2 + 6 loads, so the loop runs at
 * the FMA units' rate. Every C element is one fp32 FMA chain over k in order, starting from 0
 * (first) or from C (a later block of k continues the same chain), plus the bias once at the
 * end: a row's result depends neither on how many rows come with it nor on the blocking.
 *
 * Plain C with GCC vector extensions; no -ffast-math. */
#ifndef PAGODA_GEMM_MICRO_H
#define PAGODA_GEMM_MICRO_H

#include <stdint.h>

#include "vec.h"

#define MR 6
#define NR 16

/* dst[k * MR + r] = src[r * rs + k * ks] for r < R, zero for R <= r < MR. */
static inline void pack_a(const float *src, int64_t rs, int64_t ks, int R, int kc, float *dst) {
    for (int k = 0; k < kc; k++)
        for (int r = 0; r < MR; r++) dst[k * MR + r] = r < R ? src[r * rs + k * ks] : 0.0f;
}

static inline __attribute__((always_inline)) void micro_r(const int R, int kc, const float *a,
                                                          const float *b, int64_t ldb, float *c,
                                                          int64_t ldc, int first, const float *bias) {
    v8 c0[MR], c1[MR];
    for (int r = 0; r < R; r++) {
        c0[r] = first ? splat(0) : load8(c + r * ldc);
        c1[r] = first ? splat(0) : load8(c + r * ldc + 8);
    }
    for (int k = 0; k < kc; k++) {
        v8 b0 = load8(b + k * ldb), b1 = load8(b + k * ldb + 8);
        for (int r = 0; r < R; r++) {
            v8 av = splat(a[k * MR + r]);
            c0[r] += av * b0;
            c1[r] += av * b1;
        }
    }
    if (bias) {
        v8 bb0 = load8(bias), bb1 = load8(bias + 8);
        for (int r = 0; r < R; r++) {
            c0[r] += bb0;
            c1[r] += bb1;
        }
    }
    for (int r = 0; r < R; r++) {
        *(v8u *)(c + r * ldc) = c0[r];
        *(v8u *)(c + r * ldc + 8) = c1[r];
    }
}

/* micro_r with R a constant in each branch, so the accumulators stay in registers. */
static inline void micro(int R, int kc, const float *a, const float *b, int64_t ldb, float *c,
                         int64_t ldc, int first, const float *bias) {
    switch (R) {
    case 6: micro_r(6, kc, a, b, ldb, c, ldc, first, bias); break;
    case 5: micro_r(5, kc, a, b, ldb, c, ldc, first, bias); break;
    case 4: micro_r(4, kc, a, b, ldb, c, ldc, first, bias); break;
    case 3: micro_r(3, kc, a, b, ldb, c, ldc, first, bias); break;
    case 2: micro_r(2, kc, a, b, ldb, c, ldc, first, bias); break;
    default: micro_r(1, kc, a, b, ldb, c, ldc, first, bias); break;
    }
}

#endif
