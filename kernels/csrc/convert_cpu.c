/* The conversions of convert.h as calls, for the tests (tests/test_cpu_convert.py): the vector
 * forms the kernels use against the portable forms, over every fp16 and bf16 value and many
 * fp32 ones. portable != 0: the scalar forms; else 8 lanes at a time, the tail scalar. */
#include <stdint.h>

#include "convert.h"

int convert_to_f32(const void *src, float *dst, int64_t n, int kind, int portable) {
    if (kind < KIND_F32 || kind > KIND_F16) return 1;
    int64_t i = 0;
    if (!portable)
        for (; i + 8 <= n; i += 8) *(v8u *)(dst + i) = load8_kind(src, i, kind);
    for (; i < n; i++) dst[i] = get_f32(src, i, kind);
    return 0;
}

int convert_from_f32(const float *src, void *dst, int64_t n, int kind, int portable) {
    if (kind < KIND_F32 || kind > KIND_F16) return 1;
    int64_t i = 0;
    if (!portable)
        for (; i + 8 <= n; i += 8) store8_kind(dst, i, load8(src + i), kind);
    for (; i < n; i++) put_f32(dst, i, src[i], kind);
    return 0;
}
