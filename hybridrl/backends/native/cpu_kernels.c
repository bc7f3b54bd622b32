/* The native engine's CPU kernels, float32: what a decode step on a small model spends its time on
   once the matrix products are done (a few hundred tiny problems, each worth less than torch's
   fixed cost per operator).

   - hybridrl_paged_decode_f32: decode attention straight from the paged KV cache;
   - hybridrl_rms_norm_f32: RMSNorm of rows;
   - hybridrl_rope_store_f32: rotary embedding of the step's q and k, in place, and the step's K
     and V written into their cache slots;
   - hybridrl_silu_mul_f32: SiLU(gate) * up of the MLP;
   - hybridrl_linear_f32: the linear layers of a decode step (few rows), y = x w^T (+ bias) (+ residual).

   Numerics follow transformers' float32 order of operations (noted at each); sums are
   reassociated for vector registers (-fassociative-math), so they differ from torch's in the
   last bits, never more.

   exp is computed here (Cody and Waite's range reduction with the Cephes polynomial for expf,
   about 1 ulp), not by libm: the loops vectorise without -ffast-math, whose start-up code would
   switch the whole process to flush denormals to zero, and the result does not depend on the
   C library's version. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (arguments of a softmax after subtracting the maximum). Below -87 the
   result (under 2^-125) is returned as exp(-87): it adds nothing next to the maximum's 1. */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);        /* round(x / ln 2) */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;    /* x - n ln 2, ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;                             /* 2^n, n in [-126, 0] */
    return p * two_n.f;
}

/* Decode attention.

   One query token per row (a decoding sequence), `heads` query heads sharing `kv_heads` KV heads
   (grouped-query attention: query head h reads KV head h / (heads / kv_heads)). For each row and
   KV head, one task: the scores of the row's query heads against every visible key, a softmax,
   then the weighted sum of the values. Keys are read in place through the row's block table, so
   no gathered copy of the cache is made and no row is padded to another's length.

   Layout of one layer's cache (the engine's): [num_blocks, block_size, 2, kv_heads, head_dim],
   K and V of a token side by side. Row r's token t lies in block tables[r][t / block_size] at
   offset t % block_size; its context is tokens [0, lens[r]).

   The result of a row depends on that row alone (its query, its keys, their order), never on
   which other rows share the call or how the tasks are spread over threads.

   The work of one call; `head_dim` is a compile-time constant in the specialised copies below,
   so the inner loops are unrolled and kept in vector registers. */
static inline __attribute__((always_inline)) int decode(
    const float *q, int64_t q_row_stride, const float *kv, const int64_t *tables, const int64_t *lens,
    float *out, int64_t num_rows, int64_t heads, int64_t kv_heads, const int64_t head_dim,
    int64_t block_size, int64_t table_width, float scale, int num_threads)
{
    const int64_t group = heads / kv_heads;
    const int64_t token_stride = 2 * kv_heads * head_dim;     /* floats from one token to the next */
    int64_t max_len = 1;
    for (int64_t r = 0; r < num_rows; r++)
        max_len = lens[r] > max_len ? lens[r] : max_len;
    int failed = 0;

    #pragma omp parallel num_threads(num_threads)
    {
        /* per thread: the scores of one task's query heads */
        float *scratch = malloc(sizeof(float) * group * max_len);
        if (scratch == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_rows * kv_heads; task++) {
            if (scratch == NULL)
                continue;
            const int64_t r = task / kv_heads, kh = task % kv_heads, n = lens[r];
            const float *qr = q + r * q_row_stride + kh * group * head_dim;
            const int64_t *table = tables + r * table_width;
            float *scores = scratch;                          /* [group, n] */

            for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += block_size) {
                const float *keys = kv + table[b] * block_size * token_stride + kh * head_dim;
                const int64_t m = n - t0 < block_size ? n - t0 : block_size;
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qr + g * head_dim;
                    float *sg = scores + g * n + t0;
                    for (int64_t o = 0; o < m; o++) {
                        const float *k = keys + o * token_stride;
                        float s = 0.0f;
                        #pragma omp simd reduction(+:s)
                        for (int64_t d = 0; d < head_dim; d++)
                            s += qg[d] * k[d];
                        sg[o] = s * scale;
                    }
                }
            }
            /* per query head: softmax over the row's keys, the values weighted by it (normalised at the end) */
            for (int64_t g = 0; g < group; g++) {
                float *p = scores + g * n;
                float top = p[0];
                for (int64_t t = 1; t < n; t++)
                    top = p[t] > top ? p[t] : top;
                float total = 0.0f;
                #pragma omp simd reduction(+:total)
                for (int64_t t = 0; t < n; t++) {
                    p[t] = exp_nonpositive(p[t] - top);
                    total += p[t];
                }
                float acc[head_dim];
                for (int64_t d = 0; d < head_dim; d++)
                    acc[d] = 0.0f;
                for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += block_size) {
                    const float *values = kv + table[b] * block_size * token_stride + (kv_heads + kh) * head_dim;
                    const int64_t m = n - t0 < block_size ? n - t0 : block_size;
                    for (int64_t o = 0; o < m; o++) {
                        const float *v = values + o * token_stride;
                        const float w = p[t0 + o];
                        #pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++)
                            acc[d] += w * v[d];
                    }
                }
                const float inv = 1.0f / total;
                float *dst = out + (r * heads + kh * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; d++)
                    dst[d] = acc[d] * inv;
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* q: row r's query heads at q + r * q_row_stride, [heads, head_dim] contiguous; kv: one layer's
   cache; tables: [num_rows, table_width] block ids; lens: [num_rows] context lengths (>= 1);
   out: [num_rows, heads, head_dim] contiguous. Returns 0, or -1 when scratch memory could not
   be allocated (out is then incomplete). */
int hybridrl_paged_decode_f32(
    const float *q, int64_t q_row_stride, const float *kv, const int64_t *tables, const int64_t *lens,
    float *out, int64_t num_rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t block_size, int64_t table_width, float scale, int num_threads)
{
#define DECODE(D) decode(q, q_row_stride, kv, tables, lens, out, num_rows, heads, kv_heads, D, block_size, \
                         table_width, scale, num_threads)
    switch (head_dim) {
    case 32: return DECODE(32);
    case 64: return DECODE(64);
    case 128: return DECODE(128);
    default: return DECODE(head_dim);
    }
#undef DECODE
}

/* RMSNorm of `rows` rows of `dim` (row r at x + r * x_row_stride) into out [rows, dim]:
   weight * (x * rsqrt(mean(x^2) + eps)), as transformers' Qwen2RMSNorm / LlamaRMSNorm in float32. */
void hybridrl_rms_norm_f32(const float *x, int64_t x_row_stride, const float *weight, float *out, int64_t rows,
                           int64_t dim, float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_row_stride;
        float *o = out + r * dim;
        float squares = 0.0f;
        #pragma omp simd reduction(+:squares)
        for (int64_t d = 0; d < dim; d++)
            squares += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            o[d] = weight[d] * (xr[d] * inv);
    }
}

/* x * sigmoid(x), sigmoid from exp of a non-positive argument on either side of 0. */
static inline float silu(float x)
{
    const float e = exp_nonpositive(x < 0.0f ? x : -x);
    return x < 0.0f ? x * (e / (1.0f + e)) : x / (1.0f + e);
}

/* out [rows, inter] = SiLU(gate) * up, gate_up [rows, 2 * inter] (gate first, as the engine fuses them). */
void hybridrl_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; i++)
            o[i] = silu(g[i]) * u[i];
    }
}

/* Rotate-half RoPE of the step's query and key heads, in place, then K and V into the cache.

   qkv: token n's projections at qkv + n * qkv_row_stride: `heads` query heads, `kv_heads` key heads,
   `kv_heads` value heads, head_dim each. table [max_len, 2, head_dim / 2]: cos then sin at each
   position. x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin for the halves x1, x2 of a head
   (transformers' q * cos + rotate_half(q) * sin). Token n's rotated K and its V go to cache slot
   slots[n] of kv_layer [slots, 2, kv_heads, head_dim]. */
void hybridrl_rope_store_f32(float *qkv, int64_t qkv_row_stride, const float *table, const int64_t *positions,
                             const int64_t *slots, float *kv_layer, int64_t tokens, int64_t heads, int64_t kv_heads,
                             int64_t head_dim)
{
    const int64_t half = head_dim / 2;
    for (int64_t n = 0; n < tokens; n++) {
        float *row = qkv + n * qkv_row_stride;
        const float *cos = table + positions[n] * 2 * half, *sin = cos + half;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x1 = row + h * head_dim, *x2 = x1 + half;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
        }
        float *dst = kv_layer + slots[n] * 2 * kv_heads * head_dim;
        const float *src = row + heads * head_dim;
        for (int64_t i = 0; i < 2 * kv_heads * head_dim; i++)
            dst[i] = src[i];
    }
}

/* Linear layers of few rows.

   A decode step multiplies a handful of rows (one per running sequence) by every weight matrix, so
   its time is reading the weights and multiplying, and BLAS's kernels, built for many rows, pack
   the weights first: at ~100M parameters and 16 rows, torch's linear (MKL) ran at about half the
   rate this loop does (measured on a 2-core AMD EPYC, docs/native-engine.md). Here each thread
   takes blocks of 4 output features (4 rows of w, read once from memory) and multiplies them with
   tiles of up to 4 rows of x, 16 vector accumulators of 16 lanes in registers.

   Every output is the same arithmetic whatever the tile, the number of rows or threads: lane-wise
   multiply-adds over k in steps of 16, the lanes folded in one fixed order, then the k % 16 tail,
   then the bias, then the residual. So a row's result depends on that row alone (tested: the
   same bits alone and in any batch); it differs from torch's in the last bits. */
typedef float vf16 __attribute__((vector_size(64), aligned(4)));

static inline vf16 load16(const float *p)
{
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float fold16(vf16 a)
{
    float s[16];
    memcpy(s, &a, sizeof s);
    float h8[8], h4[4];
    for (int i = 0; i < 8; i++) h8[i] = s[i] + s[i + 8];
    for (int i = 0; i < 4; i++) h4[i] = h8[i] + h8[i + 4];
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

/* The end of one output's dot product, the same for every output: the 16 lanes accumulated over
   k < k_vec folded, then the k % 16 tail of row xr against row wr. */
static inline float finish_dot(vf16 acc, const float *xr, const float *wr, int64_t k_vec, int64_t k_len)
{
    float tail = 0.0f;
    for (int64_t k = k_vec; k < k_len; k++)
        tail += xr[k] * wr[k];
    return fold16(acc) + tail;
}

#define NB 4

/* Keeps the four loaded w vectors and the x vector of a k-step in registers: without it gcc 12
   (-march=znver4) loads them again from memory for every multiply-add that uses them (2.5x the
   loads; the loop ran ~1.3x slower). Where a 16-lane vector is not one register (no AVX-512), the
   compiler is left to itself. */
#if defined(__AVX512F__)
#define IN_REGISTERS(a, b, c, d) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d))
#define IN_REGISTER(a) __asm__("" : "+v"(a))
#else
#define IN_REGISTERS(a, b, c, d) ((void)0)
#define IN_REGISTER(a) ((void)0)
#endif

/* One tile: rows [0, mb) of x against 4 rows of w. The 4 w vectors of a k-step are loaded once and
   kept in registers for the mb rows (written out, not as arrays, so that the compiler keeps them). */
#define DOT_ROW(i)                                                                               \
    do {                                                                                         \
        vf16 xv = load16(x + (i) * ldx + k);                                                     \
        IN_REGISTER(xv);                                                                         \
        a##i##0 += xv * w0; a##i##1 += xv * w1; a##i##2 += xv * w2; a##i##3 += xv * w3;          \
    } while (0)

static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *w, int64_t k_len, int64_t k_vec, const int mb, float out[4][NB])
{
    vf16 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    vf16 a20 = {0}, a21 = {0}, a22 = {0}, a23 = {0}, a30 = {0}, a31 = {0}, a32 = {0}, a33 = {0};
    for (int64_t k = 0; k < k_vec; k += 16) {
        vf16 w0 = load16(w + k), w1 = load16(w + k_len + k);
        vf16 w2 = load16(w + 2 * k_len + k), w3 = load16(w + 3 * k_len + k);
        IN_REGISTERS(w0, w1, w2, w3);
        DOT_ROW(0);
        if (mb > 1) DOT_ROW(1);
        if (mb > 2) DOT_ROW(2);
        if (mb > 3) DOT_ROW(3);
    }
    const vf16 acc[4][NB] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}};
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < NB; j++)
            out[i][j] = finish_dot(acc[i][j], x + i * ldx, w + j * k_len, k_vec, k_len);
}

static void tile_of_rows(const float *x, int64_t ldx, const float *w, int64_t k_len, int64_t k_vec, int mb,
                          float out[4][NB])
{
    switch (mb) {
    case 4: tile(x, ldx, w, k_len, k_vec, 4, out); break;
    case 3: tile(x, ldx, w, k_len, k_vec, 3, out); break;
    case 2: tile(x, ldx, w, k_len, k_vec, 2, out); break;
    default: tile(x, ldx, w, k_len, k_vec, 1, out); break;
    }
}

/* y [rows, n_len] = x [rows, k_len] (row stride ldx) times w [n_len, k_len]^T, plus bias [n_len] and
   residual [rows, n_len] where given (NULL: none); w, bias, residual and y contiguous. */
void hybridrl_linear_f32(const float *x, int64_t ldx, const float *w, const float *bias, const float *residual,
                         float *y, int64_t rows, int64_t k_len, int64_t n_len, int num_threads)
{
    const int64_t k_vec = k_len - k_len % 16;
    const int64_t blocks = (n_len + NB - 1) / NB;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * NB;
        const int64_t nb = n_len - n0 < NB ? n_len - n0 : NB;
        const float *wb = w + n0 * k_len;
        float out[4][NB];
        for (int64_t m0 = 0; m0 < rows; m0 += 4) {
            const int mb = rows - m0 < 4 ? (int)(rows - m0) : 4;
            if (nb == NB) {
                tile_of_rows(x + m0 * ldx, ldx, wb, k_len, k_vec, mb, out);
            } else {
                for (int i = 0; i < mb; i++)
                    for (int j = 0; j < nb; j++) {
                        const float *xr = x + (m0 + i) * ldx, *wr = wb + j * k_len;
                        vf16 acc = (vf16){0};
                        for (int64_t k = 0; k < k_vec; k += 16)
                            acc += load16(xr + k) * load16(wr + k);
                        out[i][j] = finish_dot(acc, xr, wr, k_vec, k_len);
                    }
            }
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nb; j++) {
                    float v = out[i][j];
                    if (bias) v += bias[n0 + j];
                    if (residual) v = residual[(m0 + i) * n_len + n0 + j] + v;
                    y[(m0 + i) * n_len + n0 + j] = v;
                }
        }
    }
}
