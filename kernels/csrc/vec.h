/* Vector helpers shared by the CPU kernels of this directory: 8 fp32 lanes with GCC vector
 * extensions (AVX2 with -march=native, SSE pairs otherwise). */
#ifndef PAGODA_VEC_H
#define PAGODA_VEC_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

static inline v8 load8(const float *p) { return *(const v8u *)p; }

static inline float hsum8(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

static inline v8 select8(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* exp on 8 lanes: Cephes-style range reduction and polynomial (about 1 ulp); 0 below -87.3,
 * NaN stays NaN. */
static inline v8 exp8(v8 x) {
    v8i tiny = x < splat(-87.33654475f);
    x = select8(x > splat(88.3762626647949f), splat(88.3762626647949f), x);
    /* round to nearest: adding 1.5 * 2^23 leaves the integer part in the mantissa */
    v8 n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);
    v8 r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    v8 y = r * splat(1.9875691500e-4f) + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * (r * r) + r + splat(1.0f);
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    y = y * (v8)e;
    return (v8)((v8i)y & ~tiny);
}

#endif
