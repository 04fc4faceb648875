/* Vector helpers shared by prefill-lab's CPU kernels (cpu_attention.c, cpu_rows.c), compiled together into one
 * library by lab.kernels.cpu_attention: GCC's generic 16-float vector (AVX-512 where the CPU has it, AVX2 halves or
 * scalar code elsewhere), loads, stores, broadcasts, horizontal reductions, exp2, and bfloat16 <-> float32 with
 * round to nearest even. */
#ifndef LAB_CPU_VECTOR_H
#define LAB_CPU_VECTOR_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 16 /* floats per vector */

#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

static inline v16 ld(const float *p) { return *(const v16u *)p; }
static inline void st(float *p, v16 x) { *(v16u *)p = x; }
/* x in every lane, written out lane by lane: GCC compiles it to a broadcast from memory that an FMA takes as its
 * operand, where `(v16){0} + x` cost a scalar add (x + 0 is not x for x = -0) and a register broadcast per row in
 * every inner loop, and ran slower (measured: evals/README.md, "Measurements behind the code's choices") */
static inline v16 bc(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16 vsel(v16i m, v16 a, v16 b) { return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }

/* 2^f for |f| <= 1/2: its Taylor series in f to degree 6 (relative error < 1.3e-7); both exp2v below use it. */
static inline v16 exp2_fraction(v16 f) {
    v16 p = bc(1.5403530393381606e-4f); /* ln(2)^k / k!, k = 6 .. 0 */
    p = p * f + 1.3333558146428441e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    return p;
}

#ifdef __AVX512F__
static inline v16 vmax(v16 a, v16 b) { return (v16)_mm512_max_ps((__m512)a, (__m512)b); }
static inline float hmax(v16 x) { return _mm512_reduce_max_ps((__m512)x); }
static inline float hsum(v16 x) { return _mm512_reduce_add_ps((__m512)x); }

/* 2^x for x <= 0: x = n + f (n the nearest integer), 2^f by exp2_fraction, scaled by 2^n in one instruction (0 far
 * below the float range). */
static inline v16 exp2v(v16 x) {
    __m512 n = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return (v16)_mm512_scalef_ps((__m512)exp2_fraction(x - (v16)n), n);
}
#else
static inline v16 vmax(v16 a, v16 b) { return vsel(a > b, a, b); }

static inline float hmax(v16 x) {
    x = vmax(x, __builtin_shuffle(x, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    x = vmax(x, __builtin_shuffle(x, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    x = vmax(x, __builtin_shuffle(x, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    x = vmax(x, __builtin_shuffle(x, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return x[0];
}

static inline float hsum(v16 x) {
    x += __builtin_shuffle(x, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

/* 2^x for x <= 0: x = n + f (n integer, |f| <= 1/2), 2^f by exp2_fraction, then n added to the exponent bits. Below
 * -126 the result is 0 (no subnormals). */
static inline v16 exp2v(v16 x) {
    v16i tiny = x < -126.0f;
    x = vsel(tiny, bc(-126.0f), x);
    const v16 magic = bc(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits */
    v16 t = x + magic;
    v16i n = (v16i)t - (v16i)magic;
    return (v16)(((v16i)exp2_fraction(x - (t - magic)) + (n << 23)) & ~tiny);
}
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

/* n floats (a multiple of W) from src to dst, inline: the rows are short and many (at 14 tokens a sequence, a
 * library call per row cost about as much as the block's arithmetic). */
static inline void copy_row(float *dst, const float *src, int n) {
    for (int d = 0; d < n; d += W) st(dst + d, ld(src + d));
}

/* n floats rounded to bfloat16 (nearest even; NaN stays NaN). */
static inline void store_bf16(uint16_t *dst, const float *src, int n) {
    int d = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    for (; d + 16 <= n; d += 16)
        _mm256_storeu_si256((void *)(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + d)));
#endif
    for (; d < n; d++) dst[d] = f32_to_bf16(src[d]);
}

/* n floats from src to dst + at, a float32 tensor's row or (bf16) a bfloat16 one's, rounded as store_bf16 rounds. */
static inline void store_row(void *dst, int64_t at, const float *src, int n, int bf16) {
    if (bf16)
        store_bf16((uint16_t *)dst + at, src, n);
    else
        copy_row((float *)dst + at, src, n);
}

#endif
