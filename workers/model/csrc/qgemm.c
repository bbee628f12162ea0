// Int8 matmul on ggml-quantized weights: out[M, N] = q8(x)[M, K] @ W[N, K]^T.
//
// The activations are quantized once per matmul to 8 bits per 32-element block with a
// float32 scale (llama.cpp's Q8 scheme with a wider scale), and every weight block is
// multiplied by them with integer dot products (AVX2 maddubs, AVX512-VNNI / AVX-VNNI
// dpbusd). Weight types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (5-bit weights: at most 4
// maddubs pairs summed in 16 bits).
//
// Two layouts of the quantized activations, chosen by the row count:
//  - row-major: below QG_INTER_MIN rows, and at every row count where the weights have a
//    repacked copy (every type: qgemm_pack, made once at load by the decode step), in
//    passes of QG_SMALL_MAX rows. With the copy 8 weight rows are interleaved 4 bytes at a
//    time, so each lane is one output row and each activation row's 4-byte slices are
//    broadcast to meet 8 weight rows in one instruction (16 in AVX512-VNNI builds, which
//    pair the groups: qgemm_packed.h, QG_PAIR; prompt passes there take two pairs at once,
//    qg_quad); without one (or for rows outside
//    whole groups of 8: threads share rows out in whole groups, so only a row count that is
//    no multiple of 8 has them) a weight block is unpacked once and meets each row's 32
//    bytes in one vector, then 8 blocks' dots are reduced across lanes. From
//    QG_BLOCKED_MIN rows the copy's path reads each pass block-major (the quantizer's copy).
//  - otherwise: groups of 8 activation rows interleaved 4 bytes at a time, so each lane of
//    a vector is one row: a 4-weight slice is broadcast and meets 8 rows in one instruction
//    (batches and prefill on weights without a copy). It reads 8x the activation bytes
//    per product of the copy's path, from L2: 1.3-2x slower there (docs/benchmarks.md).
// Every path gives a row the same result bit for bit, whatever M, the layout, the thread
// count or the other rows: the integer dot of a block is exact, each block's value is
//   v_b = [coef_b * s_b +] idot_b * (ws_b * d_b)          (one rounding order)
// and a row's sum is fixed: P_j = sum of v_b over b = j mod 8 in order of b, then
// ((P0 + P1) + (P2 + P3)) + ((P4 + P5) + (P6 + P7)). A request's tokens therefore do not
// depend on what it is batched with. The file is built with -ffp-contract=off so the
// compiler fuses nothing the code does not.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QG_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QG_VNNI 1
#define QG_DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#if defined(__AVX512BW__) && defined(__AVX512DQ__) && !defined(QG_NO_W512)
// the repacked kernel also at 16 lanes (two groups of 8 weight rows per 512-bit vector)
#define QG_W512 1
#endif
#elif defined(__AVXVNNI__)
#define QG_VNNI 1
#define QG_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#elif defined(QG_EMULATE_VNNI)
// Tests only: the VNNI code paths on a host without VNNI, dpbusd written out in scalar
// (each 32-bit lane adds its four u8 x s8 products, no saturation).
#define QG_VNNI 1
static inline __m256i qg_dpbusd_emul(__m256i acc, __m256i u, __m256i s) {
    uint8_t a[32];
    int8_t b[32];
    int32_t c[8];
    _mm256_storeu_si256((__m256i *)a, u);
    _mm256_storeu_si256((__m256i *)b, s);
    _mm256_storeu_si256((__m256i *)c, acc);
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4; ++k) c[i] += (int32_t)a[4 * i + k] * (int32_t)b[4 * i + k];
    return _mm256_loadu_si256((const __m256i *)c);
}
#define QG_DPBUSD(acc, u, s) qg_dpbusd_emul((acc), (u), (s))
#endif
#endif

// AVX2 without VNNI: the repacked kernel takes Q6_K's offsets through one madd of both halves'
// scales by the activation's o16 (qg_pk_idot), which the quantizer then writes.
#if defined(QG_AVX2) && !defined(QG_VNNI)
#define QG_O16 1
#endif

enum { QG_Q4_0 = 2, QG_Q4_1 = 3, QG_Q5_0 = 6, QG_Q5_1 = 7, QG_Q8_0 = 8, QG_Q4_K = 12, QG_Q5_K = 13, QG_Q6_K = 14 };  // ggml ids
// A scale and a min per 32 weights (Q4_1, Q5_1); Q4_K's header (Q4_K, Q5_K); 5-bit weights.
static inline int qg_min32(int qtype) { return qtype == QG_Q4_1 || qtype == QG_Q5_1; }
static inline int qg_k4like(int qtype) { return qtype == QG_Q4_K || qtype == QG_Q5_K; }
static inline int qg_five(int qtype) { return qtype == QG_Q5_0 || qtype == QG_Q5_1 || qtype == QG_Q5_K; }
// Q4_0 and Q5_0: unsigned quants minus a fixed offset (8, 16), taken off through the
// activation sums: coef = -offset * d.
static inline int qg_off32(int qtype) { return qtype == QG_Q4_0 ? 8 : qtype == QG_Q5_0 ? 16 : 0; }
// whether a block's float step adds coef times the activation's sum (Q6_K's offsets are
// taken off in integers, Q8_0 has none)
static inline int qg_sum_term(int qtype) { return qtype != QG_Q8_0 && qtype != QG_Q6_K; }
// The interleaved layout from QG_INTER_MIN rows on, and never where every weight has its
// repacked copy (qgemm_pack); the row-major layout's passes take QG_SMALL_MAX rows.
// QG_BLOCKED_MIN: from this many rows the copy's path reads a block-major copy of the
// activations (the quantizer's bq). QG_SPLIT_MIN: from this many rows a pass takes a block's
// integer dots for every row before their float steps (qg_rows_packed). QG_QUAD_MIN: from
// this many rows the 512-bit kernel takes two pairs of weight groups at once (qg_quad), in
// runs of QG_QUAD_ROWS rows: a pass's rows unpack each weight block once (their partial
// sums, 64 KB, then spill from L1 to L2: still 1.01-1.04x over runs of 32 rows, whose sums
// stayed in L1; 16 or 24 rows: 0.95-1x).
enum { QG_QK = 32, QG_QKK = 256, QG_INTER_MIN = 7, QG_SMALL_MAX = 64, QG_BLOCKED_MIN = 16, QG_SPLIT_MIN = 4 };
enum { QG_QUAD_MIN = 32, QG_QUAD_ROWS = QG_SMALL_MAX };
#define QG_PACKED_INTER_MIN INT64_MAX

static int qg_block_bytes(int qtype) {  // bytes per 32 (Q4_0 ... Q8_0) or 256 weights (K-quants)
    switch (qtype) {
    case QG_Q4_0: return 18;
    case QG_Q5_0: return 22;
    case QG_Q4_1: return 20;
    case QG_Q5_1: return 24;
    case QG_Q8_0: return 34;
    case QG_Q4_K: return 144;
    case QG_Q5_K: return 176;
    case QG_Q6_K: return 210;
    default: return -1;
    }
}

// A repacked group of 8 rows (qgemm_pack): per block, the bytes of its scales (and Q4_1's
// mins) before its quants, and its 4-byte words of quants per row.
static inline int64_t qg_pk_hdr(int qtype) { return qg_min32(qtype) ? 32 : 16; }
static inline int qg_pk_words(int qtype) { return qtype == QG_Q8_0 ? 8 : 4; }
static inline int qg_packable(int qtype) {
    return qg_off32(qtype) || qg_min32(qtype) || qtype == QG_Q8_0 || qg_k4like(qtype) || qtype == QG_Q6_K;
}
// Q4_K repacked: per 8 rows and super-block, their d and dmin (f16), then per 32-weight
// slice their 6-bit scales and mins as bytes and the Q4 vectors: 148 bytes a row per
// super-block (the original's 144, its scales unpacked); a row's bytes in the copy.
enum { QG_PK_K4_SB = 8 * 148, QG_PK_K4_HDR = 32, QG_PK_K4_SLICE = 16 + 128 };
// Q6_K repacked: per 8 rows and super-block, their d (f16), then per 32-weight slice the
// rows' two 16-weight scales (int8), the low 4 bits of the weights as Q4's vectors and
// their top 2 bits in two vectors (vector q, lane r, byte i: weights 4q + i, 8 + 4q + i,
// 16 + 4q + i and 24 + 4q + i at bits 0, 2, 4 and 6): 210 bytes a row, as the original.
enum { QG_PK_K6_SB = 8 * 210, QG_PK_K6_HDR = 16, QG_PK_K6_SLICE = 16 + 128 + 64 };
// Q5_K repacked: Q4_K's, and after each slice's Q4 vectors one vector of the weights' fifth
// bits (lane r, byte i, bit g: weight 4g + i), as Q5_1's copy has per block: 180 bytes a row
// per super-block (the original's 176).
enum { QG_PK_K5_SB = 8 * 180, QG_PK_K5_SLICE = 16 + 128 + 32 };
static inline int64_t qg_pk_row_bytes(int qtype, int64_t K, int64_t row_bytes) {
    return qtype == QG_Q4_K ? K / QG_QKK * 148 : qtype == QG_Q5_K ? K / QG_QKK * 180 : row_bytes;
}
static int qg_block_size(int qtype) { return qg_k4like(qtype) || qtype == QG_Q6_K ? QG_QKK : QG_QK; }
// A K-quant's repacked super-block in pieces: its header (hdr 1: the rows' d, dmin), then its
// 8 slices (hdr 0); 0 for the other types, whose piece is a block.
static inline int64_t qg_pk_kpiece(int qtype, int hdr) {
    if (qtype == QG_Q6_K) return hdr ? QG_PK_K6_HDR : QG_PK_K6_SLICE;
    if (qg_k4like(qtype)) return hdr ? QG_PK_K4_HDR : qtype == QG_Q4_K ? QG_PK_K4_SLICE : QG_PK_K5_SLICE;
    return 0;
}
// Builds with the 512-bit kernel pair the groups in the copy (0 and 1, 2 and 3, ...; an odd
// last one with a group of zeros) and alternate their pieces, so the kernel reads a pair's
// bytes in order, one stream from memory (the groups one after the other, read as two
// streams 4.7 KB apart, made one row cost 1.9x as much as at 256 bits).
#ifdef QG_W512
#define QG_PAIR 2
#else
#define QG_PAIR 1
#endif

static inline uint16_t qg_rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float qg_half(uint16_t h) {
#ifdef QG_AVX2
    return _cvtsh_ss(h);
#else
    return fp16_to_f32(h);
#endif
}

// The fixed reduction of a row's 8 partial sums.
static inline float qg_tree8(const float *p) {
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// ---------------------------------------------------------------------------------------
// Quantized activations. One buffer: q (int8), then five arrays indexed by qg_act_f(m, b):
// d (scale), s (d * sum of the block's q), and Q6_K's offsets o0 and o1 (int32: -32 * the
// sum of its first and second 16 q, which start the integer dots of its 16-weight halves,
// so the weights' -32 costs no float step) and o16 (o0 / 32 and o1 / 32 as 16-bit halves:
// AVX2 builds without VNNI take both offsets in one madd, 1.02-1.06x on Q6_K's repacked
// rows where two 32-bit multiplies took them). Interleaved: [group][block][8 rows];
// row-major: [row][block].
// Row-major from QG_BLOCKED_MIN rows, the quantizer also writes each pass of QG_SMALL_MAX
// rows block by block (bq and its floats: [pass][block][row of the pass]), which the
// repacked kernel reads: one block of every row is then one run of bytes. Row-major alone,
// the rows lie K bytes apart, and where K is a multiple of 1024 (a 1024-4096 hidden size)
// every row's block falls in the same few L1 sets: from 16-32 rows they evict each other
// and the weights (block-major, the repacked kernel runs about 1.1x faster at 64-512 rows:
// docs/benchmarks.md, "Block-major activations"). Written by the quantizer, the copy costs
// no pass of its own (each thread used to copy every pass it read: 3% of a prompt's time).
typedef struct {
    int64_t M, K, nb, G;  // rows, columns, 32-blocks per row, 8-row groups
    int inter;            // interleaved layout
    int blocked;          // a pass's rows block by block (a view of bq): [block][row]
    int pass;             // one of a prompt's passes over the same weights (cached after the first)
    int8_t *q;
    float *d, *s;
    int32_t *o0, *o1;
    int32_t *o16;  // o0 / 32 and o1 / 32 as the halves of one word (written by QG_O16 builds)
    int8_t *bq;  // the block-major passes, or NULL
    float *bd, *bs;
    int32_t *bo0, *bo1, *bo16;
} qg_act;

static inline int64_t qg_act_pre_blocked(int64_t M) { return M >= QG_BLOCKED_MIN; }

static int64_t qg_act_bytes(int64_t M, int64_t K) {
    const int64_t nb = K / QG_QK, G = (M + 7) / 8;
    const int64_t blocked = qg_act_pre_blocked(M) ? M * K + 5 * M * nb * (int64_t)sizeof(float) + 64 : 0;
    return G * 8 * K + 5 * (G * 8 * nb + 8) * (int64_t)sizeof(float) + 64 + blocked;
}

static void qg_act_init(qg_act *a, void *buf, int64_t M, int64_t K, int64_t inter_min) {
    a->M = M;
    a->K = K;
    a->nb = K / QG_QK;
    a->G = (M + 7) / 8;
    a->inter = M >= inter_min;
    a->blocked = 0;
    a->pass = 0;
    uintptr_t p = ((uintptr_t)buf + 31) & ~(uintptr_t)31;
    a->q = (int8_t *)p;
    p += (uintptr_t)(a->G * 8 * K);
    const int64_t n = a->G * 8 * a->nb + 8;  // + 8: whole-vector reads past a row's end
    a->d = (float *)p;
    a->s = a->d + n;
    a->o0 = (int32_t *)(void *)(a->s + n);
    a->o1 = a->o0 + n;
    a->o16 = a->o1 + n;
    if (!a->inter)  // the row-major path reads whole vectors of 8 blocks: zeros past the end
        for (int i = 0; i < 8; ++i) {
            a->d[M * a->nb + i] = a->s[M * a->nb + i] = 0.f;
            a->o0[M * a->nb + i] = a->o1[M * a->nb + i] = a->o16[M * a->nb + i] = 0;
        }
    a->bq = NULL;
    a->bd = a->bs = NULL;
    a->bo0 = a->bo1 = a->bo16 = NULL;
    if (!a->inter && qg_act_pre_blocked(M)) {
        p = ((uintptr_t)(a->o16 + n) + 63) & ~(uintptr_t)63;
        a->bq = (int8_t *)p;
        a->bd = (float *)(p + (uintptr_t)(M * K));
        a->bs = a->bd + M * a->nb;
        a->bo0 = (int32_t *)(void *)(a->bs + M * a->nb);
        a->bo1 = a->bo0 + M * a->nb;
        a->bo16 = a->bo1 + M * a->nb;
    }
}

// where elements 4j..4j+3 of row m, block b start
static inline int8_t *qg_act_at(const qg_act *a, int64_t m, int64_t b, int j) {
    if (!a->inter) return a->q + m * a->K + b * QG_QK + 4 * j;
    return a->q + (((m / 8) * a->nb + b) * 8 + j) * 32 + (m % 8) * 4;
}

// The view v from its row m0 on (row-major or, blocked, a pass block by block): its bytes
// and per-block arrays advanced m0 rows (the caller sets M).
static inline void qg_act_skip(qg_act *v, int64_t m0) {
    const int64_t qm = v->blocked ? QG_QK : v->K, fm = v->blocked ? 1 : v->nb;
    v->q += m0 * qm;
    v->d += m0 * fm;
    v->s += m0 * fm;
    v->o0 += m0 * fm;
    v->o1 += m0 * fm;
    v->o16 += m0 * fm;
}

static inline int64_t qg_act_f(const qg_act *a, int64_t m, int64_t b) {
    return a->inter ? ((m / 8) * a->nb + b) * 8 + m % 8 : m * a->nb + b;
}

// Where row m's block b lies in its pass's block-major copy (bq, in blocks; [block][row of the
// pass]); mp (if not NULL): the pass's rows, from one block to the next.
static inline int64_t qg_bq_at(const qg_act *a, int64_t m, int64_t b, int64_t *mp) {
    const int64_t m0 = m / QG_SMALL_MAX * QG_SMALL_MAX;
    const int64_t rows = a->M - m0 < QG_SMALL_MAX ? a->M - m0 : QG_SMALL_MAX;
    if (mp) *mp = rows;
    return m0 * a->nb + b * rows + (m - m0);
}

// Quantize block b of row m from the 32 floats at xb; NULL (a padding row of the last
// group) stores zeros.
static void qg_quantize_block(const qg_act *a, const float *xb, int64_t m, int64_t b) {
    const int64_t f = qg_act_f(a, m, b);
    if (xb == NULL) {  // (interleaved layouts only: no block-major copy)
        for (int j = 0; j < 8; ++j) memset(qg_act_at(a, m, b, j), 0, 4);
        a->d[f] = a->s[f] = 0.f;
        a->o0[f] = a->o1[f] = a->o16[f] = 0;
        return;
    }
    int8_t q[QG_QK] __attribute__((aligned(32)));
    float amax = 0.f;
    int s0 = 0, s1 = 0;
#if defined(QG_W512)
    // 16 lanes: the same products and roundings as the 8-lane form below
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    const __m512 idv = _mm512_set1_ps(id);
    const __m512i w0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m512i w1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i qv = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(w0)), _mm512_cvtsepi32_epi8(w1), 1);
    s0 = _mm512_reduce_add_epi32(w0);
    s1 = _mm512_reduce_add_epi32(w1);
#elif defined(QG_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    amax = _mm_cvtss_f32(m4);
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i w[4];
    for (int i = 0; i < 4; ++i)
        w[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packed in registers: the packs interleave the 128-bit lanes, the permutation restores
    // element order
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
    const __m256i qv = _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // the halves' sums (exact in any order)
    for (int h = 0; h < 2; ++h) {
        const __m256i t = _mm256_add_epi32(w[2 * h], w[2 * h + 1]);
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1)));
        *(h ? &s1 : &s0) = _mm_cvtsi128_si32(u);
    }
#else
    for (int i = 0; i < QG_QK; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < QG_QK; ++i) q[i] = (int8_t)nearbyintf(xb[i] * id);
    for (int i = 0; i < 16; ++i) s0 += q[i];
    for (int i = 16; i < 32; ++i) s1 += q[i];
#endif
#ifdef QG_AVX2
    // one 32-byte store, which the 32-byte copies below read whole (a read spanning several
    // smaller stores would wait for them to retire)
    _mm256_store_si256((__m256i *)q, qv);
#endif
    const float d = amax / 127.f, ds = d * (float)(s0 + s1);
    const int32_t o0 = -32 * s0, o1 = -32 * s1;
    if (a->inter) {
        for (int j = 0; j < 8; ++j) memcpy(qg_act_at(a, m, b, j), q + 4 * j, 4);
    } else {
        memcpy(qg_act_at(a, m, b, 0), q, QG_QK);
    }
    a->d[f] = d;
    a->s[f] = ds;
    a->o0[f] = o0;
    a->o1[f] = o1;
#ifdef QG_O16  // o0 / 32 and o1 / 32 as one word's halves (|s| <= 16 x 127)
    const int32_t o16 = (int32_t)(((uint32_t)-s0 & 0xFFFFu) | ((uint32_t)-s1 << 16));
    a->o16[f] = o16;
#endif
    if (a->bq && m < a->M) {  // its pass's block-major copy
        const int64_t g = qg_bq_at(a, m, b, NULL);
        memcpy(a->bq + g * QG_QK, q, QG_QK);
        a->bd[g] = d;
        a->bs[g] = ds;
        a->bo0[g] = o0;
        a->bo1[g] = o1;
#ifdef QG_O16
        a->bo16[g] = o16;
#endif
    }
}

#if defined(QG_W512)
// 16 vectors' lanes each reduced to one lane by op: lane i of the result from v[i]. Each
// step pairs two vectors and halves the lanes it keeps of each (256-bit, then 128-bit
// halves, then pairs and single lanes within 128 bits), where one tree per vector takes
// four steps of its own.
#define QG_FOLD16(v, op)                                                                             \
    do {                                                                                             \
        for (int i = 0; i < 8; ++i)                                                                  \
            v[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),                            \
                      _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));                           \
        for (int i = 0; i < 4; ++i)                                                                  \
            v[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),                            \
                      _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));                           \
        for (int i = 0; i < 2; ++i)                                                                  \
            v[i] = op(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE)); \
        v[0] = op(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));          \
        /* lane 4q + r holds vector q + 4r */                                                        \
        v[0] = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v[0]); \
    } while (0)
#define QG_ADDI_PS(x, y) _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)))

// Blocks b..b+15 of row m (row-major layout) from the floats at x: qg_quantize_block's
// products, roundings and integer sums for each, with the 16 blocks' maxima and sums
// folded together (QG_FOLD16), one division for their 16 scales, and two blocks' bytes
// packed per vector: 1.6x as fast as block by block at 64 and 512 rows of 1024.
static void qg_quantize_16(const qg_act *a, const float *x, int64_t m, int64_t b) {
    __m512 mx[16], s0[16], s1[16];
    __m512i w[32];
    for (int i = 0; i < 16; ++i)  // |x| max of the two halves (range: max magnitude, sign cleared)
        mx[i] = _mm512_range_ps(_mm512_loadu_ps(x + 32 * i), _mm512_loadu_ps(x + 32 * i + 16), 0x0B);
    QG_FOLD16(mx, _mm512_max_ps);
    const __m512 amax = mx[0];
    const __mmask16 nz = _mm512_cmpneq_ps_mask(amax, _mm512_setzero_ps());
    float id[16] __attribute__((aligned(64)));
    _mm512_store_ps(id, _mm512_maskz_div_ps(nz, _mm512_set1_ps(127.f), amax));
    for (int i = 0; i < 16; ++i) {
        const __m512 idv = _mm512_set1_ps(id[i]);
        for (int h = 0; h < 2; ++h)
            w[2 * i + h] = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * i + 16 * h), idv),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        s0[i] = _mm512_castsi512_ps(w[2 * i]);
        s1[i] = _mm512_castsi512_ps(w[2 * i + 1]);
    }
    QG_FOLD16(s0, QG_ADDI_PS);
    QG_FOLD16(s1, QG_ADDI_PS);
    const __m512i si0 = _mm512_castps_si512(s0[0]), si1 = _mm512_castps_si512(s1[0]);
    const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
    const __m512 ds = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(si0, si1)));
    const __m512i o0 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(si0, 5));
    const __m512i o1 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(si1, 5));
    // two blocks' bytes in one vector: the packs leave each 128-bit lane's dwords as
    // (block i lo half, hi half, block i + 1 lo, hi) for elements 4q..4q+3
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const int64_t f = m * a->nb + b;
    int8_t *q = a->q + m * a->K + b * QG_QK;
    int64_t mp = 0;  // the block-major copy: block b's row at g, the next block's mp rows on
    const int64_t g = a->bq ? qg_bq_at(a, m, b, &mp) : 0;
    for (int i = 0; i < 16; i += 2) {
        const __m512i p = _mm512_permutexvar_epi32(
            order, _mm512_packs_epi16(_mm512_packs_epi32(w[2 * i], w[2 * i + 1]),
                                      _mm512_packs_epi32(w[2 * i + 2], w[2 * i + 3])));
        _mm512_storeu_si512((void *)(q + 32 * i), p);
        if (a->bq) {
            _mm256_storeu_si256((__m256i *)(void *)(a->bq + (g + i * mp) * QG_QK), _mm512_castsi512_si256(p));
            _mm256_storeu_si256((__m256i *)(void *)(a->bq + (g + (i + 1) * mp) * QG_QK), _mm512_extracti64x4_epi64(p, 1));
        }
    }
    _mm512_storeu_ps(a->d + f, d);
    _mm512_storeu_ps(a->s + f, ds);
    _mm512_storeu_si512((void *)(a->o0 + f), o0);
    _mm512_storeu_si512((void *)(a->o1 + f), o1);
    if (a->bq)
        for (int i = 0; i < 16; ++i) {
            a->bd[g + i * mp] = a->d[f + i];
            a->bs[g + i * mp] = a->s[f + i];
            a->bo0[g + i * mp] = a->o0[f + i];
            a->bo1[g + i * mp] = a->o1[f + i];
        }
}
#undef QG_FOLD16
#undef QG_ADDI_PS
#endif

// Quantize blocks [b0, b1) of row m from the floats at x (block b0's; NULL: a padding row
// of the last group, zeros).
static void qg_quantize_run(const qg_act *a, const float *x, int64_t m, int64_t b0, int64_t b1) {
    int64_t b = b0;
#if defined(QG_W512)
    if (x && !a->inter)
        for (; b + 16 <= b1; b += 16) qg_quantize_16(a, x + (b - b0) * QG_QK, m, b);
#endif
    for (; b < b1; ++b) qg_quantize_block(a, x ? x + (b - b0) * QG_QK : NULL, m, b);
}

// Quantize rows [m0, m1) of x (row stride ldx); rows past M in the last group are zeros.
static void qg_quantize_rows(const qg_act *a, const float *x, int64_t ldx, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) qg_quantize_run(a, m < a->M ? x + m * ldx : NULL, m, 0, a->nb);
}

// ---------------------------------------------------------------------------------------
// One 32-weight slice of a weight row, decoded for the dot product: u[32] the weights as
// unsigned bytes (Q8_0: their magnitudes, sgn the signed bytes), the float factor of the
// integer dot (ws), and the term on the activation sum, coef * s. Q6_K's two 16-weight
// scales multiply the integer dot's halves (sc16), each started at the activation's offset
// (o0, o1: the -32 of its weights, in integers).
typedef struct {
    uint8_t u[32] __attribute__((aligned(32)));
    int8_t sgn[32] __attribute__((aligned(32)));
    float ws, coef;
    int16_t sc16[2];
} qg_wblk;

// Q4_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4)
static inline void qg_k4_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Decode slice b (of 32 weights) of a row: its scalars into w, its weights into w->u
// (and w->sgn) through `vec` (AVX2: the vectors stay in registers for the row layout, and
// one 32-byte store feeds the interleaved layout's 4-byte loads). K-quants read their
// super-block's header each time (a few scalar operations against the 32 x M products).
static inline __attribute__((always_inline)) void qg_scalars(int qtype, const uint8_t *row, int64_t b,
                                                            qg_wblk *w) {
    w->coef = 0.f;
    w->sc16[0] = w->sc16[1] = 0;
    if (qg_off32(qtype) || qg_min32(qtype)) {
        const uint8_t *blk = row + b * qg_block_bytes(qtype);
        const float d = qg_half(qg_rd16(blk));
        w->ws = d;
        w->coef = qg_off32(qtype) ? (float)-qg_off32(qtype) * d : qg_half(qg_rd16(blk + 2));
    } else if (qtype == QG_Q8_0) {
        w->ws = qg_half(qg_rd16(row + b * 34));
    } else if (qg_k4like(qtype)) {
        const uint8_t *blk = row + (b / 8) * qg_block_bytes(qtype);
        uint8_t sc, mn;
        qg_k4_scale_min((int)(b % 8), blk + 4, &sc, &mn);
        w->ws = qg_half(qg_rd16(blk)) * (float)sc;
        w->coef = -(qg_half(qg_rd16(blk + 2)) * (float)mn);
    } else {  // Q6_K
        const uint8_t *blk = row + (b / 8) * 210;
        const int j = (int)(b % 8);
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d = qg_half(qg_rd16(blk + 208));
        w->ws = d;
        w->sc16[0] = scales[2 * j];
        w->sc16[1] = scales[2 * j + 1];
    }
}

#ifdef QG_AVX2
// The 32 weights as unsigned bytes in element order (Q8_0: their magnitudes; *sgn the
// signed bytes).
// Byte i of the result: 0x10 where bit i of the 32 bits at p is set (a fifth bit in place).
static inline __m256i qg_bits16(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i by = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v),  // byte i <- byte i / 8
                                           _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                              0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(by, bit), bit), _mm256_set1_epi8(0x10));
}

// Bit g of each byte moved to bit 4 (0x10 or 0): fifth bits stored one per bit.
static inline __m256i qg_bit_to4(__m256i v, int g) {
    const __m256i t = g <= 4 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(4 - g)) : _mm256_srl_epi16(v, _mm_cvtsi32_si128(g - 4));
    return _mm256_and_si256(t, _mm256_set1_epi8(0x10));
}

static inline __attribute__((always_inline)) __m256i qg_wvec(int qtype, const uint8_t *row, int64_t b,
                                                             __m256i *sgn) {
    if (qtype == QG_Q5_0 || qtype == QG_Q5_1) {  // d, (m,) 32 fifth bits, then Q4's nibbles
        const int hb = qtype == QG_Q5_0 ? 2 : 4;
        const uint8_t *blk = row + b * qg_block_bytes(qtype);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + hb + 4));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        return _mm256_or_si256(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), qg_bits16(blk + hb));
    }
    if (qtype == QG_Q5_K) {  // slice j: Q4_K's nibbles, fifth bits at bit j of the 32 qh bytes
        const int j = (int)(b % 8);
        const uint8_t *blk = row + (b / 8) * 176;
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 48 + (j / 2) * 32));
        const __m256i v = (j & 1) ? _mm256_srli_epi16(raw, 4) : raw;
        return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi8(0x0F)),
                               qg_bit_to4(_mm256_loadu_si256((const __m256i *)(blk + 16)), j));
    }
    if (qtype == QG_Q4_0 || qtype == QG_Q4_1) {
        const uint8_t *qs = row + b * (qtype == QG_Q4_0 ? 18 : 20) + (qtype == QG_Q4_0 ? 2 : 4);
        const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
    }
    if (qtype == QG_Q8_0) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + b * 34 + 2));
        *sgn = v;
        return _mm256_abs_epi8(v);
    }
    if (qtype == QG_Q4_K) {
        const int j = (int)(b % 8);
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + (b / 8) * 144 + 16 + (j / 2) * 32));
        const __m256i v = (j & 1) ? _mm256_srli_epi16(raw, 4) : raw;
        return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    }
    const uint8_t *blk = row + (b / 8) * 210;
    const int j = (int)(b % 8), h = j / 4, a = j % 4;
    __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (a % 2)));
    if (a >= 2) lo = _mm256_srli_epi16(lo, 4);
    __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    switch (a) {  // immediate shifts: bits 2a..2a+1 of qh to bits 4..5
    case 0: hi = _mm256_slli_epi16(hi, 4); break;
    case 1: hi = _mm256_slli_epi16(hi, 2); break;
    case 2: break;
    default: hi = _mm256_srli_epi16(hi, 2); break;
    }
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0x0F)),
                           _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}
#endif

static inline __attribute__((always_inline)) void qg_decode(int qtype, const uint8_t *row, int64_t b,
                                                           qg_wblk *w) {
    qg_scalars(qtype, row, b, w);
#ifdef QG_AVX2
    __m256i sgn = _mm256_setzero_si256();
    const __m256i u = qg_wvec(qtype, row, b, &sgn);
    _mm256_store_si256((__m256i *)w->u, u);
    if (qtype == QG_Q8_0) _mm256_store_si256((__m256i *)w->sgn, sgn);
#else
    if (qtype == QG_Q4_0 || qtype == QG_Q4_1) {
        const uint8_t *qs = row + b * (qtype == QG_Q4_0 ? 18 : 20) + (qtype == QG_Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; ++i) {
            w->u[i] = qs[i] & 0x0F;
            w->u[i + 16] = qs[i] >> 4;
        }
    } else if (qtype == QG_Q8_0) {
        const uint8_t *qs = row + b * 34 + 2;
        for (int i = 0; i < 32; ++i) {
            const int8_t s = (int8_t)qs[i];
            w->sgn[i] = s;
            w->u[i] = (uint8_t)(s < 0 ? -s : s);
        }
    } else if (qtype == QG_Q4_K) {
        const int j = (int)(b % 8);
        const uint8_t *qs = row + (b / 8) * 144 + 16 + (j / 2) * 32;
        for (int i = 0; i < 32; ++i) w->u[i] = (qs[i] >> ((j % 2) * 4)) & 0x0F;
    } else if (qtype == QG_Q5_0 || qtype == QG_Q5_1) {
        const int hb = qtype == QG_Q5_0 ? 2 : 4;
        const uint8_t *blk = row + b * qg_block_bytes(qtype), *qs = blk + hb + 4;
        uint32_t qh;
        memcpy(&qh, blk + hb, 4);
        for (int i = 0; i < 16; ++i) {
            w->u[i] = (uint8_t)((qs[i] & 0x0F) | (((qh >> i) & 1) << 4));
            w->u[i + 16] = (uint8_t)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
        }
    } else if (qtype == QG_Q5_K) {
        const int j = (int)(b % 8);
        const uint8_t *blk = row + (b / 8) * 176, *qs = blk + 48 + (j / 2) * 32;
        for (int i = 0; i < 32; ++i)
            w->u[i] = (uint8_t)(((qs[i] >> ((j % 2) * 4)) & 0x0F) | (((blk[16 + i] >> j) & 1) << 4));
    } else {
        const uint8_t *blk = row + (b / 8) * 210;
        const int j = (int)(b % 8), h = j / 4, a = j % 4;
        const uint8_t *ql = blk + 64 * h + 32 * (a % 2), *qh = blk + 128 + 32 * h;
        for (int i = 0; i < 32; ++i)
            w->u[i] = (uint8_t)(((ql[i] >> ((a / 2) * 4)) & 0x0F) | (((qh[i] >> (2 * a)) & 3) << 4));
    }
#endif
}

// ---------------------------------------------------------------------------------------
// Scalar reference (also the fallback without AVX2). o0, o1: the block's Q6_K offsets.
static inline int32_t qg_idot(int qtype, const qg_wblk *w, const int8_t *xq /* 32 in order */,
                              int32_t o0, int32_t o1) {
    if (qtype == QG_Q6_K) {  // sc0 * sum (q - 32) x over the first 16, + sc1 * the second's
        int32_t h0 = o0, h1 = o1;
        for (int i = 0; i < 16; ++i) h0 += (int32_t)w->u[i] * xq[i];
        for (int i = 16; i < 32; ++i) h1 += (int32_t)w->u[i] * xq[i];
        return h0 * w->sc16[0] + h1 * w->sc16[1];
    }
    int32_t acc = 0;
    if (qtype == QG_Q8_0)
        for (int i = 0; i < 32; ++i) acc += (int32_t)w->sgn[i] * xq[i];
    else
        for (int i = 0; i < 32; ++i) acc += (int32_t)w->u[i] * xq[i];
    return acc;
}

// v_b of one row
static inline float qg_bval(int qtype, const qg_wblk *w, int32_t idot, const qg_act *a, int64_t f) {
    float v = (float)idot * (w->ws * a->d[f]);
    if (qg_sum_term(qtype)) v = fmaf(w->coef, a->s[f], v);
    return v;
}

static void qg_rows_scalar(int qtype, const uint8_t *w, int64_t n0, int64_t n1, int64_t row_bytes,
                           const qg_act *a, float *out, int64_t ldo) {
    qg_wblk wb = {0};
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m = 0; m < a->M; ++m) {
            float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int64_t b = 0; b < a->nb; ++b) {
                qg_decode(qtype, row, b, &wb);
                int8_t xq[32];
                for (int j = 0; j < 8; ++j) memcpy(xq + 4 * j, qg_act_at(a, m, b, j), 4);
                const int64_t f = qg_act_f(a, m, b);
                p[b % 8] += qg_bval(qtype, &wb, qg_idot(qtype, &wb, xq, a->o0[f], a->o1[f]), a, f);
            }
            out[m * ldo + n] = qg_tree8(p);
        }
    }
}

#ifdef QG_AVX2
// ---------------------------------------------------------------------------------------
// Integer dot helpers. AVX2 accumulates maddubs pairs in 16 bits (the caller keeps within
// the bound: 8 products of 4-bit weights, 2 of Q6_K's 6-bit ones, 1 of 8-bit magnitudes)
// and widens with madd; VNNI accumulates in 32 bits directly.
#ifdef QG_VNNI
#define QG_ACC_ADD(acc, u, s) QG_DPBUSD((acc), (u), (s))
#define QG_ACC_I32(acc) (acc)
#define QG_ACC_I32_SC(acc, sc) _mm256_mullo_epi32((acc), _mm256_set1_epi32(sc))
#else
#define QG_ACC_ADD(acc, u, s) _mm256_add_epi16((acc), _mm256_maddubs_epi16((u), (s)))
#define QG_ACC_I32(acc) _mm256_madd_epi16((acc), _mm256_set1_epi16(1))
#define QG_ACC_I32_SC(acc, sc) _mm256_madd_epi16((acc), _mm256_set1_epi16(sc))
#endif

static inline __m256i qg_bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// Interleaved layout: the integer dots of one block with the 8 rows of a group (lanes);
// o0, o1: the rows' Q6_K offsets.
static inline __attribute__((always_inline)) __m256i qg_idot8(int qtype, const qg_wblk *w,
                                                              const int8_t *xg /* 256 bytes */,
                                                              const int32_t *o0, const int32_t *o1) {
    if (qtype == QG_Q6_K) {
        __m256i h[2];
        for (int half = 0; half < 2; ++half) {
            const __m256i o = _mm256_loadu_si256((const __m256i *)(half ? o1 : o0));
#ifdef QG_VNNI  // the offsets start the half's 32-bit sum
            __m256i p = o, r = _mm256_setzero_si256();
#else
            __m256i p = _mm256_setzero_si256(), r = _mm256_setzero_si256();
#endif
            for (int t = 0; t < 4; ++t) {
                const int j = 4 * half + t;
                const __m256i x = _mm256_load_si256((const __m256i *)(xg + 32 * j));
                if (t < 2) p = QG_ACC_ADD(p, qg_bcast4(w->u + 4 * j), x);
                else r = QG_ACC_ADD(r, qg_bcast4(w->u + 4 * j), x);
            }
            h[half] = _mm256_add_epi32(QG_ACC_I32_SC(p, w->sc16[half]), QG_ACC_I32_SC(r, w->sc16[half]));
#ifndef QG_VNNI  // (16-bit sums: the offsets scaled on their own)
            h[half] = _mm256_add_epi32(h[half], _mm256_mullo_epi32(o, _mm256_set1_epi32(w->sc16[half])));
#endif
        }
        return _mm256_add_epi32(h[0], h[1]);
    }
    if (qtype == QG_Q8_0) {
        __m256i acc = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            const __m256i x = _mm256_load_si256((const __m256i *)(xg + 32 * j));
            const __m256i sx = _mm256_sign_epi8(x, qg_bcast4(w->sgn + 4 * j));
#ifdef QG_VNNI
            acc = QG_DPBUSD(acc, qg_bcast4(w->u + 4 * j), sx);
#else
            acc = _mm256_add_epi32(acc, QG_ACC_I32(_mm256_maddubs_epi16(qg_bcast4(w->u + 4 * j), sx)));
#endif
        }
        return acc;
    }
    if (qg_five(qtype)) {  // 4 pairs of 5-bit products fill 16 bits: two halves
        __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            h0 = QG_ACC_ADD(h0, qg_bcast4(w->u + 4 * j), _mm256_load_si256((const __m256i *)(xg + 32 * j)));
            h1 = QG_ACC_ADD(h1, qg_bcast4(w->u + 16 + 4 * j), _mm256_load_si256((const __m256i *)(xg + 128 + 32 * j)));
        }
        return _mm256_add_epi32(QG_ACC_I32(h0), QG_ACC_I32(h1));
    }
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j)
        acc = QG_ACC_ADD(acc, qg_bcast4(w->u + 4 * j), _mm256_load_si256((const __m256i *)(xg + 32 * j)));
    return QG_ACC_I32(acc);
}

// v_b of 8 lanes: idot (lanes), the weight scalars ws and coef, the activation scalars at
// d/s + f (lanes)
static inline __attribute__((always_inline)) __m256 qg_bval8(int qtype, __m256i idot, __m256 ws,
                                                             __m256 coef, const qg_act *a, int64_t f) {
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(idot), _mm256_mul_ps(ws, _mm256_loadu_ps(a->d + f)));
    if (qg_sum_term(qtype)) v = _mm256_fmadd_ps(coef, _mm256_loadu_ps(a->s + f), v);
    return v;
}

// Up to QG_GT groups of 8 rows against one weight row, one pass over its blocks; each
// group keeps its 8 partial sums (by block mod 8) in `part`.
enum { QG_GT = 4, QG_CHUNK = 8 };

static inline __attribute__((always_inline)) void qg_row_inter(int qtype, const uint8_t *row,
                                                               const qg_act *a, int64_t g0, int NG,
                                                               float *out, int64_t ldo, int64_t n) {
    __m256 part[QG_GT][8];
    for (int g = 0; g < NG; ++g)
        for (int j = 0; j < 8; ++j) part[g][j] = _mm256_setzero_ps();
    qg_wblk wb;
    for (int64_t b = 0; b < a->nb; ++b) {
        qg_decode(qtype, row, b, &wb);
        const __m256 ws = _mm256_set1_ps(wb.ws), coef = _mm256_set1_ps(wb.coef);
        for (int g = 0; g < NG; ++g) {
            const int64_t f = ((g0 + g) * a->nb + b) * 8;
            const __m256i idot = qg_idot8(qtype, &wb, a->q + f * 32, a->o0 + f, a->o1 + f);
            const __m256 v = qg_bval8(qtype, idot, ws, coef, a, f);
            part[g][b % 8] = _mm256_add_ps(part[g][b % 8], v);
        }
    }
    for (int g = 0; g < NG; ++g) {
        const __m256 *p = part[g];
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3])),
                                         _mm256_add_ps(_mm256_add_ps(p[4], p[5]), _mm256_add_ps(p[6], p[7])));
        float r[8] __attribute__((aligned(32)));
        _mm256_store_ps(r, sum);
        const int64_t m0 = (g0 + g) * 8;
        const int rows = (int)(a->M - m0 < 8 ? a->M - m0 : 8);
        for (int i = 0; i < rows; ++i) out[(m0 + i) * ldo + n] = r[i];
    }
}

// Q6_K's two 16-weight scales as the multiplier of the row layout's partial sums.
static inline __m256i qg_q6_scales(const int16_t sc16[2]) {
#ifdef QG_VNNI  // 32-bit lanes 0-3 hold weights 0-15, lanes 4-7 weights 16-31
    return _mm256_set_m128i(_mm_set1_epi32(sc16[1]), _mm_set1_epi32(sc16[0]));
#else  // 16-bit lanes 0-7 hold weights 0-15
    return _mm256_set_m128i(_mm_set1_epi16(sc16[1]), _mm_set1_epi16(sc16[0]));
#endif
}

// Row-major layout: the integer dot of one block with one row as 8 partial sums (lanes);
// scv: qg_q6_scales of the block (Q6_K).
static inline __attribute__((always_inline)) __m256i qg_idot_row(int qtype, __m256i scv, __m256i u,
                                                                 __m256i sgn,
                                                                 const int8_t *x /* 32 in order */) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    if (qtype == QG_Q8_0) {
        const __m256i sx = _mm256_sign_epi8(xv, sgn);
#ifdef QG_VNNI
        return QG_DPBUSD(_mm256_setzero_si256(), u, sx);
#else
        return QG_ACC_I32(_mm256_maddubs_epi16(u, sx));
#endif
    }
#ifdef QG_VNNI
    const __m256i p = QG_DPBUSD(_mm256_setzero_si256(), u, xv);
    return qtype == QG_Q6_K ? _mm256_mullo_epi32(p, scv) : p;
#else
    const __m256i p = _mm256_maddubs_epi16(u, xv);
    return qtype == QG_Q6_K ? _mm256_madd_epi16(p, scv) : QG_ACC_I32(p);
#endif
}

// 8 vectors of 8 partial sums -> one vector of their 8 totals (lane j: vector j).
static inline __m256i qg_reduce8(const __m256i v[8]) {
    const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

#ifndef QG_VNNI
// 4-bit weights (Q4_0, Q4_1, Q4_K) without VNNI: the 8 blocks' raw maddubs outputs (16 int16
// lanes each) -> one vector of their 8 int32 totals (lane j: block j). Three rounds of 16-bit
// hadds sum each 128-bit half's 8 lanes (|sum| <= 8 x 2 x 15 x 127 < 2^15, exact), so the
// multiply port does one maddubs per block and row instead of maddubs + madd.
static inline __m256i qg_reduce8_16(const __m256i v[8]) {
    const __m256i t0 = _mm256_hadd_epi16(v[0], v[1]), t1 = _mm256_hadd_epi16(v[2], v[3]);
    const __m256i t2 = _mm256_hadd_epi16(v[4], v[5]), t3 = _mm256_hadd_epi16(v[6], v[7]);
    const __m256i w = _mm256_hadd_epi16(_mm256_hadd_epi16(t0, t1), _mm256_hadd_epi16(t2, t3));
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(w, 1)));
}
#endif

// A chunk's scalars, one lane per 32-weight slice: v = idot * ws * d_x + coef * s_x; Q6_K's
// halves' scales (sc0, sc1) multiply the activation's offsets added to idot. Built in
// registers from the blocks' headers, not through float arrays read back as vectors.
typedef struct {
    __m256 ws, coef;
    __m256i sc0, sc1;
} qg_scal8;

// 8 f16 words as floats.
static inline __attribute__((always_inline)) __m256 qg_cvt8(const uint16_t h[8]) {
    return _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3],
                                          (short)h[4], (short)h[5], (short)h[6], (short)h[7]));
}

// The f16 words at p, p + bs, ..., p + 7 bs as floats.
static inline __attribute__((always_inline)) __m256 qg_half8(const uint8_t *p, int64_t bs) {
    uint16_t h[8];
    for (int j = 0; j < 8; ++j) h[j] = qg_rd16(p + j * bs);
    return qg_cvt8(h);
}

// A K-quant super-block's 8 slices of 32 weights and their scalars.
static inline __attribute__((always_inline)) void qg_super(int qtype, const uint8_t *blk, __m256i u[8],
                                                           qg_scal8 *sv, int16_t sc16[8][2]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (qg_k4like(qtype)) {
        const float d = qg_half(qg_rd16(blk)), dmin = qg_half(qg_rd16(blk + 2));
        // the 6-bit scales and mins of the 8 slices (qg_k4_scale_min), 4 bytes at a time
        uint32_t A, B, C;
        memcpy(&A, blk + 4, 4);
        memcpy(&B, blk + 8, 4);
        memcpy(&C, blk + 12, 4);
        const uint32_t sc_lo = A & 0x3F3F3F3Fu, mn_lo = B & 0x3F3F3F3Fu;
        const uint32_t sc_hi = (C & 0x0F0F0F0Fu) | (((A >> 6) & 0x03030303u) << 4);
        const uint32_t mn_hi = ((C >> 4) & 0x0F0F0F0Fu) | (((B >> 6) & 0x03030303u) << 4);
        const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)sc_lo, (int)sc_hi, 0, 0)));
        const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)mn_lo, (int)mn_hi, 0, 0)));
        sv->ws = _mm256_mul_ps(_mm256_set1_ps(d), scf);
        sv->coef = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), mnf), _mm256_set1_ps(-0.f));
        sv->sc0 = sv->sc1 = _mm256_setzero_si256();
        const int64_t qs = qtype == QG_Q5_K ? 48 : 16;
        for (int c = 0; c < 4; ++c) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + qs + 32 * c));
            u[2 * c] = _mm256_and_si256(raw, m4);
            u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        }
        if (qtype == QG_Q5_K) {  // slice j's fifth bits: bit j of the 32 qh bytes
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            for (int j = 0; j < 8; ++j) u[j] = _mm256_or_si256(u[j], qg_bit_to4(qh, j));
        }
        return;
    }
    const int8_t *scales = (const int8_t *)(blk + 192);
    const float d = qg_half(qg_rd16(blk + 208));
    for (int j = 0; j < 8; ++j) {
        sc16[j][0] = scales[2 * j];
        sc16[j][1] = scales[2 * j + 1];
    }
    // even scales (first 16 weights of each slice) to bytes 0-7, odd ones to 8-15
    const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)scales),
                                        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    sv->ws = _mm256_set1_ps(d);
    sv->coef = _mm256_setzero_ps();
    sv->sc0 = _mm256_cvtepi8_epi32(sc);
    sv->sc1 = _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8));
    const __m256i m2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2));
        u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2));
        u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m2));
        u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2));
    }
}

// The integer totals of 8 blocks (lane j: u[j] against the 32 activations at xp[j]).
static inline __attribute__((always_inline)) __m256i qg_tot8(int qtype, const __m256i u[8], const __m256i sg[8],
                                                            const __m256i scv[8], const int8_t *const xp[8]) {
    __m256i id[8];
#ifndef QG_VNNI
    if (qtype == QG_Q4_0 || qtype == QG_Q4_1 || qtype == QG_Q4_K) {
        for (int j = 0; j < 8; ++j) id[j] = _mm256_maddubs_epi16(u[j], _mm256_loadu_si256((const __m256i *)xp[j]));
        return qg_reduce8_16(id);
    }
#endif
    for (int j = 0; j < 8; ++j) id[j] = qg_idot_row(qtype, scv[j], u[j], sg[j], xp[j]);
    return qg_reduce8(id);
}

// Blocks [b0, b0 + 8) of one weight row against MR rows: the lanes of each row's vector of
// block values are blocks b0 + j, added into its partial sums P_j. (A row's last nb % 8
// blocks go through qg_tail_chunk.)
static inline __attribute__((always_inline)) void qg_small_chunk(int qtype, const uint8_t *row,
                                                                 const qg_act *a, int MR,
                                                                 int64_t b0, __m256 *part) {
    __m256i u[8], sg[8];
    int16_t sc16[8][2] = {{0}};
    qg_scal8 sv;
    if (qg_k4like(qtype) || qtype == QG_Q6_K) {  // a whole super-block: its header once
        qg_super(qtype, row + (b0 / 8) * qg_block_bytes(qtype), u, &sv, sc16);
        for (int j = 0; j < 8; ++j) sg[j] = _mm256_setzero_si256();
    } else {  // Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
        const int64_t bs = qg_block_bytes(qtype);
        sv.ws = qg_half8(row + b0 * bs, bs);
        sv.coef = qg_min32(qtype)   ? qg_half8(row + b0 * bs + 2, bs)
                  : qg_off32(qtype) ? _mm256_mul_ps(_mm256_set1_ps((float)-qg_off32(qtype)), sv.ws)
                                    : _mm256_setzero_ps();
        sv.sc0 = sv.sc1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            sg[j] = _mm256_setzero_si256();
            u[j] = qg_wvec(qtype, row, b0 + j, &sg[j]);
        }
    }
    const __m256 wsv = sv.ws, coefv = sv.coef;
    __m256i scv[8];
    for (int j = 0; j < 8; ++j) scv[j] = qtype == QG_Q6_K ? qg_q6_scales(sc16[j]) : _mm256_setzero_si256();
    for (int m = 0; m < MR; ++m) {
        const int64_t f = m * a->nb + b0;
        const int8_t *xm = a->q + m * a->K + b0 * QG_QK, *xp[8];
        for (int j = 0; j < 8; ++j) xp[j] = xm + j * QG_QK;
        __m256i tot = qg_tot8(qtype, u, sg, scv, xp);
        if (qtype == QG_Q6_K) {  // + sc0 * o0 + sc1 * o1 of each block (exact in int32)
            const __m256i o0 = _mm256_loadu_si256((const __m256i *)(a->o0 + f));
            const __m256i o1 = _mm256_loadu_si256((const __m256i *)(a->o1 + f));
            tot = _mm256_add_epi32(tot, _mm256_add_epi32(_mm256_mullo_epi32(o0, sv.sc0), _mm256_mullo_epi32(o1, sv.sc1)));
        }
        part[m] = _mm256_add_ps(part[m], qg_bval8(qtype, tot, wsv, coefv, a, f));
    }
}

// The last t (= nb % 8) blocks of r <= 8 / t consecutive weight rows in one chunk: lane
// k t + i holds block nb - t + i of row n + k (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; K-quant rows are whole
// super-blocks). Each lane computes what the row's own tail chunk would, and row k's lanes
// move to lanes 0..t-1 of its partial sums (the others add +0, as past a row's end), so
// the sums are the same bits; a tail no longer costs a whole chunk per row (K = 576: 2 of
// 18 blocks in a third chunk).
typedef struct {
    int t, bi[8];      // blocks per tail; lane -> block within the tail
    __m256i gather;    // bi as a vector: the lanes' activation scalars
    __m256i to[8];     // row k's lanes to lanes 0..t-1
    __m256 mask;       // lanes 0..t-1
} qg_tailplan;

// Once per call, not per chunk: the lane maps as vectors.
static void qg_tailplan_init(qg_tailplan *p, int t) {
    int keep[8], ix[8];
    p->t = t;
    for (int L = 0; L < 8; ++L) {
        p->bi[L] = L / t < 8 / t ? L % t : 0;
        keep[L] = L < t ? -1 : 0;
    }
    p->gather = _mm256_loadu_si256((const __m256i *)p->bi);
    p->mask = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)keep));
    for (int k = 0; k < 8 / t; ++k) {
        for (int j = 0; j < 8; ++j) ix[j] = j < t ? k * t + j : 0;
        p->to[k] = _mm256_loadu_si256((const __m256i *)ix);
    }
}

static inline __attribute__((always_inline)) void qg_tail_chunk(int qtype, const uint8_t *w, int64_t n,
                                                                int r, const qg_tailplan *pl,
                                                                int64_t row_bytes, const qg_act *a, int MR,
                                                                __m256 part[][QG_SMALL_MAX]) {
    const int t = pl->t;
    const int64_t bt = a->nb - t, bs = qg_block_bytes(qtype);
    __m256i u[8], sg[8], scv[8];
    uint16_t hd[8], hm[8];
    for (int L = 0; L < 8; ++L) {
        sg[L] = scv[L] = _mm256_setzero_si256();
        const int k = L / t, i = L % t;
        if (k >= r) {
            u[L] = _mm256_setzero_si256();
            hd[L] = hm[L] = 0;
            continue;
        }
        const uint8_t *row = w + (n + k) * row_bytes;
        hd[L] = qg_rd16(row + (bt + i) * bs);
        hm[L] = qg_min32(qtype) ? qg_rd16(row + (bt + i) * bs + 2) : 0;
        u[L] = qg_wvec(qtype, row, bt + i, &sg[L]);
    }
    const __m256 ws = qg_cvt8(hd);
    const __m256 coef = qg_min32(qtype)   ? qg_cvt8(hm)
                        : qg_off32(qtype) ? _mm256_mul_ps(_mm256_set1_ps((float)-qg_off32(qtype)), ws)
                                          : _mm256_setzero_ps();
    const __m256i gather = pl->gather;
    const __m256 mask = pl->mask;
    for (int m = 0; m < MR; ++m) {
        const int8_t *xm = a->q + m * a->K + bt * QG_QK, *xp[8];
        for (int L = 0; L < 8; ++L) xp[L] = xm + pl->bi[L] * QG_QK;
        const int64_t f = m * a->nb + bt;  // + 8 floats of room past the last row
        const __m256 d = _mm256_permutevar8x32_ps(_mm256_loadu_ps(a->d + f), gather);
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(qg_tot8(qtype, u, sg, scv, xp)), _mm256_mul_ps(ws, d));
        if (qg_sum_term(qtype))  // as qg_bval8
            v = _mm256_fmadd_ps(coef, _mm256_permutevar8x32_ps(_mm256_loadu_ps(a->s + f), gather), v);
        for (int k = 0; k < r; ++k)
            part[k][m] = _mm256_add_ps(part[k][m], _mm256_and_ps(_mm256_permutevar8x32_ps(v, pl->to[k]), mask));
    }
}

// Weight rows n .. n + r - 1 against MR rows, their tails of t blocks in one chunk.
static inline __attribute__((always_inline)) void qg_rows_small_tail(int qtype, const uint8_t *w, int64_t n,
                                                                     int r, const qg_tailplan *pl,
                                                                     int64_t row_bytes,
                                                                     const qg_act *a, float *out,
                                                                     int64_t ldo, int MR) {
    __m256 part[8][QG_SMALL_MAX];
    for (int k = 0; k < r; ++k) {
        for (int m = 0; m < MR; ++m) part[k][m] = _mm256_setzero_ps();
        for (int64_t b0 = 0; b0 + 8 <= a->nb; b0 += 8)
            qg_small_chunk(qtype, w + (n + k) * row_bytes, a, MR, b0, part[k]);
    }
    qg_tail_chunk(qtype, w, n, r, pl, row_bytes, a, MR, part);
    for (int k = 0; k < r; ++k)
        for (int m = 0; m < MR; ++m) {
            float p[8] __attribute__((aligned(32)));
            _mm256_store_ps(p, part[k][m]);
            out[m * ldo + n + k] = qg_tree8(p);
        }
}

static inline __attribute__((always_inline)) void qg_row_small(int qtype, const uint8_t *row,
                                                               const qg_act *a, float *out,
                                                               int64_t ldo, int64_t n, int MR) {
    __m256 part[QG_SMALL_MAX];
    for (int m = 0; m < MR; ++m) part[m] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < a->nb; b0 += 8) qg_small_chunk(qtype, row, a, MR, b0, part);  // nb % 8 == 0
    for (int m = 0; m < MR; ++m) {
        float p[8] __attribute__((aligned(32)));
        _mm256_store_ps(p, part[m]);
        out[m * ldo + n] = qg_tree8(p);
    }
}

// The repacked kernel (qgemm_packed.h) at 8 lanes: one group of 8 weight rows per vector.
#define QV_CAT_(a, b) a##_##b
#define QV_CAT(a, b) QV_CAT_(a, b)
#define QV_NAME(x) QV_CAT(x, QV_W)
#define QV_W 8
#define QV_I __m256i
#define QV_F __m256
#define QV_ZERO _mm256_setzero_si256
#define QV_ZEROF _mm256_setzero_ps
#define QV_B8 _mm256_set1_epi8
#define QV_B32 _mm256_set1_epi32
#define QV_BF _mm256_set1_ps
#define QV_AND _mm256_and_si256
#define QV_OR _mm256_or_si256
#define QV_SRLI16 _mm256_srli_epi16
#define QV_SLLI16 _mm256_slli_epi16
#define QV_SLLI32 _mm256_slli_epi32
#define QV_ABS8 _mm256_abs_epi8
#define QV_ADD16 _mm256_add_epi16
#define QV_ADD32 _mm256_add_epi32
#define QV_MULLO32 _mm256_mullo_epi32
#define QV_MADDUBS _mm256_maddubs_epi16
#define QV_MADD _mm256_madd_epi16
#define QV_DPBUSD QG_DPBUSD
#define QV_ACC_ADD QG_ACC_ADD
#define QV_ACC_I32 QG_ACC_I32
#define QV_SG const uint8_t *  // Q8_0's signs: the weights' bytes, read again per row
#define QV_SG_OF(v, p) (p)
#define QV_SIGN8(x, sg) _mm256_sign_epi8((x), _mm256_loadu_si256((const __m256i *)(sg)))
#define QV_BIT_TO4 qg_bit_to4
#define QV_BCAST4 qg_bcast4
#define QV_LOADW(p, gs) _mm256_loadu_si256((const __m256i *)(p))
#define QV_PH(p, gs) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define QV_U8(p, gs) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define QV_I8(p, gs) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define QV_CVTF _mm256_cvtepi32_ps
#define QV_MULF _mm256_mul_ps
#define QV_FMA _mm256_fmadd_ps
#define QV_ADDF _mm256_add_ps
#define QV_XORF _mm256_xor_ps
#define QV_STOREF _mm256_storeu_ps
#include "qgemm_packed.h"

#ifdef QG_W512
// At 16 lanes (AVX512-VNNI builds): lanes 0-7 are a group's 8 weight rows, lanes 8-15 its
// pair's, whose piece follows the first's (gs: a piece's bytes); every load reads both.
static inline __m512i qg_bcast4_512(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline __m512i qg_loadw_512(const uint8_t *p, int64_t gs) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + gs)), 1);
}
static inline __m128i qg_8bytes2(const uint8_t *p, int64_t gs) {  // 8 bytes of each group
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)(p + gs)));
}
static inline __m512 qg_ph_512(const uint8_t *p, int64_t gs) {  // 8 f16 of each group
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + gs)),
                                            _mm_loadu_si128((const __m128i *)p)));
}
static inline __m512i qg_bit_to4_512(__m512i v, int g) {
    const __m512i t = g <= 4 ? _mm512_sll_epi16(v, _mm_cvtsi32_si128(4 - g)) : _mm512_srl_epi16(v, _mm_cvtsi32_si128(g - 4));
    return _mm512_and_si512(t, _mm512_set1_epi8(0x10));
}
#define QV_W 16
#define QV_I __m512i
#define QV_F __m512
#define QV_ZERO _mm512_setzero_si512
#define QV_ZEROF _mm512_setzero_ps
#define QV_B8 _mm512_set1_epi8
#define QV_B32 _mm512_set1_epi32
#define QV_BF _mm512_set1_ps
#define QV_AND _mm512_and_si512
#define QV_OR _mm512_or_si512
#define QV_SRLI16 _mm512_srli_epi16
#define QV_SLLI16 _mm512_slli_epi16
#define QV_SLLI32 _mm512_slli_epi32
#define QV_ABS8 _mm512_abs_epi8
#define QV_ADD32 _mm512_add_epi32
#define QV_MULLO32 _mm512_mullo_epi32
#define QV_DPBUSD _mm512_dpbusd_epi32
#define QV_ACC_ADD _mm512_dpbusd_epi32
#define QV_ACC_I32(acc) (acc)
// Q8_0's signs as a mask, once a block: x negated where the weight is negative (vpsignb
// has no 512-bit form; where it is 0, x stays and meets |w| = 0, as psignb's 0 would).
#define QV_SG __mmask64
#define QV_SG_OF(v, p) _mm512_movepi8_mask(v)
#define QV_SIGN8(x, sg) _mm512_mask_sub_epi8((x), (sg), _mm512_setzero_si512(), (x))
#define QV_BIT_TO4 qg_bit_to4_512
#define QV_BCAST4 qg_bcast4_512
#define QV_LOADW qg_loadw_512
#define QV_PH qg_ph_512
#define QV_U8(p, gs) _mm512_cvtepu8_epi32(qg_8bytes2((p), (gs)))
#define QV_I8(p, gs) _mm512_cvtepi8_epi32(qg_8bytes2((p), (gs)))
#define QV_CVTF _mm512_cvtepi32_ps
#define QV_MULF _mm512_mul_ps
#define QV_FMA _mm512_fmadd_ps
#define QV_ADDF _mm512_add_ps
#define QV_XORF _mm512_xor_ps
#define QV_STOREF _mm512_storeu_ps
#include "qgemm_packed.h"
#endif

// Whether a pass takes two pairs of groups at once (qg_rows_quad): each broadcast of the
// activations then meets 32 weight rows. Prompt passes (weights cached by the pass before)
// gained 1.07-1.22x; at decode's row counts, the weights streamed from memory, Q6_K's
// 32 rows (more registers than there are) lose 0.82-0.94x and the others gain from 32 rows.
// Q8_0, whose signs are applied per product, loses 0.84x.
static inline int qg_quad(int qtype, const qg_act *a) {
    return qtype != QG_Q8_0 && (a->pass || (qtype != QG_Q6_K && a->M >= QG_QUAD_MIN));
}

// Groups g0..g1-1 of 8 weight rows from the repacked copy.
static inline __attribute__((always_inline)) void qg_groups_packed(const int qtype, const uint8_t *wp,
                                                                   int64_t g0, int64_t g1, int64_t row_bytes,
                                                                   const qg_act *a, float *out, int64_t ldo) {
    const int64_t pk_bytes = qg_pk_row_bytes(qtype, a->K, row_bytes);
    qg_act v;
    if (a->bq) {  // the quantizer's block-major copy of this pass
        v = *a;
        v.blocked = 1;
        v.q = a->bq;
        v.d = a->bd;
        v.s = a->bs;
        v.o0 = a->bo0;
        v.o1 = a->bo1;
        v.o16 = a->bo16;
        a = &v;
    }
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t *pp = wp + (g - g % QG_PAIR) * 8 * pk_bytes;  // its pair's bytes
        const int h = (int)(g % QG_PAIR);
#ifdef QG_W512
        if (h == 0 && g + 3 < g1 && qg_quad(qtype, a)) {  // two whole pairs
            for (int64_t m0 = 0; m0 < a->M; m0 += QG_QUAD_ROWS) {
                qg_act v2 = *a;
                qg_act_skip(&v2, m0);
                const int mr = (int)(a->M - m0 < QG_QUAD_ROWS ? a->M - m0 : QG_QUAD_ROWS);
                qg_rows_quad_16(qtype, pp, &v2, out + m0 * ldo, ldo, 8 * g, mr);
            }
            g += 3;
            continue;
        }
        if (h == 0 && g + 1 < g1) {  // a whole pair; a share's odd group at 8 lanes
            if (a->M == 1) qg_rows_packed_16(qtype, pp, 0, a, out, ldo, 8 * g, 1);  // batch-1 decode
            else qg_rows_packed_16(qtype, pp, 0, a, out, ldo, 8 * g, (int)a->M);
            ++g;
            continue;
        }
#endif
        if (a->M == 1) qg_rows_packed_8(qtype, pp, h, a, out, ldo, 8 * g, 1);  // batch-1 decode
        else qg_rows_packed_8(qtype, pp, h, a, out, ldo, 8 * g, (int)a->M);
    }
}

// Each type's repacked loops as a function of its own (not inlined into qg_rows with every
// other type's): registers are then allocated for that type's loops alone. Inlined together,
// a change to one type's kernel moved every type's spills (Q4_0 and Q5_K lost 3-5% to a
// Q6_K-only change); apart, every type ran 1.02-1.07x faster at 512 rows.
#define QG_GROUPS_PACKED_FOR(T)                                                                          \
    static __attribute__((noinline)) void qg_groups_packed_##T(const uint8_t *wp, int64_t g0, int64_t g1, \
                                                               int64_t row_bytes, const qg_act *a,        \
                                                               float *out, int64_t ldo) {                 \
        qg_groups_packed(QG_##T, wp, g0, g1, row_bytes, a, out, ldo);                                    \
    }
QG_GROUPS_PACKED_FOR(Q4_0)
QG_GROUPS_PACKED_FOR(Q4_1)
QG_GROUPS_PACKED_FOR(Q5_0)
QG_GROUPS_PACKED_FOR(Q5_1)
QG_GROUPS_PACKED_FOR(Q8_0)
QG_GROUPS_PACKED_FOR(Q4_K)
QG_GROUPS_PACKED_FOR(Q5_K)
QG_GROUPS_PACKED_FOR(Q6_K)
#undef QG_GROUPS_PACKED_FOR

static inline __attribute__((always_inline)) void qg_rows_simd_t(const int qtype, const uint8_t *w,
                                                                 int64_t n0, int64_t n1, int64_t row_bytes,
                                                                 const qg_act *a, float *out, int64_t ldo) {
    const int t = (int)(a->nb % 8);
    if (!a->inter && t && (qg_off32(qtype) || qg_min32(qtype) || qtype == QG_Q8_0)) {
        qg_tailplan pl;
        qg_tailplan_init(&pl, t);
        for (int64_t n = n0; n < n1; n += 8 / t) {
            const int r = (int)(n1 - n < 8 / t ? n1 - n : 8 / t);
            if (a->M == 1) qg_rows_small_tail(qtype, w, n, r, &pl, row_bytes, a, out, ldo, 1);
            else qg_rows_small_tail(qtype, w, n, r, &pl, row_bytes, a, out, ldo, (int)a->M);
        }
        return;
    }
    if (!a->inter) {
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t *row = w + n * row_bytes;
            if (a->M == 1) qg_row_small(qtype, row, a, out, ldo, n, 1);  // batch-1 decode
            else qg_row_small(qtype, row, a, out, ldo, n, (int)a->M);
        }
        return;
    }
    // Chunks of QG_CHUNK groups: a chunk's activations stay in L2 while the weight rows
    // stream past (prefill-sized M), and a weight row stays in L1 across a chunk's groups.
    for (int64_t c0 = 0; c0 < a->G; c0 += QG_CHUNK) {
        const int64_t c1 = c0 + QG_CHUNK < a->G ? c0 + QG_CHUNK : a->G;
        for (int64_t n = n0; n < n1; ++n)
            for (int64_t g0 = c0; g0 < c1; g0 += QG_GT)
                qg_row_inter(qtype, w + n * row_bytes, a, g0, (int)(c1 - g0 < QG_GT ? c1 - g0 : QG_GT), out, ldo, n);
    }
}
#endif

// Weight rows [n0, n1) against every activation row (the calling thread's share); wp:
// the weights repacked by qgemm_pack, or NULL. The few-row path takes the repacked
// copy for whole groups of 8 rows, any rows outside them (callers share rows out in whole
// groups, so none where N is a multiple of 8) the original.
static void qg_rows(int qtype, const uint8_t *w, const uint8_t *wp, int64_t n0, int64_t n1,
                    int64_t row_bytes, const qg_act *a, float *out, int64_t ldo) {
#ifdef QG_AVX2
    if (!a->inter && a->M > QG_SMALL_MAX) {
        // row-major passes of QG_SMALL_MAX rows: a pass's activations stay in L2 while the
        // share's weights stream past once per pass (each row's result is the same bits)
        for (int64_t m0 = 0; m0 < a->M; m0 += QG_SMALL_MAX) {
            qg_act v = *a;
            const int64_t f = m0 * a->nb;
            v.M = a->M - m0 < QG_SMALL_MAX ? a->M - m0 : QG_SMALL_MAX;
            v.G = (v.M + 7) / 8;
            v.pass = 1;
            qg_act_skip(&v, m0);
            if (a->bq) {  // passes before this one are whole: it starts m0 rows in
                v.bq = a->bq + m0 * a->K;
                v.bd = a->bd + f;
                v.bs = a->bs + f;
                v.bo0 = a->bo0 + f;
                v.bo1 = a->bo1 + f;
                v.bo16 = a->bo16 + f;
            }
            qg_rows(qtype, w, wp, n0, n1, row_bytes, &v, out + m0 * ldo, ldo);
        }
        return;
    }
    if (wp && !a->inter && qg_packable(qtype)) {
        const int64_t g0 = (n0 + 7) / 8, g1 = n1 / 8;
        if (g0 < g1) {
            qg_rows(qtype, w, NULL, n0, 8 * g0, row_bytes, a, out, ldo);
            switch (qtype) {  // each type's loop compiled on its own
            case QG_Q4_0: qg_groups_packed_Q4_0(wp, g0, g1, row_bytes, a, out, ldo); break;
            case QG_Q4_1: qg_groups_packed_Q4_1(wp, g0, g1, row_bytes, a, out, ldo); break;
            case QG_Q5_0: qg_groups_packed_Q5_0(wp, g0, g1, row_bytes, a, out, ldo); break;
            case QG_Q5_1: qg_groups_packed_Q5_1(wp, g0, g1, row_bytes, a, out, ldo); break;
            case QG_Q8_0: qg_groups_packed_Q8_0(wp, g0, g1, row_bytes, a, out, ldo); break;
            case QG_Q4_K: qg_groups_packed_Q4_K(wp, g0, g1, row_bytes, a, out, ldo); break;
            case QG_Q5_K: qg_groups_packed_Q5_K(wp, g0, g1, row_bytes, a, out, ldo); break;
            default: qg_groups_packed_Q6_K(wp, g0, g1, row_bytes, a, out, ldo); break;
            }
            qg_rows(qtype, w, NULL, 8 * g1, n1, row_bytes, a, out, ldo);
            return;
        }
    }
    switch (qtype) {
    case QG_Q4_0: qg_rows_simd_t(QG_Q4_0, w, n0, n1, row_bytes, a, out, ldo); return;
    case QG_Q4_1: qg_rows_simd_t(QG_Q4_1, w, n0, n1, row_bytes, a, out, ldo); return;
    case QG_Q5_0: qg_rows_simd_t(QG_Q5_0, w, n0, n1, row_bytes, a, out, ldo); return;
    case QG_Q5_1: qg_rows_simd_t(QG_Q5_1, w, n0, n1, row_bytes, a, out, ldo); return;
    case QG_Q8_0: qg_rows_simd_t(QG_Q8_0, w, n0, n1, row_bytes, a, out, ldo); return;
    case QG_Q4_K: qg_rows_simd_t(QG_Q4_K, w, n0, n1, row_bytes, a, out, ldo); return;
    case QG_Q5_K: qg_rows_simd_t(QG_Q5_K, w, n0, n1, row_bytes, a, out, ldo); return;
    case QG_Q6_K: qg_rows_simd_t(QG_Q6_K, w, n0, n1, row_bytes, a, out, ldo); return;
    }
#else
    (void)wp;
    qg_rows_scalar(qtype, w, n0, n1, row_bytes, a, out, ldo);
#endif
}

static int qg_check(int qtype, int64_t K, int64_t row_bytes) {
    const int bb = qg_block_bytes(qtype);
    if (bb < 0) return -1;
    const int bs = qg_block_size(qtype);
    if (K % bs || row_bytes != K / bs * bb) return -1;
    return 0;
}

// ---------------------------------------------------------------------------------------
// Exported entry points (ctypes).

int64_t qgemm_scratch_bytes(int64_t M, int64_t K) { return qg_act_bytes(M, K); }

// Which integer path this build takes: 0 scalar, 1 AVX2, 2 AVX2 with VNNI (AVX512-VNNI or
// AVX-VNNI), 3 VNNI with the repacked kernel at 512 bits.
int qgemm_simd_level(void) {
#if defined(QG_W512)
    return 3;
#elif defined(QG_VNNI)
    return 2;
#elif defined(QG_AVX2)
    return 1;
#else
    return 0;
#endif
}

// Thread t's first weight row of N: whole groups of 8 where N has them, so every share
// reads the repacked copy (qg_rows takes rows outside whole groups from the original blocks:
// 16 threads over 576 rows in shares of 36 did 12-19% more work in all).
static inline int64_t qg_share(int64_t N, int t, int T) { return N % 8 ? N * t / T : 8 * ((N / 8) * t / T); }

// One parallel region: quantize the rows, then the weight rows (wp: the repacked copy, or
// NULL; inter_min: the row count from which the activations interleave).
static int qg_gemm(int qtype, const uint8_t *w, const uint8_t *wp, int64_t N, int64_t K, int64_t row_bytes,
                   const float *x, int64_t ldx, int64_t M, float *out, void *scratch, int n_threads,
                   int64_t inter_min) {
    if (qg_check(qtype, K, row_bytes)) return -1;
    qg_act a;
    qg_act_init(&a, scratch, M, K, inter_min);
    const int64_t rows = a.inter ? a.G * 8 : M;
#pragma omp parallel num_threads(n_threads)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        T = omp_get_num_threads();
#endif
        qg_quantize_rows(&a, x, ldx, rows * t / T, rows * (t + 1) / T);
#pragma omp barrier
        qg_rows(qtype, w, wp, qg_share(N, t, T), qg_share(N, t + 1, T), row_bytes, &a, out, N);
    }
    return 0;
}

// x: [M, K] float32 (row stride ldx); w: [N, row_bytes]; out: [M, N]; scratch: at least
// qgemm_scratch_bytes(M, K). Returns 0, or -1 for an unsupported type or shape.
int qgemm_q8(int qtype, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, const float *x,
             int64_t ldx, int64_t M, float *out, void *scratch, int n_threads) {
    return qg_gemm(qtype, w, NULL, N, K, row_bytes, x, ldx, M, out, scratch, n_threads, QG_INTER_MIN);
}

// A row's 32 weights u (one slice or block) as its bytes of the copy's Q4 vectors: the low
// 4 bits as Q4_0's bytes (weight i low, i + 16 high), vector h's 4 bytes at dst + 32 h.
static void qg_pack_nibbles(const uint8_t u[32], uint8_t *dst) {
    for (int h = 0; h < 4; ++h)
        for (int i = 0; i < 4; ++i)
            dst[32 * h + i] = (uint8_t)((u[4 * h + i] & 0x0F) | ((u[16 + 4 * h + i] & 0x0F) << 4));
}

// A row's fifth bits (bit 4 of its 32 weights u) as its 4 bytes of the copy's fifth-bit
// vector: byte i, bit g = weight 4g + i.
static void qg_pack_bit4(const uint8_t u[32], uint8_t *dst) {
    for (int i = 0; i < 4; ++i) {
        uint8_t hb = 0;
        for (int g = 0; g < 8; ++g) hb |= (uint8_t)(((u[4 * g + i] >> 4) & 1) << g);
        dst[i] = hb;
    }
}

// The groups of 8 rows one after another, each its units in order (qgemm_pack's first step).
static int qg_pack_groups(int qtype, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, uint8_t *out) {
    if (qg_k4like(qtype) || qtype == QG_Q6_K) {
        const int k4 = qg_k4like(qtype), k5 = qtype == QG_Q5_K;
        const int64_t sbb = k5 ? QG_PK_K5_SB : k4 ? QG_PK_K4_SB : QG_PK_K6_SB, hdr = k4 ? QG_PK_K4_HDR : QG_PK_K6_HDR;
        const int64_t slb = k5 ? QG_PK_K5_SLICE : k4 ? QG_PK_K4_SLICE : QG_PK_K6_SLICE;
        const int64_t pkr = qg_pk_row_bytes(qtype, K, row_bytes);
        for (int64_t g = 0; g < N / 8; ++g)
            for (int64_t sb = 0; sb < K / QG_QKK; ++sb) {
                uint8_t *o = out + g * 8 * pkr + sb * sbb;
                for (int r = 0; r < 8; ++r) {
                    const uint8_t *row = w + (g * 8 + r) * row_bytes, *blk = row + sb * qg_block_bytes(qtype);
                    memcpy(o + 2 * r, k4 ? blk : blk + 208, 2);        // d
                    if (k4) memcpy(o + 16 + 2 * r, blk + 2, 2);  // dmin
                    for (int j = 0; j < 8; ++j) {
                        uint8_t *sl = o + hdr + j * slb;
                        qg_wblk wb;  // the slice's weights (0-15, 0-31 or 0-63) and scales
                        qg_decode(qtype, row, sb * 8 + j, &wb);
                        if (k4) {
                            qg_k4_scale_min(j, blk + 4, sl + r, sl + 8 + r);
                        } else {
                            sl[r] = (uint8_t)wb.sc16[0];
                            sl[8 + r] = (uint8_t)wb.sc16[1];
                        }
                        qg_pack_nibbles(wb.u, sl + 16 + 4 * r);
                        if (k5) qg_pack_bit4(wb.u, sl + 144 + 4 * r);
                        if (k4) continue;
                        for (int q = 0; q < 2; ++q)  // Q6_K's top 2 bits
                            for (int i = 0; i < 4; ++i) {
                                uint8_t hb = 0;
                                for (int k = 0; k < 4; ++k) hb |= (uint8_t)((wb.u[8 * k + 4 * q + i] >> 4) << (2 * k));
                                sl[144 + 32 * q + 4 * r + i] = hb;
                            }
                    }
                }
            }
        return 0;
    }
    const int64_t nb = K / QG_QK, bs = qg_block_bytes(qtype), hdr = qg_pk_hdr(qtype);
    if (qg_five(qtype)) {  // Q4_0's / Q4_1's layout, then the fifth bits' vector
        for (int64_t g = 0; g < N / 8; ++g)
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t *o = out + g * 8 * row_bytes + b * 8 * bs;
                for (int r = 0; r < 8; ++r) {
                    const uint8_t *row = w + (g * 8 + r) * row_bytes;
                    memcpy(o + 2 * r, row + b * bs, 2);                                  // d
                    if (qg_min32(qtype)) memcpy(o + 16 + 2 * r, row + b * bs + 2, 2);  // m
                    qg_wblk wb;
                    qg_decode(qtype, row, b, &wb);
                    qg_pack_nibbles(wb.u, o + hdr + 4 * r);
                    qg_pack_bit4(wb.u, o + hdr + 128 + 4 * r);
                }
            }
        return 0;
    }
    const int nw = qg_pk_words(qtype);
    const int64_t off = bs - 4 * nw;  // the quants follow the block's scale (and min)
    for (int64_t g = 0; g < N / 8; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *o = out + g * 8 * row_bytes + b * 8 * bs;
            for (int r = 0; r < 8; ++r) {
                const uint8_t *src = w + (g * 8 + r) * row_bytes + b * bs;
                memcpy(o + 2 * r, src, 2);                                   // d
                if (qtype == QG_Q4_1) memcpy(o + 16 + 2 * r, src + 2, 2);  // m
                for (int h = 0; h < nw; ++h) memcpy(o + hdr + 32 * h + 4 * r, src + off + 4 * h, 4);
            }
        }
    return 0;
}

// Repack rows of any type for the few-row path (qg_rows_packed's layout): out has
// qgemm_pack_bytes(qtype, N, K) bytes (Q4_K's 148 and Q5_K's 180 a row per super-block,
// the others' as many as the original; with QG_PAIR 2, N rounded up to 16 rows and each
// pair's units alternating). Returns 0, or -1 for an unknown type, a bad shape, N not a
// multiple of 8 or no memory.
int qgemm_pack(int qtype, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, uint8_t *out) {
    if (!qg_packable(qtype) || qg_check(qtype, K, row_bytes) || N % 8) return -1;
    qg_pack_groups(qtype, w, N, K, row_bytes, out);
    if (QG_PAIR == 1) return 0;
    // each pair's pieces alternate: a block of each (K-quants: per super-block the two
    // headers, then each slice of each)
    const int64_t gbytes = 8 * qg_pk_row_bytes(qtype, K, row_bytes);
    const int64_t khdr = qg_pk_kpiece(qtype, 1), kslice = qg_pk_kpiece(qtype, 0);
    const int64_t unit = khdr ? khdr + 8 * kslice : 8 * qg_block_bytes(qtype), units = gbytes / unit;
    if ((N / 8) % 2) memset(out + N * (gbytes / 8), 0, (size_t)gbytes);  // the last pair's zeros
    uint8_t *tmp = malloc((size_t)(2 * gbytes));
    if (tmp == NULL) return -1;
    for (int64_t p = 0; p < (N / 8 + 1) / 2; ++p) {
        uint8_t *o = out + 2 * p * gbytes;
        memcpy(tmp, o, (size_t)(2 * gbytes));
        for (int64_t u = 0; u < units; ++u) {
            int64_t off = 0;  // within the unit
            for (int piece = 0; piece < (khdr ? 9 : 1); ++piece) {
                const int64_t len = !khdr ? unit : piece ? kslice : khdr;
                for (int h = 0; h < 2; ++h, o += len) memcpy(o, tmp + h * gbytes + u * unit + off, (size_t)len);
                off += len;
            }
        }
    }
    free(tmp);
    return 0;
}

// The bytes qgemm_pack writes for N rows (-1: a type it does not repack).
int64_t qgemm_pack_bytes(int qtype, int64_t N, int64_t K) {
    if (!qg_packable(qtype) || qg_block_bytes(qtype) < 0 || K % qg_block_size(qtype)) return -1;
    const int64_t rows = (N + 8 * QG_PAIR - 1) / (8 * QG_PAIR) * (8 * QG_PAIR);
    return rows * qg_pk_row_bytes(qtype, K, K / qg_block_size(qtype) * qg_block_bytes(qtype));
}

// qgemm_q8 with the repacked copy wp of w (qgemm_pack) beside it: row-major at every row
// count, the path the decode step of a model whose weights all have one takes (tests).
int qgemm_q8_packed(int qtype, const uint8_t *w, const uint8_t *wp, int64_t N, int64_t K, int64_t row_bytes,
                    const float *x, int64_t ldx, int64_t M, float *out, void *scratch, int n_threads) {
    return qg_gemm(qtype, w, wp, N, K, row_bytes, x, ldx, M, out, scratch, n_threads, QG_PACKED_INTER_MIN);
}

// The scalar reference, single-threaded (tests): `inter` picks the activation layout.
int qgemm_q8_ref(int qtype, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, const float *x,
                 int64_t M, float *out, void *scratch, int inter) {
    if (qg_check(qtype, K, row_bytes)) return -1;
    qg_act a;
    qg_act_init(&a, scratch, M, K, QG_INTER_MIN);
    a.inter = inter;
    qg_quantize_rows(&a, x, K, 0, inter ? a.G * 8 : M);
    qg_rows_scalar(qtype, w, 0, N, row_bytes, &a, out, N);
    return 0;
}
