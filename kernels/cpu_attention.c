/* Varlen attention on one CPU thread: prefill-lab's own kernel, compiled on the running machine by
 * lab.kernels.cpu_attention (cc -O3 -march=native) and chosen, or not, by the attention_kernel probe.
 *
 * Packed tokens, one sequence after another (cu_seqlens); every query attends to the keys of its own sequence
 * (all of them, or those up to itself when causal). Grouped-query heads share a key/value head. Inputs float32 or
 * bfloat16, output in the inputs' dtype (bfloat16 rounds to nearest even); scores and sums in float32.
 *
 * Per sequence, K and V are staged once per key/value head: K transposed (head, d, token), V (head, token, d), keys
 * padded to a multiple of the vector width with zeros; with AVX-512, K is transposed 16 tokens x 16 words at a time
 * in registers. Queries are read in place. Then per head, per block of R query rows: the block's scores (R rows x
 * keys, keys across vector lanes, 2R accumulators in registers), masked (padding, the future when causal) and their
 * row maxima kept as they are stored, an exact softmax per row (exp2, sum), and the weighted sum of V, normalised at
 * the end. Staging element by element and a separate max pass with generic-vector horizontal reductions had cost a
 * large factor, most on short sequences (measured: evals/README.md, "Measurements behind the code's choices").
 *
 * bfloat16 on a CPU with AVX512-BF16 (known at compile time: the build is for this machine) uses its dot products
 * (vdpbf16ps: two exact products per float32 lane, float32 sums), K staged as bfloat16 pairs along d, V widened;
 * elsewhere bfloat16 widens to float32 while staging. The vector type is GCC's generic one (16 floats): AVX-512
 * where the CPU has it, AVX2 halves or scalar code elsewhere.
 */
#include "cpu_vector.h"

#ifndef R /* query rows per block: 2R vectors of accumulators, which must stay in registers */
#ifdef __AVX512F__
#define R 8 /* 32 vector registers; faster than 4 in float32, about alike in bfloat16 (measured: evals/README.md,
                "Measurements behind the code's choices") */
#else
#define R 4 /* AVX2's 16 registers hold a 16-float vector as two halves */
#endif
#endif

/* Store y, one vector of row r's results at column x. A score row (nvis: the keys each row sees) also gets -1e30 for
 * keys it does not see (padding, the future when causal: x + lane >= nvis[r]) and its running maximum in mx[r]. */
static inline __attribute__((always_inline)) void put(float *p, v16 y, int x, int r, const int *nvis, v16 *mx) {
    if (nvis) {
        if (x + W > nvis[r]) {
            const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
            y = vsel(lane + x < (v16i){0} + nvis[r], y, bc(-1.0e30f));
        }
        mx[r] = vmax(mx[r], y);
    }
    st(p, y);
}

/* out (R x cols, row stride os) = diag(scale) A B: A (R x n, row stride as), B (n x cols, row stride bs), cols a
 * multiple of W. The block's two products: the scores (A = Q, B = K^T; nvis and mx as in put) and the weighted sum
 * (A = weights, B = V; nvis NULL). Two vectors of columns at a time (2R accumulators in registers), one for an odd
 * last vector. */
static inline __attribute__((always_inline)) void rows_times(const float *A, int64_t as, const float *B, int64_t bs,
                                                             int n, int cols, const float *scale, float *out,
                                                             int64_t os, const int *nvis, v16 *mx) {
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
                put(out + r * os + x, a[r][0] * scale[r], x, r, nvis, mx);
                put(out + r * os + x + W, a[r][1] * scale[r], x + W, r, nvis, mx);
            }
        } else {
            v16 a[R] = {{0}};
            for (int k = 0; k < n; k++) {
                v16 b0 = ld(B + k * bs + x);
                for (int r = 0; r < R; r++) a[r] += bc(A[r * as + k]) * b0;
            }
            for (int r = 0; r < R; r++) put(out + r * os + x, a[r] * scale[r], x, r, nvis, mx);
        }
    }
}

/* The keys each row of the block starting at query i0 sees (all kmax, or up to itself when causal), and the
 * running maxima of its scores, at -1e30. */
static inline __attribute__((always_inline)) void visible(int *nvis, v16 *mx, int i0, int causal, int kmax) {
    for (int r = 0; r < R; r++) {
        nvis[r] = causal && i0 + r + 1 < kmax ? i0 + r + 1 : kmax;
        mx[r] = bc(-1.0e30f);
    }
}

/* The second half of a block: S (R x Lp) holds the block's scores (times log2 e) over its kp keys, -1e30 where a
 * row does not see the key, with each row's maximum in mx; turn each row into softmax weights and write the
 * weighted sum of V's rows (row stride vr) to O (R x D). */
static inline __attribute__((always_inline)) void softmax_and_weighted_sum(const float *V, int64_t vr, float *S,
                                                                           float *O, int64_t Lp, int D, int kmax,
                                                                           int kp, const v16 *mx) {
    float inv[R];
    v16 m[R], sum[R];
    for (int r = 0; r < R; r++) m[r] = bc(hmax(mx[r])), sum[r] = bc(0.0f);
    for (int j = 0; j < kp; j += W) /* the rows interleaved: R independent chains of sums (row by row, each
                                      * exp waited on the previous vector's sum, and float32 ran slower; measured:
                                      * evals/README.md, "Measurements behind the code's choices") */
        for (int r = 0; r < R; r++) {
            v16 e = exp2v(ld(S + r * Lp + j) - m[r]);
            st(S + r * Lp + j, e);
            sum[r] += e;
        }
    for (int r = 0; r < R; r++) inv[r] = 1.0f / hsum(sum[r]);
    rows_times(S, Lp, V, vr, kmax, D, inv, O, D, NULL, NULL);
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
    int nvis[R];
    v16 mx[R];
    for (int r = 0; r < R; r++) cs[r] = c;
    visible(nvis, mx, i0, causal, kmax);
    rows_times(Q, qr, Kt, Lp, D, kp, cs, S, Lp, nvis, mx);
    softmax_and_weighted_sum(V, vr, S, O, Lp, D, kmax, kp, mx);
}

/* Staging. A head's keys transposed: dst[w * Lp + t] = 32-bit word w of token t's row (rows `rs` bytes apart,
 * `words` words each; a word is a float32, a bfloat16 widened to float32 when `widen`, or a pair of bfloat16), zeros
 * for the padding tokens L <= t < Lp. With AVX-512, 16 tokens x 16 words at a time, transposed in registers (on short
 * sequences, staging one element at a time took several times the block's arithmetic; measured: evals/README.md,
 * "Measurements behind the code's choices"). */
#ifdef __AVX512F__
static inline void transpose16(__m512i r[16]) { /* r[i] word j -> r[j] word i */
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + p], 128-bit lane l: word 4l + p of rows i..i+3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int p = 0; p < 4; p++) { /* a 4 x 4 transpose of 128-bit lanes */
        __m512i x0 = _mm512_shuffle_i32x4(r[p], r[4 + p], 0x88), x1 = _mm512_shuffle_i32x4(r[p], r[4 + p], 0xdd);
        __m512i y0 = _mm512_shuffle_i32x4(r[8 + p], r[12 + p], 0x88);
        __m512i y1 = _mm512_shuffle_i32x4(r[8 + p], r[12 + p], 0xdd);
        t[p] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        t[4 + p] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        t[8 + p] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        t[12 + p] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}
#endif

static inline uint32_t word(const char *row, int w, int widen) {
    uint32_t x = 0;
    if (widen) {
        uint16_t h;
        memcpy(&h, row + 2 * w, 2);
        x = (uint32_t)h << 16;
    } else {
        memcpy(&x, row + 4 * w, 4);
    }
    return x;
}

static void stage_transposed(const char *src, int64_t rs, int words, int L, int64_t Lp, int widen, uint32_t *dst) {
    int w0 = 0;
#ifdef __AVX512F__
    for (; w0 + 16 <= words; w0 += 16)
        for (int t = 0; t < Lp; t += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const char *row = src + (t + i) * rs;
                if (t + i >= L)
                    r[i] = _mm512_setzero_si512();
                else if (widen)
                    r[i] = _mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(row + 2 * w0))), 16);
                else
                    r[i] = _mm512_loadu_si512(row + 4 * w0);
            }
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + (w0 + j) * Lp + t, r[j]);
        }
#endif
    for (int w = w0; w < words; w++)
        for (int64_t t = 0; t < Lp; t++) dst[w * Lp + t] = t < L ? word(src + t * rs, w, widen) : 0;
}


/* A head's values (or queries) as rows: dst[t * n + d] = element d of token t as float32 (widened from bfloat16
 * when `bf16`), zeros for L <= t < Lp. */
static void stage_rows(const char *src, int64_t rs, int n, int L, int64_t Lp, int bf16, float *dst) {
    for (int t = 0; t < L; t++) {
        if (bf16) {
            const uint16_t *row = (const uint16_t *)(src + t * rs);
            for (int d = 0; d < n; d++) dst[t * n + d] = bf16_to_f32(row[d]);
        } else {
            copy_row(dst + t * n, (const float *)(src + t * rs), n);
        }
    }
    for (int64_t i = (int64_t)L * n; i < Lp * n; i += W) st(dst + i, bc(0.0f));
}


#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define NATIVE_BF16 1
/* The same block on bfloat16 inputs, its scores by the CPU's bfloat16 dot products (vdpbf16ps: two exact products
 * per float32 lane, float32 sums): Q (R x D, read in place) and K as pairs along d (D/2 x Lp x 2). The softmax and
 * the weighted sum stay in float32 (V widened while staging): with the weights rounded to bfloat16 for a second
 * vdpbf16ps product, the median cosine of SmolLM2's bidirectional bfloat16 embeddings of 48 mixed texts to the
 * float32 engine's was 0.999921, against 0.999933 with float32 weights (torch's fused kernel 0.999942). Tried
 * again with this version's staging and softmax (V as bfloat16 pairs along keys): less kernel time, but SmolLM2's
 * bfloat16 embeddings of 96 mixed texts came only a little faster end to end and further from the float32 engine's
 * (worst cosine 0.99950 / 0.99662 against 0.99956 / 0.99757, mean / lasttoken pooling), and MiniLM's mixed corpus
 * a little faster: not kept (timings: evals/README.md, "Measurements behind the code's choices"). */
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
    int nvis[R];
    v16 mx[R];
    visible(nvis, mx, i0, causal, kmax);
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
            put(S + r * Lp + j, (v16)a[r][0] * c, j, r, nvis, mx);
            if (two) put(S + r * Lp + j + W, (v16)a[r][1] * c, j + W, r, nvis, mx);
        }
    }
    softmax_and_weighted_sum(V, D, S, O, Lp, D, kmax, kp, mx);
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
    const int64_t total = cu_seqlens[nseq]; /* rows of q and o */
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
            const uint16_t *qh = q;
            for (int h = 0; h < hkv; h++) {
                stage_transposed((const char *)k + (t0 * ks0 + h * ks1) * 2, ks0 * 2, D / 2, L, Lp, 0,
                                 (uint32_t *)Kp + h * (D / 2) * Lp);
                stage_rows((const char *)v + (t0 * vs0 + h * vs1) * 2, vs0 * 2, D, L, Lp, 1, Vw + h * Lp * D);
            }
            uint16_t *Qz = (uint16_t *)Qpad;
            for (int h = 0; h < hq; h++) {
                const uint16_t *Kh = Kp + (h / group) * D * Lp;
                const float *Vh = Vw + (h / group) * Lp * D;
                for (int i0 = 0; i0 < L; i0 += R) {
                    const uint16_t *Qb = qh + (t0 + i0) * qs0 + h * qs1;
                    int64_t qr = qs0;
                    if (t0 + i0 + R > total) { /* the tensor's last rows: a zero-padded copy, never reading past
                                                * it (elsewhere a block's rows past L are the next sequence's
                                                * tokens, computed and not stored) */
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
                    for (int r = 0; r < R && i0 + r < L; r++)
                        store_bf16((uint16_t *)o + (t0 + i0 + r) * os0 + h * os1, Ob + r * D, D);
                }
            }
#endif
            continue;
        }
        /* float32 arithmetic: K transposed (h, d, t) and V (h, t, d) staged (a head's V is read once per block of
         * queries: from the packed tensor, rows a token's heads apart, it fell out of L1 and ran slower; measured:
         * evals/README.md, "Measurements behind the code's choices"); float32 Q read in place, bfloat16 Q widened
         * into (h, t, d) */
        float *Kt = rest, *Vw = Kt + hkv * Lp * D, *Qw = Vw + hkv * Lp * D;
        const int es = bf16 ? 2 : 4; /* bytes per element */
        for (int h = 0; h < hkv; h++) {
            stage_transposed((const char *)k + (t0 * ks0 + h * ks1) * es, ks0 * es, D, L, Lp, bf16,
                             (uint32_t *)Kt + h * D * Lp);
            stage_rows((const char *)v + (t0 * vs0 + h * vs1) * es, vs0 * es, D, L, Lp, bf16, Vw + h * Lp * D);
        }
        if (bf16)
            for (int h = 0; h < hq; h++)
                stage_rows((const char *)q + (t0 * qs0 + h * qs1) * 2, qs0 * 2, D, L, Lp, 1, Qw + h * Lp * D);
        for (int h = 0; h < hq; h++) {
            const int hk = h / group;
            const float *Kh = Kt + hk * D * Lp;
            const float *Vh = Vw + hk * Lp * D;
            const int64_t vr = D;
            for (int i0 = 0; i0 < L; i0 += R) {
                const float *Qb = bf16 ? Qw + (h * Lp + i0) * D : (const float *)q + (t0 + i0) * qs0 + h * qs1;
                int64_t qr = bf16 ? D : qs0;
                if (!bf16 && t0 + i0 + R > total) { /* as in the bfloat16 branch */
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
                for (int r = 0; r < R && i0 + r < L; r++)
                    store_row(o, (t0 + i0 + r) * os0 + h * os1, Ob + r * D, D, bf16);
            }
        }
    }
    free(buf);
    return 0;
}
