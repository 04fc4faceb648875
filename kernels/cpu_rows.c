/* Row kernels on one CPU thread, built into the same library as cpu_attention.c by lab.kernels.cpu_attention:
 * LayerNorm and RMSNorm of x + residual (lab.kernels.cpu_norms) and rotary embeddings in the `pairs` layout
 * (lab.kernels.cpu_rope). */
#include "cpu_vector.h"

/* ----------------------------------------------------------------------------------------------------------------
 * LayerNorm(x + residual) over rows, on one CPU thread (lab.kernels.cpu_norms): BERT's post-norm after a GEMM. One
 * pass over each row's inputs and one store, against torch's two ops (the add writes a (T, n) temporary that the norm
 * reads back, then the norm allocates its output), and the output may be x itself (the GEMM's own result), so a layer
 * allocates nothing for it. Row by row: the sum (rounded to bfloat16 for bfloat16 inputs, as torch's bfloat16 add
 * does), its mean, then the variance about that mean (two passes over the row in L1, not one-pass moments), then
 * (s - mean) / sqrt(var + eps) * weight + bias in float32, stored in the inputs' dtype. */

/* 16 bfloat16 values widened to float32 */
static inline v16 ld_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
#else
    v16 y;
    for (int i = 0; i < W; i++) y[i] = bf16_to_f32(p[i]);
    return y;
#endif
}

/* float32 values rounded to the nearest bfloat16 (even on ties), as float32; NaN stays NaN */
static inline v16 round_bf16(v16 v) {
    const v16i b = (v16i)v;
    const v16i high = (v16i){0} - 65536; /* 0xffff0000 in every lane */
    return vsel(v != v, v, (v16)((b + 0x7fff + ((b >> 16) & 1)) & high));
}

static inline v16 ld_row(const void *p, int64_t i, int bf16) {
    return bf16 ? ld_bf16((const uint16_t *)p + i) : ld((const float *)p + i);
}

/* x's 16 elements at xi plus, where res is not NULL, the residual's at ri: the sum both norms start from, rounded to
 * bfloat16 for bfloat16 inputs as torch's add rounds it. */
static inline v16 ld_sum(const void *x, int64_t xi, const void *res, int64_t ri, int bf16) {
    v16 y = ld_row(x, xi, bf16);
    if (res) {
        y += ld_row(res, ri, bf16);
        if (bf16) y = round_bf16(y);
    }
    return y;
}

/* x, residual (may be NULL), out: T rows of n elements (n a multiple of 16), row strides in elements, float32 or
 * bfloat16 (bf16 = 1) alike, as are weight and bias (n each; bias may be NULL). out may be x or residual: each row
 * is read whole before it is written. Returns 0; 1 for n not a positive multiple of 16; 2 when the row scratch cannot
 * be allocated. */
int lab_add_layer_norm(int bf16, const void *x, int64_t xs, const void *res, int64_t rs, const void *weight,
                       const void *bias, void *out, int64_t os, int64_t T, int n, float eps) {
    if (n <= 0 || n % W) return 1;
    float *buf = aligned_alloc(64, (size_t)n * 3 * sizeof(float));
    if (!buf) return 2;
    float *s = buf, *w = s + n, *b = w + n;
    for (int d = 0; d < n; d += W) {
        st(w + d, ld_row(weight, d, bf16));
        st(b + d, bias ? ld_row(bias, d, bf16) : bc(0.0f));
    }
    const float inv_n = 1.0f / (float)n;
    for (int64_t t = 0; t < T; t++) {
        v16 acc = {0};
        for (int d = 0; d < n; d += W) {
            v16 y = ld_sum(x, t * xs + d, res, t * rs + d, bf16);
            st(s + d, y);
            acc += y;
        }
        const v16 mean = bc(hsum(acc) * inv_n);
        v16 sq = {0};
        for (int d = 0; d < n; d += W) {
            v16 c = ld(s + d) - mean;
            sq += c * c;
        }
        const v16 rstd = bc(1.0f / __builtin_sqrtf(hsum(sq) * inv_n + eps));
        for (int d = 0; d < n; d += W) st(s + d, (ld(s + d) - mean) * rstd * ld(w + d) + ld(b + d));
        store_row(out, t * os, s, n, bf16);
    }
    free(buf);
    return 0;
}

/* ----------------------------------------------------------------------------------------------------------------
 * RMSNorm(x + residual) over rows, on one CPU thread (lab.kernels.cpu_norms): the pre-norm of Llama-style blocks,
 * returning both the sum (the next residual) and its norm. torch's path (lab.kernels.reference.add_rms_norm) makes
 * five passes over (T, n) tensors, each writing a temporary (the add, the float32 copy, the norm, the scaling, the
 * weight); here one pass reads x and the residual, writes the sum (rounded to bfloat16 for bfloat16 inputs, as
 * torch's add does) and keeps it in float32 for a second pass over the row in L1: s / rms (rms = sqrt(mean(s^2) +
 * eps) in float32), rounded to the inputs' dtype as torch's cast back does, times the weight, stored in that dtype.
 *
 * x, residual (may be NULL: the sum is x), sum (may be NULL: not stored; may be x or residual), out: T rows of n
 * elements (n a multiple of 16), row strides in elements, all float32 or all bfloat16 (bf16 = 1), as is weight (n).
 * out may be x only when sum is not x. Returns 0; 1 for n not a positive multiple of 16; 2 when the row scratch
 * cannot be allocated. */
int lab_add_rms_norm(int bf16, const void *x, int64_t xs, const void *res, int64_t rs, const void *weight,
                     void *sum, int64_t ss, void *out, int64_t os, int64_t T, int n, float eps) {
    if (n <= 0 || n % W) return 1;
    float *buf = aligned_alloc(64, (size_t)n * 2 * sizeof(float));
    if (!buf) return 2;
    float *s = buf, *w = s + n;
    for (int d = 0; d < n; d += W) st(w + d, ld_row(weight, d, bf16));
    const float inv_n = 1.0f / (float)n;
    for (int64_t t = 0; t < T; t++) {
        v16 sq = {0};
        for (int d = 0; d < n; d += W) {
            v16 y = ld_sum(x, t * xs + d, res, t * rs + d, bf16);
            st(s + d, y);
            sq += y * y;
        }
        if (sum) store_row(sum, t * ss, s, n, bf16);
        const v16 inv = bc(1.0f / __builtin_sqrtf(hsum(sq) * inv_n + eps));
        for (int d = 0; d < n; d += W) {
            v16 y = ld(s + d) * inv;
            if (bf16) y = round_bf16(y);
            st(s + d, y * ld(w + d));
        }
        store_row(out, t * os, s, n, bf16);
    }
    free(buf);
    return 0;
}

/* ----------------------------------------------------------------------------------------------------------------
 * Rotary position embeddings in the `pairs` layout (lab.models.rope, lab.kernels.cpu_rope), in place, on one CPU
 * thread: every head of row t of x has its feature pairs (x[2i], x[2i+1]) multiplied as complex numbers by
 * cis[t][i] = (cos, sin). One pass; torch's path for bfloat16 widens the heads to a float32 copy, multiplies it and
 * rounds it back (three passes, slower; measured: evals/README.md, "Measurements behind the code's choices").
 * Arithmetic in float32, bfloat16 rounded once at the end (nearest even). x: T rows of H heads of D elements (D even,
 * contiguous), strides in elements; cis: float32 (cos, sin) pairs, D/2 per row, rows cs floats apart. Returns 0; 1
 * for D not a positive even number. */
int lab_rope_pairs(int bf16, void *x, int64_t xs0, int64_t xs1, const float *cis, int64_t cs, int64_t T, int H,
                   int D) {
    if (D <= 0 || D % 2) return 1;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cis + t * cs;
        for (int h = 0; h < H; h++) {
            if (bf16) {
                uint16_t *p = (uint16_t *)x + t * xs0 + h * xs1;
                for (int i = 0; i < D; i += 2) {
                    const float a = bf16_to_f32(p[i]), b = bf16_to_f32(p[i + 1]);
                    p[i] = f32_to_bf16(a * c[i] - b * c[i + 1]);
                    p[i + 1] = f32_to_bf16(a * c[i + 1] + b * c[i]);
                }
            } else {
                float *p = (float *)x + t * xs0 + h * xs1;
                for (int i = 0; i < D; i += 2) {
                    const float a = p[i], b = p[i + 1];
                    p[i] = a * c[i] - b * c[i + 1];
                    p[i + 1] = a * c[i + 1] + b * c[i];
                }
            }
        }
    }
    return 0;
}
