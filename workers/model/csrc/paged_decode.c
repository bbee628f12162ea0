// Paged decode attention on the CPU: one query token per stream, reading the
// stream's KV blocks in place through its block table (no gather, no padding).
// Work items are (stream, kv head) pairs, so GQA query heads that share a KV
// head read it once, and the work per stream follows its own length. A sliding
// window starts the walk at the window's first block (keys before it are never
// read); a soft-cap (Gemma 2) passes the scores through cap * tanh(s / cap).
//
// With AVX2+FMA (and D a multiple of 8) the scores, the softmax exponentials and
// the V accumulation run 8 lanes wide (the dots and V sums 16 on AVX-512, with the
// same bits); the exponential is a polynomial, since a libm expf per score costs
// more than reading the score's K row from DRAM. The
// online softmax steps over spans of whole blocks (64 keys at D = 64, 32 at 128),
// so its per-step work (max, correction, rescaling) is paid once per span, and a
// prompt chunk's rows attend in tiles that copy each span's K/V rows together once.
//
// The cache holds float32 or float16 K/V (kv16). float16 rows are widened to float32 a
// span at a time, into the buffers a tile copies its rows to, and attend from there: the
// arithmetic is float32's on the stored values, and a step reads half the bytes from DRAM.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KV_AVX2 1
#if defined(__AVX512F__) && !defined(KV_NO_W512)
// the dot products and V sums 16 lanes wide where D is a multiple of 16 (same bits: below)
#define KV_W512 1
#endif
#endif

#define MAX_REP 32
#define MAX_D 256
#define MAX_BS 256
#define KV_COPY 4096  // floats of a span's K (and V) rows a tile copies together
#define KV_SPAN 64     // keys per online-softmax step at most (where blocks are smaller)

// Per item: the item's query rows pre-scaled, empty accumulators, softmax state.
static inline void begin_item(const float *q, float *qs, float *acc, float *m,
                              float *l, int64_t b, int64_t ldq, int64_t qh0, int64_t D,
                              int64_t rep, float scale) {
    for (int64_t r = 0; r < rep; ++r) {
        const float *qr = q + b * ldq + (qh0 + r) * D;
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qr[d] * scale;
        memset(acc + r * D, 0, sizeof(float) * D);
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
}

// Per block: soft-cap the scores and mask the keys before the window's first one
// (their scores were never computed).
static inline void fix_scores(float (*s)[MAX_BS + 8], int64_t rep, int64_t n, int64_t t0,
                              int64_t first, float cap) {
    const int64_t j0 = t0 < first ? first - t0 : 0;
    for (int64_t r = 0; r < rep; ++r) {
        for (int64_t j = 0; j < j0; ++j) s[r][j] = -INFINITY;
        if (cap > 0.f)
            for (int64_t j = j0; j < n; ++j) s[r][j] = cap * tanhf(s[r][j] / cap);
    }
}

// Per item: normalise the accumulators into the output rows.
static inline void end_item(float *out, const float *acc, const float *l, int64_t b,
                            int64_t ldo, int64_t qh0, int64_t D, int64_t rep) {
    for (int64_t r = 0; r < rep; ++r) {
        float *o = out + b * ldo + (qh0 + r) * D;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
    }
}

#ifdef KV_AVX2
// exp(x) for x <= 0 (scores minus their running max): range reduction to
// 2^n * exp(r), |r| <= ln2/2, degree-6 polynomial; relative error ~2e-7.
static inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);  // also -inf
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#ifdef KV_W512
// exp_neg at 16 lanes (the decode step's MLP activation, decode_step.c): each lane's
// operations are exp_neg's, so its bits.
static inline __m512 exp_neg16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);  // also -inf
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
}
#endif

static inline float kv_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// A pre-scaled query row against a K row (C chunks of 8): two accumulators' lanes, summed.
// At 16 lanes (C even) lanes 0-7 are the even chunks' accumulator and lanes 8-15 the odd
// ones': the same operations in the same order, so the same bits.
static inline __attribute__((always_inline)) __m256 kv_row_dot(const float *qr, const float *kj, const int64_t C) {
#ifdef KV_W512
    if (C % 2 == 0) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < C; c += 2) a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 8 * c), _mm512_loadu_ps(kj + 8 * c), a);
        return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    }
#endif
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 1 < C; c += 2) {
        a0 = _mm256_fmadd_ps(_mm256_load_ps(qr + 8 * c), _mm256_loadu_ps(kj + 8 * c), a0);
        a1 = _mm256_fmadd_ps(_mm256_load_ps(qr + 8 * c + 8), _mm256_loadu_ps(kj + 8 * c + 8), a1);
    }
    if (c < C) a0 = _mm256_fmadd_ps(_mm256_load_ps(qr + 8 * c), _mm256_loadu_ps(kj + 8 * c), a0);
    return _mm256_add_ps(a0, a1);
}

// One score.
static inline __attribute__((always_inline)) float row_score(const float *qr, const float *kj,
                                                             const int64_t C) {
    return kv_hsum(kv_row_dot(qr, kj, C));
}

// Eight scores: a pre-scaled query row against the K rows k0 + i * ks, i = 0..7, each with
// row_score's bits (kv_row_dot, then kv_hsum's order of sums), the eight sums reduced
// together by a transposed tree instead of eight horizontal sums.
static inline __attribute__((always_inline)) __m256 row_score8(const float *qr, const float *k0,
                                                               int64_t ks, const int64_t C) {
    __m256 t[8];
    for (int i = 0; i < 8; ++i) t[i] = kv_row_dot(qr, k0 + i * ks, C);
    // kv_hsum's first sum, lane i + lane i + 4: [row 2p's four | row 2p + 1's four]
    __m256 x[4];
    for (int p = 0; p < 4; ++p)
        x[p] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * p], t[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(t[2 * p], t[2 * p + 1], 0x31));
    // its second, lanes 0 + 2 and 1 + 3: [r0 r0 r2 r2 | r1 r1 r3 r3], [r4 r4 r6 r6 | r5 r5 r7 r7]
    __m256 y[2];
    for (int p = 0; p < 2; ++p)
        y[p] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // its last, lane 0 + lane 1: [r0 r2 r4 r6 | r1 r3 r5 r7], then in order
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// A row's scores for keys j0 .. n-1 of a run of K rows (row j at kb + j * ks) into sr.
static inline __attribute__((always_inline)) void row_scores(float *sr, const float *qr, const float *kb,
                                                             int64_t ks, int64_t j0, int64_t n,
                                                             const int64_t C) {
    int64_t j = j0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(sr + j, row_score8(qr, kb + j * ks, ks, C));
    for (; j < n; ++j) sr[j] = row_score(qr, kb + j * ks, C);
}

// Keys per online-softmax step (a span): whole blocks, up to KV_SPAN keys and KV_COPY floats
// of K rows (64 keys of 64, 32 of 128), one block where a block is larger. A step's per-row
// work (the max, the correction, rescaling the sums) is paid once per span, not per block;
// every path takes the same spans from key 0, so a row's bits do not depend on its path.
static inline int64_t span_keys(int64_t bs, int64_t D) {
    const int64_t keys = KV_COPY / D < KV_SPAN ? KV_COPY / D : KV_SPAN;
    return (keys / bs > 1 ? keys / bs : 1) * bs;
}

// One row's online-softmax step over a span's n scores: sr turned into weights, the running
// max and sum updated. Returns what the row's sums so far are to be scaled by: exactly 1
// where the max holds, 0 at the first span.
static inline __attribute__((always_inline)) float row_softmax(float *sr, float *mr, float *lr, int64_t n) {
    // the span's max (exact in any order), 8 lanes at a time
    __m256 mx8 = _mm256_set1_ps(*mr);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_load_ps(sr + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx8), _mm256_extractf128_ps(mx8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (; j < n; ++j) mx = sr[j] > mx ? sr[j] : mx;
    const float corr = _mm256_cvtss_f32(exp_neg(_mm256_set1_ps(*mr - mx)));
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 lsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_load_ps(sr + j), mv));
        _mm256_store_ps(sr + j, e);
        lsum = _mm256_add_ps(lsum, e);
    }
    float lt = kv_hsum(lsum);
    for (; j < n; ++j) {
        sr[j] = expf(sr[j] - mx);
        lt += sr[j];
    }
    *lr = *lr * corr + lt;
    *mr = mx;
    return corr;
}

// One row's V accumulation over keys j .. je-1 of a span, V row jj at run + (jj - jb) *
// vstride, its sums scaled by corr first (1: not). Per 64-wide slice of D the accumulator
// stays in registers across the keys.
static inline __attribute__((always_inline)) void row_v(const float *sr, float *accr, float corr, int64_t j,
                                                        int64_t je, const float *run, int64_t jb,
                                                        int64_t vstride, const int64_t C) {
#ifdef KV_W512
    if (C % 2 == 0) {  // elementwise: the same bits at 16 lanes
        const __m512 cv = _mm512_set1_ps(corr);
        for (int64_t cg = 0; cg < C / 2; cg += 8) {
            const int64_t cn = (C / 2 - cg) < 8 ? (C / 2 - cg) : 8;
            __m512 a[8];
            for (int64_t c = 0; c < cn; ++c) a[c] = _mm512_loadu_ps(accr + 16 * (cg + c));
            if (corr != 1.f)
                for (int64_t c = 0; c < cn; ++c) a[c] = _mm512_mul_ps(a[c], cv);
            for (int64_t jj = j; jj < je; ++jj) {
                const float *vj = run + (jj - jb) * vstride + 16 * cg;
                const __m512 p = _mm512_set1_ps(sr[jj]);
                for (int64_t c = 0; c < cn; ++c) a[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * c), a[c]);
            }
            for (int64_t c = 0; c < cn; ++c) _mm512_storeu_ps(accr + 16 * (cg + c), a[c]);
        }
        return;
    }
#endif
    const __m256 cv = _mm256_set1_ps(corr);
    for (int64_t cg = 0; cg < C; cg += 8) {
        const int64_t cn = (C - cg) < 8 ? (C - cg) : 8;
        __m256 a[8];
        for (int64_t c = 0; c < cn; ++c) a[c] = _mm256_load_ps(accr + 8 * (cg + c));
        if (corr != 1.f)
            for (int64_t c = 0; c < cn; ++c) a[c] = _mm256_mul_ps(a[c], cv);
        for (int64_t jj = j; jj < je; ++jj) {
            const float *vj = run + (jj - jb) * vstride + 8 * cg;
            const __m256 p = _mm256_set1_ps(sr[jj]);
            for (int64_t c = 0; c < cn; ++c) a[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * c), a[c]);
        }
        for (int64_t c = 0; c < cn; ++c) _mm256_store_ps(accr + 8 * (cg + c), a[c]);
    }
}

#ifdef KV_W512
// row_v for N rows r .. r + N - 1 over the same keys (C even; N = 4 at D <= 64, 2 below
// D = 128): each row's operations as row_v's, so its bits. One row has C / 2 sums (4 at
// D = 64), too few chains to keep the FMA units busy; rows together have more, and each V
// slice is loaded once for all N (pairs that loaded it once per FMA were bound by the loads:
// a 512-token prompt chunk's attention at D = 64 ran 1.05-1.07x faster in fours than in
// such pairs; pairs gained 1.07x over single rows; at D = 128 a row has 8 chains of its own
// and pairs ran no faster).
static inline __attribute__((always_inline)) void row_vn(float (*s)[MAX_BS + 8], float *acc, const float *corr,
                                                         int64_t r, const int N, int64_t j, int64_t je,
                                                         const float *run, int64_t jb, int64_t vstride,
                                                         const int64_t C, const int64_t D) {
    const int64_t cn = C / 2;
    __m512 a[4][8];
    for (int i = 0; i < N; ++i) {
        for (int64_t c = 0; c < cn; ++c) a[i][c] = _mm512_loadu_ps(acc + (r + i) * D + 16 * c);
        if (corr[i] != 1.f) {
            const __m512 cv = _mm512_set1_ps(corr[i]);
            for (int64_t c = 0; c < cn; ++c) a[i][c] = _mm512_mul_ps(a[i][c], cv);
        }
    }
    for (int64_t jj = j; jj < je; ++jj) {
        const float *vj = run + (jj - jb) * vstride;
        __m512 p[4];
        for (int i = 0; i < N; ++i) p[i] = _mm512_set1_ps(s[r + i][jj]);
        for (int64_t c = 0; c < cn; ++c) {
            __m512 vv = _mm512_loadu_ps(vj + 16 * c);
            __asm__("" : "+v"(vv));  // one load for the N rows, not one folded into each FMA
            for (int i = 0; i < N; ++i) a[i][c] = _mm512_fmadd_ps(p[i], vv, a[i][c]);
        }
    }
    for (int i = 0; i < N; ++i)
        for (int64_t c = 0; c < cn; ++c) _mm512_storeu_ps(acc + (r + i) * D + 16 * c, a[i][c]);
}
#endif

// R query rows (pre-scaled at qs, sums at acc, rows D apart) against one span at key t0:
// row r sees its keys j0 .. nr[r]-1, whose K and V rows lie in runs of `run` rows (run i
// at kb[i] and vb[i], rows `stride` floats apart). Scores, then each row's softmax step,
// then the V sums; the runs are the outer loop, so a run's rows stay in L1 across the R
// rows, and each row adds its keys in order: its bits are those it has alone.
static inline __attribute__((always_inline)) void span_rows(float (*s)[MAX_BS + 8], const float *qs, float *acc,
                                                            float *m, float *l, int64_t R, const int64_t *nr,
                                                            int64_t j0, const float *const *kb,
                                                            const float *const *vb, int64_t run, int64_t stride,
                                                            const int64_t D, int64_t t0, int64_t first, float cap) {
    const int64_t C = D / 8, jr = j0 / run * run;
    int64_t n = 0;
    float corr[MAX_REP];
    for (int64_t r = 0; r < R; ++r) n = nr[r] > n ? nr[r] : n;
    for (int64_t jb = jr; jb < n; jb += run)
        for (int64_t r = 0; r < R; ++r)
            if (jb < nr[r])
                row_scores(s[r] + jb, qs + r * D, kb[jb / run], stride, j0 > jb ? j0 - jb : 0,
                           (nr[r] - jb) < run ? nr[r] - jb : run, C);
    for (int64_t r = 0; r < R; ++r) {
        if (nr[r] <= 0) continue;
        fix_scores(s + r, 1, nr[r], t0, first, cap);
        corr[r] = row_softmax(s[r], m + r, l + r, nr[r]);
    }
    for (int64_t jb = jr; jb < n; jb += run)
        for (int64_t r = 0; r < R; ++r) {
            if (jb >= nr[r]) continue;
            const int64_t js = j0 > jb ? j0 : jb, je = (nr[r] - jb) < run ? nr[r] : jb + run;
#ifdef KV_W512
            // rows over the same keys: the query heads of one position that share the KV head
            const int n4 = C <= 8 && r + 3 < R && nr[r + 1] == nr[r] && nr[r + 2] == nr[r] && nr[r + 3] == nr[r];
            const int N = C % 2 || C >= 16 ? 1 : n4 ? 4 : r + 1 < R && nr[r + 1] == nr[r] ? 2 : 1;
            if (N > 1) {
                float cr[4];
                for (int i = 0; i < N; ++i) cr[i] = jb == jr ? corr[r + i] : 1.f;
                if (N == 4) row_vn(s, acc, cr, r, 4, js, je, vb[jb / run], jb, stride, C, D);
                else row_vn(s, acc, cr, r, 2, js, je, vb[jb / run], jb, stride, C, D);
                r += N - 1;
                continue;
            }
#endif
            row_v(s[r], acc + r * D, jb == jr ? corr[r] : 1.f, js, je, vb[jb / run], jb, stride, C);
        }
}

// The next block is usually elsewhere in the pool: start its DRAM reads now.
static inline void prefetch_block(const char *k, const char *v, int64_t nb, int64_t nn,
                                  int64_t Hkv, int64_t D, int64_t esz) {
    for (int64_t j = 0; j < nn; ++j)
        for (int64_t c = 0; c < D * esz; c += 64) {
            _mm_prefetch(k + (nb + j * Hkv) * D * esz + c, _MM_HINT_T0);
            _mm_prefetch(v + (nb + j * Hkv) * D * esz + c, _MM_HINT_T0);
        }
}

// Where the span's blocks of head h start (kb, vb: one per block; float16 rows where kv16,
// copy_rows widens them), prefetching each next block; blocks wholly before key j0 (a
// window's) are neither looked up nor read.
static inline void span_blocks(const void *k, const void *v, int kv16, const int32_t *table, int64_t t0,
                               int64_t n, int64_t j0, int64_t L, int64_t h, int64_t Hkv,
                               const int64_t D, int64_t bs, const float **kb, const float **vb) {
    const int64_t esz = kv16 ? 2 : 4;
    for (int64_t jb = j0 / bs * bs; jb < n; jb += bs) {
        const int64_t t = t0 + jb, base = ((int64_t)table[t / bs] * bs) * Hkv + h;
        kb[jb / bs] = (const float *)(const void *)((const char *)k + base * D * esz);
        vb[jb / bs] = (const float *)(const void *)((const char *)v + base * D * esz);
        if (t + bs < L)
            prefetch_block(k, v, ((int64_t)table[t / bs + 1] * bs) * Hkv + h, (L - t - bs) < bs ? (L - t - bs) : bs,
                           Hkv, D, esz);
    }
}

// A span's K or V rows j0 .. n-1 of one head (runs of bs rows at src, `stride` elements
// apart) copied into rows j0 .. n-1 of dst, D apart; float16 rows (kv16) widened, exactly,
// so the values are those the float32 kernel reads from a float32 copy of the cache.
static inline __attribute__((always_inline)) void copy_rows(float *dst, const float *const *src, int64_t bs,
                                                            int64_t j0, int64_t n, int64_t stride,
                                                            const int64_t D, int kv16) {
    for (int64_t j = j0; j < n; ++j) {
        if (!kv16) {
            const float *row = src[j / bs] + (j % bs) * stride;
            for (int64_t c = 0; c < D; c += 8) _mm256_store_ps(dst + j * D + c, _mm256_loadu_ps(row + c));
            continue;
        }
        const uint16_t *row = (const uint16_t *)(const void *)src[j / bs] + (j % bs) * stride;
        for (int64_t c = 0; c < D; c += 8)
            _mm256_store_ps(dst + j * D + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + c))));
    }
}

// One item: stream b, kv head h, the `rep` query heads from qh0 on (all that share h,
// or fewer when the work is split finer); q and out rows of stream b start at b * ldq
// and b * ldo. D is a compile-time constant where inlined from the dispatch below, so
// the D/8 chunk loops unroll fully.
static inline __attribute__((always_inline)) void item_avx2(
    const float *q, const void *k, const void *v, int kv16, float *out, const int32_t *table,
    int32_t L, int64_t b, int64_t h, int64_t ldq, int64_t ldo, int64_t qh0, int64_t Hkv,
    const int64_t D, int64_t bs, int64_t rep, float scale, int64_t first, float cap) {
    // rows D apart, not MAX_D: at MAX_D (1 KiB) the rows 4 apart share L1 sets
    float qs[MAX_REP * MAX_D] __attribute__((aligned(32)));
    float acc[MAX_REP * MAX_D] __attribute__((aligned(32)));
    float s[MAX_REP][MAX_BS + 8] __attribute__((aligned(32)));
    float m[MAX_REP], l[MAX_REP];
    float kc[KV_COPY] __attribute__((aligned(32))), vc[KV_COPY] __attribute__((aligned(32)));
    const float *kb[KV_SPAN], *vb[KV_SPAN], *kcp[1] = {kc}, *vcp[1] = {vc};
    int64_t nr[MAX_REP];
    const int64_t span = span_keys(bs, D);
    begin_item(q, qs, acc, m, l, b, ldq, qh0, D, rep, scale);
    for (int64_t t0 = first / span * span; t0 < L; t0 += span) {
        const int64_t n = (L - t0) < span ? (L - t0) : span;
        const int64_t j0 = t0 < first ? first - t0 : 0;  // keys before the window: unread
        span_blocks(k, v, kv16, table, t0, n, j0, L, h, Hkv, D, bs, kb, vb);
        for (int64_t r = 0; r < rep; ++r) nr[r] = n;
        if (kv16) {  // the span's rows as float32 (pd_run: they fit the buffers)
            copy_rows(kc, kb, bs, j0, n, Hkv * D, D, 1);
            copy_rows(vc, vb, bs, j0, n, Hkv * D, D, 1);
            span_rows(s, qs, acc, m, l, rep, nr, j0, kcp, vcp, span, D, D, t0, first, cap);
        } else {
            span_rows(s, qs, acc, m, l, rep, nr, j0, kb, vb, bs, Hkv * D, D, t0, first, cap);
        }
    }
    end_item(out, acc, l, b, ldo, qh0, D, rep);
}

// A tile: P consecutive prompt (or verify) rows of one stream, rows b .. b+P-1 at lengths
// L0 .. L0+P-1 over one block table, kv head h, its rep query heads: R = P * rep rows
// that read each K/V row once for all of them. Every row's arithmetic is item_avx2's for
// that row alone (the same spans, span_rows over its own keys), so a row's bits do not
// depend on the tile it is in. No window (callers check).
static inline __attribute__((always_inline)) void tile_avx2(
    const float *q, const void *k, const void *v, int kv16, float *out, const int32_t *table,
    int32_t L0, int64_t P, int64_t b, int64_t h, int64_t ldq, int64_t ldo, int64_t Hkv,
    const int64_t D, int64_t bs, int64_t rep, float scale, float cap) {
    // rows D apart, not MAX_D: at MAX_D (1 KiB) the rows 4 apart share L1 sets
    float qs[MAX_REP * MAX_D] __attribute__((aligned(32)));
    float acc[MAX_REP * MAX_D] __attribute__((aligned(32)));
    float s[MAX_REP][MAX_BS + 8] __attribute__((aligned(32)));
    float kc[KV_COPY] __attribute__((aligned(32))), vc[KV_COPY] __attribute__((aligned(32)));
    float m[MAX_REP], l[MAX_REP];
    const float *kb[KV_SPAN], *vb[KV_SPAN], *kcp[1] = {kc}, *vcp[1] = {vc};
    int64_t nr[MAX_REP];
    const int64_t R = P * rep, Lmax = L0 + P - 1, span = span_keys(bs, D);
    for (int64_t p = 0; p < P; ++p)
        begin_item(q, qs + p * rep * D, acc + p * rep * D, m + p * rep, l + p * rep, b + p, ldq, h * rep, D, rep,
                   scale);
    for (int64_t t0 = 0; t0 < Lmax; t0 += span) {
        const int64_t nmax = (Lmax - t0) < span ? (Lmax - t0) : span;
        span_blocks(k, v, kv16, table, t0, nmax, 0, Lmax, h, Hkv, D, bs, kb, vb);
        for (int64_t r = 0; r < R; ++r) {
            const int64_t n = L0 + r / rep - t0;
            nr[r] = n < span ? n : span;
        }
        // The span's rows of head h lie Hkv * D floats apart: 1 KiB for 4 heads of 64, so
        // rows 4 apart share L1 sets and, with the tile's own rows, overflow them. Copied
        // together once per tile, the R rows read them from L1 (the same arithmetic and bits).
        // float16 rows are always copied, widened (pd_run: they fit).
        if (kv16 || (Hkv > 1 && nmax * D <= KV_COPY)) {
            copy_rows(kc, kb, bs, 0, nmax, Hkv * D, D, kv16);
            copy_rows(vc, vb, bs, 0, nmax, Hkv * D, D, kv16);
            span_rows(s, qs, acc, m, l, R, nr, 0, kcp, vcp, span, D, D, t0, 0, cap);
        } else {
            span_rows(s, qs, acc, m, l, R, nr, 0, kb, vb, bs, Hkv * D, D, t0, 0, cap);
        }
    }
    for (int64_t p = 0; p < P; ++p) end_item(out, acc + p * rep * D, l + p * rep, b + p, ldo, h * rep, D, rep);
}
#endif

// The portable path (any D, no AVX2): the same attention with a softmax step per block and
// libm exponentials (its rows' bits are its own; a process takes one path for every row).
// One K/V element of a float32 or float16 (kv16) cache.
static inline float kv_at(const void *p, int64_t i, int kv16) {
    return kv16 ? fp16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void item_generic(const float *q, const void *k, const void *v, int kv16, float *out,
                         const int32_t *table, int32_t L, int64_t b, int64_t h, int64_t ldq,
                         int64_t ldo, int64_t qh0, int64_t Hkv, int64_t D, int64_t bs,
                         int64_t rep, float scale, int64_t first, float cap) {
    float qs[MAX_REP * MAX_D];
    float acc[MAX_REP * MAX_D];
    float m[MAX_REP], l[MAX_REP];
    float s[MAX_REP][MAX_BS + 8];
    begin_item(q, qs, acc, m, l, b, ldq, qh0, D, rep, scale);
    for (int64_t t0 = first / bs * bs; t0 < L; t0 += bs) {
        const int64_t n = (L - t0) < bs ? (L - t0) : bs;
        const int64_t base = ((int64_t)table[t0 / bs] * bs) * Hkv + h;
        const int64_t j0 = t0 < first ? first - t0 : 0;
        for (int64_t j = j0; j < n; ++j) {
            const int64_t kj = (base + j * Hkv) * D;
            for (int64_t r = 0; r < rep; ++r) {
                float dot = 0.f;
                for (int64_t d = 0; d < D; ++d) dot += qs[r * D + d] * kv_at(k, kj + d, kv16);
                s[r][j] = dot;
            }
        }
        fix_scores(s, rep, n, t0, first, cap);
        // online softmax: rescale what we have once per block, not per token
        for (int64_t r = 0; r < rep; ++r) {
            float mx = m[r];
            for (int64_t j = 0; j < n; ++j) mx = s[r][j] > mx ? s[r][j] : mx;
            const float corr = expf(m[r] - mx);
            l[r] *= corr;
            for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= corr;
            for (int64_t j = 0; j < n; ++j) {
                s[r][j] = expf(s[r][j] - mx);
                l[r] += s[r][j];
            }
            m[r] = mx;
        }
        for (int64_t j = j0; j < n; ++j) {
            const int64_t vj = (base + j * Hkv) * D;
            for (int64_t r = 0; r < rep; ++r) {
                const float p = s[r][j];
                for (int64_t d = 0; d < D; ++d) acc[r * D + d] += p * kv_at(v, vj + d, kv16);
            }
        }
    }
    end_item(out, acc, l, b, ldo, qh0, D, rep);
}

// One item through the fastest path for D.
static void pd_item(const float *q, const void *k, const void *v, int kv16, float *out,
                    const int32_t *table, int32_t L, int64_t b, int64_t h, int64_t ldq,
                    int64_t ldo, int64_t qh0, int64_t Hkv, int64_t D, int64_t bs, int64_t rep,
                    float scale, int64_t window, float cap) {
    const int64_t first = window > 0 && L > window ? L - window : 0;
#ifdef KV_AVX2
    if (D == 64) {
        item_avx2(q, k, v, kv16, out, table, L, b, h, ldq, ldo, qh0, Hkv, 64, bs, rep, scale, first, cap);
        return;
    }
    if (D == 128) {
        item_avx2(q, k, v, kv16, out, table, L, b, h, ldq, ldo, qh0, Hkv, 128, bs, rep, scale, first, cap);
        return;
    }
    if (D % 8 == 0) {
        item_avx2(q, k, v, kv16, out, table, L, b, h, ldq, ldo, qh0, Hkv, D, bs, rep, scale, first, cap);
        return;
    }
#endif
    item_generic(q, k, v, kv16, out, table, L, b, h, ldq, ldo, qh0, Hkv, D, bs, rep, scale, first, cap);
}

// Rows b .. b+P-1 of one stream (plan_tiles) against kv head h: one tile where it can
// (AVX2, no window), else row by row; either way each row gives pd_item's bits.
static void pd_tile(const float *q, const void *k, const void *v, int kv16, float *out,
                    const int32_t *table, int32_t L0, int64_t P, int64_t b, int64_t h,
                    int64_t ldq, int64_t ldo, int64_t Hkv, int64_t D, int64_t bs, int64_t rep,
                    float scale, int64_t window, float cap) {
#ifdef KV_AVX2
    if (P > 1 && window == 0 && D % 8 == 0) {
        if (D == 64) tile_avx2(q, k, v, kv16, out, table, L0, P, b, h, ldq, ldo, Hkv, 64, bs, rep, scale, cap);
        else if (D == 128) tile_avx2(q, k, v, kv16, out, table, L0, P, b, h, ldq, ldo, Hkv, 128, bs, rep, scale, cap);
        else tile_avx2(q, k, v, kv16, out, table, L0, P, b, h, ldq, ldo, Hkv, D, bs, rep, scale, cap);
        return;
    }
#endif
    for (int64_t p = 0; p < P; ++p)
        pd_item(q, k, v, kv16, out, table, L0 + (int32_t)p, b + p, h, ldq, ldo, h * rep, Hkv, D, bs, rep,
                scale, window, cap);
}

enum { PD_TILE_MAX = 8 };

// Tiles of consecutive rows that are one stream's consecutive positions (a prompt chunk,
// a verify step): each row one longer than the one before, over the same blocks. A tile
// reads its last row's table. starts[0 .. n] (n + 1 entries, starts[n] = B); returns n.
static int64_t pd_plan_tiles(const int32_t *tables, int64_t max_blocks, const int32_t *lens,
                             int64_t B, int64_t bs, int64_t rep, int64_t *starts) {
    const int64_t cap = MAX_REP / rep < PD_TILE_MAX ? MAX_REP / rep : PD_TILE_MAX;
    int64_t n = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int join = n > 0 && b - starts[n - 1] < cap && lens[b] == lens[b - 1] + 1 &&
                         !memcmp(tables + b * max_blocks, tables + (b - 1) * max_blocks,
                                 sizeof(int32_t) * (size_t)((lens[b - 1] + bs - 1) / bs));
        if (!join) starts[n++] = b;
    }
    starts[n] = B;
    return n;
}

// Whether a float16 cache's spans fit the buffers they are widened into (every geometry
// of a float32 cache is taken); attention_torch.kernel_reads_kv asks it too.
int pd_kv16_fits(int64_t bs, int64_t D) {
#ifdef KV_AVX2
    if (D % 8 == 0) return span_keys(bs, D) * D <= KV_COPY;
#endif
    (void)bs;
    (void)D;
    return 1;
}

// q, out: [B, Hq, D]; k, v: [num_blocks, bs, Hkv, D], float32 or float16 (kv16); tables:
// [B, max_blocks] int32; window: keys a query sees, itself included (0: all); cap: score
// soft-cap (0: none)
static int pd_run(const float *q, const void *k, const void *v, int kv16, float *out,
                  const int32_t *tables, const int32_t *seq_lens, int64_t B, int64_t max_blocks,
                  int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t window,
                  float cap, int n_threads) {
    if (Hq % Hkv || Hq / Hkv > MAX_REP || D > MAX_D || bs > MAX_BS) return -1;
    if (kv16 && !pd_kv16_fits(bs, D)) return -1;
    const int64_t rep = Hq / Hkv;
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (starts == NULL) return -2;
    const int64_t tiles = pd_plan_tiles(tables, max_blocks, seq_lens, B, bs, rep, starts);
    const int64_t items = tiles * Hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t t = it / Hkv, h = it % Hkv, b = starts[t], P = starts[t + 1] - b;
        pd_tile(q, k, v, kv16, out, tables + (b + P - 1) * max_blocks, seq_lens[b], P, b, h, Hq * D,
                Hq * D, Hkv, D, bs, rep, scale, window, cap);
    }
    free(starts);
    return 0;
}

int paged_decode_f32(const float *q, const float *k, const float *v, float *out,
                     const int32_t *tables, const int32_t *seq_lens, int64_t B,
                     int64_t max_blocks, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                     float scale, int64_t window, float cap, int n_threads) {
    return pd_run(q, k, v, 0, out, tables, seq_lens, B, max_blocks, Hq, Hkv, D, bs, scale, window, cap,
                  n_threads);
}

// The same over a float16 cache: each row's bits are paged_decode_f32's over the cache
// widened to float32.
int paged_decode_f16(const float *q, const uint16_t *k, const uint16_t *v, float *out,
                     const int32_t *tables, const int32_t *seq_lens, int64_t B,
                     int64_t max_blocks, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                     float scale, int64_t window, float cap, int n_threads) {
    return pd_run(q, k, v, 1, out, tables, seq_lens, B, max_blocks, Hq, Hkv, D, bs, scale, window, cap,
                  n_threads);
}
