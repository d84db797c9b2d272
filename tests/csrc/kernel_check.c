/* Runs the CPU kernels of kernels/csrc on fixed inputs and writes every output to a file, so that
 * builds for different instruction sets can be held against each other without Python: the
 * native build (-march=native), the portable x86-64 one, and an aarch64 one run under qemu-user
 * (tests/test_cpu_isa.py). Inputs come from a fixed LCG; each record of the output file is
 * [u32 name length][name][u64 byte count][bytes].
 *
 *     cc -O3 -march=native -pthread -Ikernels/csrc tests/csrc/kernel_check.c kernels/csrc/ *.c -lm
 *     ./a.out out.bin */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"

int gemv_cpu(const void *x, int64_t xs, const void *w, int64_t ws, const void *bias, void *y, int64_t ys,
             int m, int k, int n, int threads, int kind);
int64_t gemm_packed_size(int n, int k);
void gemm_pack(const void *w, int64_t ws, int n, int k, void *wp, int kind);
int gemm_cpu(const void *x, int64_t xs, const void *wp, const void *bias, void *y, int64_t ys, int m, int k,
             int n, int threads, int kind);
int add_rms_norm_f32(const void *x, int64_t x_st, const void *res, int64_t r_st, const void *w, float eps,
                     void *out, int64_t o_st, void *h, int64_t h_st, int T, int D, int kind, int threads);
int rotary_neox_f32(const int64_t *pos, void *q, int64_t q_st, int64_t q_sh, int hq, void *k, int64_t k_st,
                    int64_t k_sh, int hk, const float *cos_t, const float *sin_t, int64_t cs_st,
                    int64_t max_pos, int T, int D, int kind, int threads);
int silu_mul_f32(const void *gu, int64_t gu_st, void *out, int64_t o_st, int T, int I, int kind, int threads);
int paged_attention_cpu(const void *q, int64_t q_st, int64_t q_sh, void *out, int64_t o_st, int64_t o_sh,
                        const void *k, int64_t k_sb, int64_t k_st, int64_t k_sh, const void *v, int64_t v_sb,
                        int64_t v_st, int64_t v_sh, const int32_t *bt, int64_t bt_s, const int32_t *seq_lens,
                        const int32_t *qsl, const float *sinks, const int32_t *prefix, const float *part_o,
                        const float *part_ml, int hq, int hkv, int d, int bs, int window, float scale,
                        float softcap, int heads_per_item, const int64_t *items, int64_t n_items, int kind,
                        int threads, int spin);
int convert_to_f32(const void *src, float *dst, int64_t n, int kind, int portable);
int convert_from_f32(const float *src, void *dst, int64_t n, int kind, int portable);

static FILE *out;
static uint64_t state = 0x9E3779B97F4A7C15ull;
static const char *KIND_NAME[] = {"f32", "bf16", "f16"};

static float uniform(void) {     /* [-1, 1) */
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)(state >> 40) / (float)(1 << 23) - 1.0f;
}

/* n values of `kind` drawn uniform in [-scale, scale) (16-bit kinds rounded portably). */
static void *values(int64_t n, int kind, float scale) {
    void *p = malloc((size_t)n * kind_size(kind));
    for (int64_t i = 0; i < n; i++) put_f32(p, i, uniform() * scale, kind);
    return p;
}

static void record(const char *name, const void *data, uint64_t bytes) {
    uint32_t len = (uint32_t)strlen(name);
    fwrite(&len, 4, 1, out);
    fwrite(name, 1, len, out);
    fwrite(&bytes, 8, 1, out);
    fwrite(data, 1, bytes, out);
}

static void check(int rc, const char *what) {
    if (rc) {
        fprintf(stderr, "%s: kernel returned %d\n", what, rc);
        exit(1);
    }
}

static void linears(int kind) {
    const int K = 600, N = 40;      /* K past gemm's KC (512) and gemv's 32-wide blocks; N past a panel */
    const int es = kind_size(kind);
    void *w = values((int64_t)N * K, kind, 0.1f), *bias = values(N, kind, 0.5f);
    void *wp = malloc((size_t)gemm_packed_size(N, K) * es);
    gemm_pack(w, K, N, K, wp, kind);
    const int rows[] = {1, 3, 8, 13, 20};
    for (int i = 0; i < 5; i++) {
        const int m = rows[i];
        void *x = values((int64_t)m * K, kind, 1.0f), *y = malloc((size_t)m * N * es);
        char name[64];
        if (m <= 8) {
            check(gemv_cpu(x, K, w, K, bias, y, N, m, K, N, 2, kind), "gemv_cpu");
            snprintf(name, sizeof name, "gemv %s m=%d", KIND_NAME[kind], m);
            record(name, y, (uint64_t)m * N * es);
        }
        check(gemm_cpu(x, K, wp, bias, y, N, m, K, N, 2, kind), "gemm_cpu");
        snprintf(name, sizeof name, "gemm %s m=%d", KIND_NAME[kind], m);
        record(name, y, (uint64_t)m * N * es);
        free(x);
        free(y);
    }
    free(w);
    free(bias);
    free(wp);
}

static void small_ops(int kind) {
    const int T = 5, D = 72, I = 100, es = kind_size(kind);
    char name[64];
    void *x = values((int64_t)T * D, kind, 2.0f), *res = values((int64_t)T * D, kind, 2.0f);
    void *w = values(D, kind, 1.0f), *o = malloc((size_t)T * D * es), *h = malloc((size_t)T * D * es);
    check(add_rms_norm_f32(x, D, res, D, w, 1e-6f, o, D, h, D, T, D, kind, 2), "add_rms_norm_f32");
    snprintf(name, sizeof name, "add_rms_norm %s", KIND_NAME[kind]);
    record(name, o, (uint64_t)T * D * es);
    snprintf(name, sizeof name, "add_rms_norm residual %s", KIND_NAME[kind]);
    record(name, h, (uint64_t)T * D * es);
    void *gu = values((int64_t)T * 2 * I, kind, 4.0f), *act = malloc((size_t)T * I * es);
    check(silu_mul_f32(gu, 2 * I, act, I, T, I, kind, 2), "silu_mul_f32");
    snprintf(name, sizeof name, "silu_mul %s", KIND_NAME[kind]);
    record(name, act, (uint64_t)T * I * es);

    const int hq = 4, hk = 2, RD = 64, max_pos = 16;
    float cos_t[16 * 64], sin_t[16 * 64];
    for (int p = 0; p < max_pos; p++)
        for (int i = 0; i < RD / 2; i++) {
            float c = uniform(), s = uniform();
            cos_t[p * RD + i] = cos_t[p * RD + i + RD / 2] = c;
            sin_t[p * RD + i] = sin_t[p * RD + i + RD / 2] = s;
        }
    const int64_t pos[] = {0, 3, 7, 15};
    void *q = values(4LL * hq * RD, kind, 1.0f), *k = values(4LL * hk * RD, kind, 1.0f);
    check(rotary_neox_f32(pos, q, hq * RD, RD, hq, k, hk * RD, RD, hk, cos_t, sin_t, RD, max_pos, 4, RD, kind, 2),
          "rotary_neox_f32");
    snprintf(name, sizeof name, "rotary q %s", KIND_NAME[kind]);
    record(name, q, 4ULL * hq * RD * es);
    snprintf(name, sizeof name, "rotary k %s", KIND_NAME[kind]);
    record(name, k, 4ULL * hk * RD * es);
    free(x); free(res); free(w); free(o); free(h); free(gu); free(act); free(q); free(k);
}

/* One sequence of L keys in 16-token blocks laid out out of order, q_len query tokens at its end
 * (a prefill tile, or one decode token), 4 query heads over 2 KV heads, head size 64. */
static void attention(int kind, int q_len, int window, float softcap) {
    const int hq = 4, hkv = 2, D = 64, bs = 16, L = 40, blocks = 4, es = kind_size(kind);
    void *q = values((int64_t)q_len * hq * D, kind, 1.0f), *o = malloc((size_t)q_len * hq * D * es);
    void *k = values((int64_t)blocks * bs * hkv * D, kind, 1.0f), *v = values((int64_t)blocks * bs * hkv * D, kind, 1.0f);
    const int32_t bt[] = {2, 0, 3}, seq_lens[] = {L}, qsl[] = {0, q_len};
    const int64_t items[] = {0, 1};     /* (seq 0, tile 0, KV head h) */
    check(paged_attention_cpu(q, hq * D, D, o, hq * D, D, k, bs * hkv * D, hkv * D, D, v, bs * hkv * D, hkv * D, D,
                              bt, 3, seq_lens, qsl, NULL, NULL, NULL, NULL, hq, hkv, D, bs, window, 0.125f,
                              softcap, 1, items, 2, kind, 2, 1),
          "paged_attention_cpu");
    char name[96];
    snprintf(name, sizeof name, "paged_attention %s q_len=%d window=%d softcap=%g", KIND_NAME[kind], q_len,
             window, (double)softcap);
    record(name, o, (uint64_t)q_len * hq * D * es);
    free(q); free(o); free(k); free(v);
}

static void conversions(int kind) {
    const int n = 4099;
    float *src = malloc(sizeof(float) * n), *back = malloc(sizeof(float) * n);
    for (int i = 0; i < n; i++) src[i] = uniform() * (float)(1 << (i % 40)) * 1e-6f;
    src[0] = 1.0f / 0.0f, src[1] = -src[0], src[2] = bits_f32(0x7FC00001u), src[5] = bits_f32(0xFFA00000u), src[3] = -0.0f, src[4] = 65520.0f;
    void *h = malloc((size_t)n * 2);
    for (int portable = 0; portable < 2; portable++) {
        char name[64];
        check(convert_from_f32(src, h, n, kind, portable), "convert_from_f32");
        snprintf(name, sizeof name, "from_f32 %s portable=%d", KIND_NAME[kind], portable);
        record(name, h, (uint64_t)n * 2);
        check(convert_to_f32(h, back, n, kind, portable), "convert_to_f32");
        snprintf(name, sizeof name, "to_f32 %s portable=%d", KIND_NAME[kind], portable);
        record(name, back, (uint64_t)n * 4);
    }
    free(src); free(back); free(h);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUT\n", argv[0]);
        return 2;
    }
    if (!(out = fopen(argv[1], "wb"))) {
        perror(argv[1]);
        return 1;
    }
    for (int kind = KIND_F32; kind <= KIND_F16; kind++) {
        linears(kind);
        small_ops(kind);
        attention(kind, 3, 0, 0.0f);
        attention(kind, 1, 0, 0.0f);
        attention(kind, 1, 24, 30.0f);
        if (kind != KIND_F32) conversions(kind);
    }
    return fclose(out) != 0;
}
