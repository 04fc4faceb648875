/* Varlen attention on one CPU thread: prefill-lab's own kernel, compiled on the running machine by
 * lab.kernels.cpu_attention (cc -O3 -march=native) and chosen, or not, by the attention_kernel probe.
 *
 * Packed tokens, one sequence after another (cu_seqlens); every query attends to the keys of its own sequence
 * (all of them, or those up to itself when causal). Grouped-query heads share a key/value head. Inputs float32 or
 * bfloat16, output in the inputs' dtype (bfloat16 rounds to nearest even); scores and sums in float32.
 *
 * Per sequence, K and V are staged once for all heads, token by token (a token's heads lie together in the packed
 * tensors, so the reads stream): K transposed (head, d, token), V (head, token, d), keys padded to a multiple of
 * the vector width with zeros. Queries are read in place. Then per head, per block of R query rows: the block's
 * scores (R rows x keys, keys across vector lanes, 2R accumulators in registers), an exact softmax per row (max,
 * exp2, sum), and the weighted sum of V, normalised at the end.
 *
 * bfloat16 on a CPU with AVX512-BF16 (known at compile time: the build is for this machine) uses its dot products
 * (vdpbf16ps: two exact products per float32 lane, float32 sums), K and V staged as bfloat16 pairs; elsewhere
 * bfloat16 widens to float32 while staging. The vector type is GCC's generic one (16 floats): AVX-512 where the
 * CPU has it, AVX2 halves or scalar code elsewhere.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 16 /* floats per vector */
#ifndef R /* query rows per block: 2R vectors of accumulators, which must stay in registers */
#ifdef __AVX512F__
#define R 8 /* 32 vector registers; one AMD EPYC (family 26), one thread: 1.17-1.36x faster than 4 at 64-512
                tokens in float32, 0.94-1.22x in bfloat16 */
#else
#define R 4 /* AVX2's 16 registers hold a 16-float vector as two halves */
#endif
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

static inline v16 ld(const float *p) { return *(const v16u *)p; }
static inline void st(float *p, v16 x) { *(v16u *)p = x; }
static inline v16 bc(float x) { return (v16){0} + x; }
static inline v16 vsel(v16i m, v16 a, v16 b) { return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }
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

/* 2^x for x <= 0: x = n + f (n integer, |f| <= 1/2), 2^f = e^(f ln 2) by its Taylor series to degree 7 (relative
 * error < 2e-7), then n added to the exponent bits. Below -126 the result is 0 (no subnormals). */
static inline v16 exp2v(v16 x) {
    v16i tiny = x < -126.0f;
    x = vsel(tiny, bc(-126.0f), x);
    const v16 magic = bc(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits */
    v16 t = x + magic;
    v16i n = (v16i)t - (v16i)magic;
    v16 y = (x - (t - magic)) * 0.6931471805599453f;
    v16 p = bc(1.0f / 5040);
    p = p * y + 1.0f / 720;
    p = p * y + 1.0f / 120;
    p = p * y + 1.0f / 24;
    p = p * y + 1.0f / 6;
    p = p * y + 0.5f;
    p = p * y + 1.0f;
    p = p * y + 1.0f;
    return (v16)(((v16i)p + (n << 23)) & ~tiny);
}

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

static inline float load(int bf16, const void *p, int64_t at) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[at]) : ((const float *)p)[at];
}

/* out (R x cols, row stride os) = diag(scale) A B: A (R x n, row stride as), B (n x cols, row stride bs), cols a
 * multiple of W. The block's two products: the scores (A = Q, B = K^T) and the weighted sum (A = weights, B = V).
 * Two vectors of columns at a time (2R accumulators in registers), one for an odd last vector. */
static inline __attribute__((always_inline)) void rows_times(const float *A, int64_t as, const float *B, int64_t bs,
                                                             int n, int cols, const float *scale, float *out,
                                                             int64_t os) {
    for (int x = 0; x < cols; x += 2 * W) {
        if (x + W < cols) {
            v16 a[R][2] = {{{0}}};
            for (int k = 0; k < n; k++) {
                v16 b0 = ld(B + k * bs + x), b1 = ld(B + k * bs + x + W);
                for (int r = 0; r < R; r++) {
                    v16 ab = bc(A[r * as + k]);
                    a[r][0] += ab * b0;
                    a[r][1] += ab * b1;
                }
            }
            for (int r = 0; r < R; r++) {
                st(out + r * os + x, a[r][0] * scale[r]);
                st(out + r * os + x + W, a[r][1] * scale[r]);
            }
        } else {
            v16 a[R] = {{0}};
            for (int k = 0; k < n; k++) {
                v16 b0 = ld(B + k * bs + x);
                for (int r = 0; r < R; r++) a[r] += bc(A[r * as + k]) * b0;
            }
            for (int r = 0; r < R; r++) st(out + r * os + x, a[r] * scale[r]);
        }
    }
}

/* The second half of a block: S (R x Lp) holds the block's scores (times log2 e) over its kp keys; turn each row
 * into softmax weights over its visible keys (all kmax, or up to the row when causal) and write the weighted sum of
 * V's rows (row stride vr) to O (R x D). */
static inline __attribute__((always_inline)) void softmax_and_weighted_sum(const float *V, int64_t vr, float *S,
                                                                           float *O, int64_t Lp, int D, int i0,
                                                                           int causal, int kmax, int kp) {
    float inv[R];
    for (int r = 0; r < R; r++) {
        int n = causal && i0 + r + 1 < kmax ? i0 + r + 1 : kmax;
        float *s = S + r * Lp;
        for (int j = n; j < kp; j++) s[j] = -1.0e30f; /* padding and (causal) future keys */
        v16 m = ld(s);
        for (int j = W; j < kp; j += W) m = vmax(m, ld(s + j));
        v16 mx = bc(hmax(m)), sum = {0};
        for (int j = 0; j < kp; j += W) {
            v16 e = exp2v(ld(s + j) - mx);
            st(s + j, e);
            sum += e;
        }
        inv[r] = 1.0f / hsum(sum);
    }
    rows_times(S, Lp, V, vr, kmax, D, inv, O, D);
}

/* One block of R query rows of one head: Kt (D x Lp), V (keys x D, row stride vr), Q (R x D, row stride qr), S
 * (R x Lp) scratch, O (R x D) out; c = softmax scale * log2(e). Rows past the sequence's end are computed on zero
 * queries and not stored by the caller. */
static inline __attribute__((always_inline)) void block(const float *Kt, const float *V, int64_t vr, const float *Q,
                                                        int64_t qr, float *S, float *O, int L, int64_t Lp, int D,
                                                        int i0, int causal, float c) {
    int kmax = causal ? (i0 + R < L ? i0 + R : L) : L; /* keys any row of the block sees */
    int kp = (kmax + W - 1) / W * W;
    float cs[R];
    for (int r = 0; r < R; r++) cs[r] = c;
    rows_times(Q, qr, Kt, Lp, D, kp, cs, S, Lp);
    softmax_and_weighted_sum(V, vr, S, O, Lp, D, i0, causal, kmax, kp);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define NATIVE_BF16 1
/* The same block on bfloat16 inputs, its scores by the CPU's bfloat16 dot products (vdpbf16ps: two exact products
 * per float32 lane, float32 sums): Q (R x D, read in place) and K as pairs along d (D/2 x Lp x 2). The softmax and
 * the weighted sum stay in float32 (V widened while staging): with the weights rounded to bfloat16 for a second
 * vdpbf16ps product, the median cosine of SmolLM2's bidirectional bfloat16 embeddings of 48 mixed texts to the
 * float32 engine's was 0.999921, against 0.999933 with float32 weights (torch's fused kernel 0.999942). */
static inline int32_t pair(const uint16_t *p) {
    int32_t x;
    memcpy(&x, p, 4);
    return x;
}

static inline __attribute__((always_inline)) void block_bf16(const uint16_t *Kp, const float *V, const uint16_t *Q,
                                                             int64_t qr, float *S, float *O, int L, int64_t Lp, int D,
                                                             int i0, int causal, float c) {
    int kmax = causal ? (i0 + R < L ? i0 + R : L) : L;
    int kp = (kmax + W - 1) / W * W;
    for (int j = 0; j < kp; j += 2 * W) {
        int two = j + W < kp;
        __m512 a[R][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int d = 0; d < D / 2; d++) {
            __m512bh k0 = (__m512bh)_mm512_loadu_si512(Kp + (d * Lp + j) * 2);
            __m512bh k1 = two ? (__m512bh)_mm512_loadu_si512(Kp + (d * Lp + j + W) * 2) : k0;
            for (int r = 0; r < R; r++) {
                __m512bh qb = (__m512bh)_mm512_set1_epi32(pair(Q + r * qr + 2 * d));
                a[r][0] = _mm512_dpbf16_ps(a[r][0], qb, k0);
                if (two) a[r][1] = _mm512_dpbf16_ps(a[r][1], qb, k1);
            }
        }
        for (int r = 0; r < R; r++) {
            st(S + r * Lp + j, (v16)a[r][0] * c);
            if (two) st(S + r * Lp + j + W, (v16)a[r][1] * c);
        }
    }
    softmax_and_weighted_sum(V, D, S, O, Lp, D, i0, causal, kmax, kp);
}
#else
#define NATIVE_BF16 0
#endif

/* 1 when bfloat16 inputs use the CPU's bfloat16 dot products (AVX512-BF16 at build time), else 0 (widened). */
int lab_attention_native_bf16(void) { return NATIVE_BF16; }

/* The float32 scratch for sequences of up to max_len tokens (what lab_varlen_attention allocates). */
int64_t lab_attention_scratch(int64_t max_len, int hq, int hkv, int D) {
    int64_t lp = (max_len + W - 1) / W * W;
    return lp * D * (hq + 2 * hkv) + 2 * R * lp + 2 * R * D + 2 * W;
}

/* q (T, hq, D), k/v (T, hkv, D), o (T, hq, D): strides in elements for tokens and heads, D contiguous.
 * bf16: 0 for float32 tensors, 1 for bfloat16. Returns 0; 1 for D not a multiple of 16 or hq not a multiple of
 * hkv; 2 when the scratch cannot be allocated. */
int lab_varlen_attention(int bf16, const void *q, int64_t qs0, int64_t qs1, const void *k, int64_t ks0,
                         int64_t ks1, const void *v, int64_t vs0, int64_t vs1, void *o, int64_t os0, int64_t os1,
                         const int64_t *cu_seqlens, int64_t nseq, int hq, int hkv, int D, float scale, int causal) {
    if (D <= 0 || D % W || hkv <= 0 || hq % hkv) return 1;
    int64_t max_len = 0;
    for (int64_t s = 0; s < nseq; s++)
        if (cu_seqlens[s + 1] - cu_seqlens[s] > max_len) max_len = cu_seqlens[s + 1] - cu_seqlens[s];
    float *buf = aligned_alloc(64, (size_t)(lab_attention_scratch(max_len, hq, hkv, D) + W - 1) / W * W * 4);
    if (!buf) return 2;
    const float c = scale * 1.4426950408889634f; /* exp(x * scale) = 2^(x * scale * log2 e) */
    const int group = hq / hkv;
    const int native = bf16 && NATIVE_BF16;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t t0 = cu_seqlens[s];
        const int L = (int)(cu_seqlens[s + 1] - t0);
        if (L <= 0) continue;
        const int64_t Lp = (L + W - 1) / W * W;
        /* scratch: S (R x Lp), O (R x D) and a zero-padded copy of a last, partial block of queries (R x D) in
         * float32, then K (and V, and for widened bfloat16 Q) as staged below */
        float *S = buf, *Ob = S + R * Lp, *Qpad = Ob + R * D, *rest = Qpad + R * D;
        if (native) {
#if NATIVE_BF16
            /* K as bfloat16 pairs along d (h, d/2, t, 2), V widened (h, t, d); Q read in place */
            float *Vw = rest;
            uint16_t *Kp = (uint16_t *)(Vw + hkv * Lp * D);
            const uint16_t *qh = q, *kh = k, *vh = v;
            for (int64_t t = 0; t < Lp; t++)
                for (int h = 0; h < hkv; h++)
                    for (int d = 0; d < D; d++) {
                        Kp[((h * D / 2 + d / 2) * Lp + t) * 2 + (d & 1)] = t < L ? kh[(t0 + t) * ks0 + h * ks1 + d] : 0;
                        Vw[(h * Lp + t) * D + d] = t < L ? bf16_to_f32(vh[(t0 + t) * vs0 + h * vs1 + d]) : 0.0f;
                    }
            uint16_t *Qz = (uint16_t *)Qpad;
            for (int h = 0; h < hq; h++) {
                const uint16_t *Kh = Kp + (h / group) * D * Lp;
                const float *Vh = Vw + (h / group) * Lp * D;
                for (int i0 = 0; i0 < L; i0 += R) {
                    const uint16_t *Qb = qh + (t0 + i0) * qs0 + h * qs1;
                    int64_t qr = qs0;
                    if (i0 + R > L) { /* the last rows: a zero-padded copy, never reading past the tensor */
                        memset(Qz, 0, (size_t)R * D * 2);
                        for (int r = 0; i0 + r < L; r++) memcpy(Qz + r * D, Qb + r * qs0, (size_t)D * 2);
                        Qb = Qz, qr = D;
                    }
                    if (D == 32) /* constant head sizes, fully unrolled */
                        block_bf16(Kh, Vh, Qb, qr, S, Ob, L, Lp, 32, i0, causal, c);
                    else if (D == 64)
                        block_bf16(Kh, Vh, Qb, qr, S, Ob, L, Lp, 64, i0, causal, c);
                    else
                        block_bf16(Kh, Vh, Qb, qr, S, Ob, L, Lp, D, i0, causal, c);
                    for (int r = 0; r < R && i0 + r < L; r++) {
                        uint16_t *at = (uint16_t *)o + (t0 + i0 + r) * os0 + h * os1;
                        for (int d = 0; d < D; d++) at[d] = f32_to_bf16(Ob[r * D + d]);
                    }
                }
            }
#endif
            continue;
        }
        /* float32 arithmetic: K transposed (h, d, t) and V (h, t, d) staged (a head's V is read once per block of
         * queries: from the packed tensor, rows a token's heads apart, it fell out of L1 and ran 1.2x slower at
         * 128 tokens); float32 Q read in place, bfloat16 Q widened into (h, t, d) */
        float *Kt = rest, *Vw = Kt + hkv * Lp * D, *Qw = Vw + hkv * Lp * D;
        for (int64_t t = 0; t < Lp; t++) {
            const int live = t < L;
            for (int h = 0; h < hkv; h++)
                for (int d = 0; d < D; d++) {
                    Kt[(h * D + d) * Lp + t] = live ? load(bf16, k, (t0 + t) * ks0 + h * ks1 + d) : 0.0f;
                    Vw[(h * Lp + t) * D + d] = live ? load(bf16, v, (t0 + t) * vs0 + h * vs1 + d) : 0.0f;
                }
            if (bf16)
                for (int h = 0; h < hq; h++)
                    for (int d = 0; d < D; d++) Qw[(h * Lp + t) * D + d] = live ? load(1, q, (t0 + t) * qs0 + h * qs1 + d) : 0.0f;
        }
        for (int h = 0; h < hq; h++) {
            const int hk = h / group;
            const float *Kh = Kt + hk * D * Lp;
            const float *Vh = Vw + hk * Lp * D;
            const int64_t vr = D;
            for (int i0 = 0; i0 < L; i0 += R) {
                const float *Qb = bf16 ? Qw + (h * Lp + i0) * D : (const float *)q + (t0 + i0) * qs0 + h * qs1;
                int64_t qr = bf16 ? D : qs0;
                if (!bf16 && i0 + R > L) {
                    memset(Qpad, 0, (size_t)R * D * 4);
                    for (int r = 0; i0 + r < L; r++) memcpy(Qpad + r * D, Qb + r * qs0, (size_t)D * 4);
                    Qb = Qpad, qr = D;
                }
                if (D == 32)
                    block(Kh, Vh, vr, Qb, qr, S, Ob, L, Lp, 32, i0, causal, c);
                else if (D == 64)
                    block(Kh, Vh, vr, Qb, qr, S, Ob, L, Lp, 64, i0, causal, c);
                else
                    block(Kh, Vh, vr, Qb, qr, S, Ob, L, Lp, D, i0, causal, c);
                for (int r = 0; r < R && i0 + r < L; r++) {
                    const int64_t at = (t0 + i0 + r) * os0 + h * os1;
                    if (bf16)
                        for (int d = 0; d < D; d++) ((uint16_t *)o)[at + d] = f32_to_bf16(Ob[r * D + d]);
                    else
                        memcpy((float *)o + at, Ob + r * D, (size_t)D * 4);
                }
            }
        }
    }
    free(buf);
    return 0;
}
