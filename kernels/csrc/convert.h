/* fp32, bf16 and fp16 as the CPU kernels read and write them: they take activations and KV
 * pools of any of the three and compute in fp32 (kernels/cpu_ops.py, cpu_attention.py).
 *
 * Each conversion has a portable scalar form, always compiled (convert_cpu.c exports it so the
 * tests hold every vector form against it bit for bit), and a vector form of 8 lanes:
 * - bf16 -> fp32 is the 16-bit shift (exact, any ISA); fp32 -> bf16 rounds to nearest even and
 *   turns NaN into 0x7FC0, as torch's c10::BFloat16.
 * - fp16 <-> fp32 with F16C where the compiler targets it (vcvtph2ps / vcvtps2ph, round to
 *   nearest even); elsewhere the portable form lane by lane, the bit-exact algorithm of torch's
 *   c10::Half (the FP16 library's). The two agree on every value but NaN payloads: F16C keeps
 *   the payload's top bits, the portable form gives 0x7E00 (both are NaN).
 * No -ffast-math, and no contraction into FMA here: the rounding is the point. */
#ifndef PAGODA_CONVERT_H
#define PAGODA_CONVERT_H

#include <stdint.h>
#include <string.h>

#include "vec.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2 };

typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8ui __attribute__((vector_size(32)));

static inline int kind_size(int kind) { return kind == KIND_F32 ? 4 : 2; }

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ---- portable scalar forms ---- */

static inline float bf16_to_f32_portable(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16_portable(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static inline float f16_to_f32_portable(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
}

static inline uint16_t f32_to_f16_portable(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
#pragma GCC pop_options

/* ---- one element, scalar ---- */

static inline float get_f32(const void *p, int64_t i, int kind) {
    if (kind == KIND_F32) return ((const float *)p)[i];
    if (kind == KIND_BF16) return bf16_to_f32_portable(((const uint16_t *)p)[i]);
    return f16_to_f32_portable(((const uint16_t *)p)[i]);
}

static inline void put_f32(void *p, int64_t i, float x, int kind) {
    if (kind == KIND_F32) ((float *)p)[i] = x;
    else if (kind == KIND_BF16) ((uint16_t *)p)[i] = f32_to_bf16_portable(x);
    else ((uint16_t *)p)[i] = f32_to_f16_portable(x);
}

/* x rounded to `kind` and back: what storing it and reading it again gives */
static inline float round_to(float x, int kind) {
    if (kind == KIND_F32) return x;
    if (kind == KIND_BF16) return bf16_to_f32_portable(f32_to_bf16_portable(x));
    return f16_to_f32_portable(f32_to_f16_portable(x));
}

/* ---- 8 lanes ---- */

static inline v8 load8_bf16(const uint16_t *p) {
#if defined(__AVX2__)   /* GCC splits the generic form into 128-bit halves: 6 instructions, not 2 */
    __m256i y = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    v8 r;
    memcpy(&r, &y, sizeof r);
    return r;
#else
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8)(__builtin_convertvector(h, v8ui) << 16);
#endif
}

/* 16 bf16 from p as two fp32 vectors, the even elements and the odd ones: one 32-byte load and
 * two integer ops where load8_bf16 twice is two loads and four (each 32-bit word of a
 * little-endian machine holds an even element in its low half, the next odd one above). */
static inline void load16_bf16_split(const uint16_t *p, v8 *even, v8 *odd) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    v8ui u;
    memcpy(&u, p, sizeof u);
    *even = (v8)(u << 16);
    *odd = (v8)(u & 0xFFFF0000u);
#else
    for (int l = 0; l < 8; l++) {
        (*even)[l] = bf16_to_f32_portable(p[2 * l]);
        (*odd)[l] = bf16_to_f32_portable(p[2 * l + 1]);
    }
#endif
}

static inline void store8_bf16(uint16_t *p, v8 x) {
    const v8ui u = (v8ui)x;
    v8ui r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const v8ui nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    r = (r & ~nan) | (0x7FC0u & nan);
    v8h h = __builtin_convertvector(r, v8h);
    memcpy(p, &h, sizeof h);
}

static inline v8 load8_f16(const uint16_t *p) {
#if defined(__F16C__)
    __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    v8 r;
    memcpy(&r, &y, sizeof r);
    return r;
#else
    v8 r;
    for (int l = 0; l < 8; l++) r[l] = f16_to_f32_portable(p[l]);
    return r;
#endif
}

static inline void store8_f16(uint16_t *p, v8 x) {
#if defined(__F16C__)
    __m256 y;
    memcpy(&y, &x, sizeof y);
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
#else
    for (int l = 0; l < 8; l++) p[l] = f32_to_f16_portable(x[l]);
#endif
}

/* 8 elements from element i of p (kind a constant where it is inlined: the branches fold) */
static inline __attribute__((always_inline)) v8 load8_kind(const void *p, int64_t i, int kind) {
    if (kind == KIND_F32) return load8((const float *)p + i);
    if (kind == KIND_BF16) return load8_bf16((const uint16_t *)p + i);
    return load8_f16((const uint16_t *)p + i);
}

static inline __attribute__((always_inline)) void store8_kind(void *p, int64_t i, v8 x, int kind) {
    if (kind == KIND_F32) *(v8u *)((float *)p + i) = x;
    else if (kind == KIND_BF16) store8_bf16((uint16_t *)p + i, x);
    else store8_f16((uint16_t *)p + i, x);
}

/* n elements to/from fp32 (vector lanes, then the tail scalar: both round alike) */
static inline void row_to_f32(float *dst, const void *src, int n, int kind) {
    int i = 0;
    for (; i + 8 <= n; i += 8) *(v8u *)(dst + i) = load8_kind(src, i, kind);
    for (; i < n; i++) dst[i] = get_f32(src, i, kind);
}

static inline void row_from_f32(void *dst, const float *src, int n, int kind) {
    int i = 0;
    for (; i + 8 <= n; i += 8) store8_kind(dst, i, load8(src + i), kind);
    for (; i < n; i++) put_f32(dst, i, src[i], kind);
}

#endif
