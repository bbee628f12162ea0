// Small-M matmul straight from ggml-quantized weight rows: out[M, N] = x[M, K] @ W[N, K]^T.
// At batch 1-8 decode is bound by reading the weights; reading the 4.5-8.5 bit blocks
// instead of their float32 expansion moves ~5x fewer bytes. Each 32-weight block is
// dequantized once into registers and reused by every row of x.
//
// Exactness: the dequantized weight is computed exactly as gguf/ggml does (float32
// d*q + m, d*q, (q-8)*d with d, m from fp16); the build uses -ffp-contract=off so
// the compiler cannot fuse that multiply-add. Only the dot product uses FMA.
#include <stdint.h>
#include <string.h>

#include "fp16.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QGEMV_SIMD 1
#endif

enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8 };  // ggml type ids
enum { QK = 32, MAX_MB = 8 };

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static int block_bytes(int qtype) {
    switch (qtype) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q8_0: return 34;
    default: return -1;
    }
}

#ifdef QGEMV_SIMD
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// The 32 weights of one block as four vectors of 8 (element order 0..31).
static inline __attribute__((always_inline)) void dequant_block(int qtype, const uint8_t *b,
                                                                __m256 w[4]) {
    if (qtype == QT_Q8_0) {
        const __m256 d = _mm256_set1_ps(half_to_float(rd16(b)));
        for (int j = 0; j < 4; ++j) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j));
            w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
        }
        return;
    }
    const int off = qtype == QT_Q4_1 ? 4 : 2;
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + off));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);                     // elements 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  // elements 16..31
    __m256 q[4] = {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
    };
    const __m256 d = _mm256_set1_ps(half_to_float(rd16(b)));
    if (qtype == QT_Q4_1) {
        const __m256 m = _mm256_set1_ps(half_to_float(rd16(b + 2)));
        for (int j = 0; j < 4; ++j) w[j] = _mm256_add_ps(_mm256_mul_ps(d, q[j]), m);
    } else {
        const __m256 eight = _mm256_set1_ps(8.0f);
        for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(_mm256_sub_ps(q[j], eight), d);
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One weight row against MB rows of x with NA accumulators per x row: enough
// independent FMA chains to hide latency while staying within 16 ymm registers.
static inline __attribute__((always_inline)) void row_dot(int qtype, const uint8_t *row,
                                                          int64_t nb, int bb, const float *x,
                                                          int64_t ldx, float *out, int64_t ldo,
                                                          const int MB, const int NA) {
    __m256 acc[MAX_MB][4];
    for (int m = 0; m < MB; ++m)
        for (int a = 0; a < NA; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256 w[4];
        dequant_block(qtype, row + b * bb, w);
        for (int m = 0; m < MB; ++m) {
            const float *xb = x + m * ldx + b * QK;
            for (int j = 0; j < 4; ++j)
                acc[m][j % NA] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[m][j % NA]);
        }
    }
    for (int m = 0; m < MB; ++m) {
        __m256 s = acc[m][0];
        for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[m][a]);
        out[m * ldo] = hsum(s);
    }
}

#define ROW_DOT_CASE(mb, na)                                                               \
    case mb:                                                                               \
        if (qtype == QT_Q4_1) row_dot(QT_Q4_1, row, nb, bb, x, ldx, out, ldo, mb, na);   \
        else if (qtype == QT_Q8_0) row_dot(QT_Q8_0, row, nb, bb, x, ldx, out, ldo, mb, na); \
        else row_dot(QT_Q4_0, row, nb, bb, x, ldx, out, ldo, mb, na);                      \
        break;

static void row_dot_any(int qtype, const uint8_t *row, int64_t nb, int bb, const float *x,
                        int64_t ldx, float *out, int64_t ldo, int mb) {
    switch (mb) {
        ROW_DOT_CASE(1, 4)
        ROW_DOT_CASE(2, 2)
        ROW_DOT_CASE(3, 2)
        ROW_DOT_CASE(4, 2)
        ROW_DOT_CASE(5, 1)
        ROW_DOT_CASE(6, 1)
        ROW_DOT_CASE(7, 1)
        ROW_DOT_CASE(8, 1)
    }
}
#else
// Portable fallback: the same per-weight arithmetic, scalar.
static inline float half_to_float(uint16_t h) { return fp16_to_f32(h); }

static void row_dot_any(int qtype, const uint8_t *row, int64_t nb, int bb, const float *x,
                        int64_t ldx, float *out, int64_t ldo, int mb) {
    float acc[MAX_MB] = {0};
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = row + b * bb;
        const float d = half_to_float(rd16(blk));
        float w[QK];
        if (qtype == QT_Q8_0) {
            for (int i = 0; i < QK; ++i) w[i] = (float)(int8_t)blk[2 + i] * d;
        } else if (qtype == QT_Q4_1) {
            const float mn = half_to_float(rd16(blk + 2));
            for (int i = 0; i < QK / 2; ++i) {
                w[i] = d * (float)(blk[4 + i] & 0x0F) + mn;
                w[i + QK / 2] = d * (float)(blk[4 + i] >> 4) + mn;
            }
        } else {
            for (int i = 0; i < QK / 2; ++i) {
                w[i] = (float)((blk[2 + i] & 0x0F) - 8) * d;
                w[i + QK / 2] = (float)((blk[2 + i] >> 4) - 8) * d;
            }
        }
        for (int m = 0; m < mb; ++m) {
            const float *xb = x + m * ldx + b * QK;
            for (int i = 0; i < QK; ++i) acc[m] += w[i] * xb[i];
        }
    }
    for (int m = 0; m < mb; ++m) out[m * ldo] = acc[m];
}
#endif

// w: [N, row_bytes] raw blocks; x: [M, K] float32, contiguous; out: [M, N] float32.
// Returns 0, or -1 for an unsupported type or a K that is not a whole number of blocks.
int qgemv_f32(int qtype, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes,
              const float *x, int64_t M, float *out, int n_threads) {
    const int bb = block_bytes(qtype);
    if (bb < 0 || K % QK || row_bytes != K / QK * bb) return -1;
    const int64_t nb = K / QK;
    // Rows in chunks so each thread streams a contiguous stretch of the weights.
#pragma omp parallel for schedule(static, 16) num_threads(n_threads)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_MB) {
            const int mb = (int)(M - m0 < MAX_MB ? M - m0 : MAX_MB);
            row_dot_any(qtype, row, nb, bb, x + m0 * K, K, out + m0 * N + n, N, mb);
        }
    }
    return 0;
}
