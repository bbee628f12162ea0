// Paged decode attention on the CPU: one query token per stream, reading the
// stream's KV blocks in place through its block table (no gather, no padding).
// Work items are (stream, kv head) pairs, so GQA query heads that share a KV
// head read it once, and the work per stream follows its own length.
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_REP 32
#define MAX_D 256
#define MAX_BS 256

// q, out: [B, Hq, D]; k, v: [num_blocks, bs, Hkv, D]; tables: [B, max_blocks] int32
int paged_decode_f32(const float *q, const float *k, const float *v, float *out,
                     const int32_t *tables, const int32_t *seq_lens, int64_t B,
                     int64_t max_blocks, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                     float scale, int n_threads) {
    if (Hq % Hkv || Hq / Hkv > MAX_REP || D > MAX_D || bs > MAX_BS) return -1;
    const int64_t rep = Hq / Hkv;
    const int64_t items = B * Hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b = it / Hkv, h = it % Hkv;
        const int32_t L = seq_lens[b];
        const int32_t *table = tables + b * max_blocks;
        float qs[MAX_REP][MAX_D];
        float acc[MAX_REP][MAX_D];
        float m[MAX_REP], l[MAX_REP];
        float s[MAX_REP][MAX_BS];
        for (int64_t r = 0; r < rep; ++r) {
            const float *qr = q + (b * Hq + h * rep + r) * D;
            for (int64_t d = 0; d < D; ++d) qs[r][d] = qr[d] * scale;
            memset(acc[r], 0, sizeof(float) * D);
            m[r] = -INFINITY;
            l[r] = 0.f;
        }
        for (int64_t t0 = 0; t0 < L; t0 += bs) {
            const int64_t n = (L - t0) < bs ? (L - t0) : bs;
            const int64_t base = ((int64_t)table[t0 / bs] * bs) * Hkv + h;
            // scores for this block, every query row
            for (int64_t j = 0; j < n; ++j) {
                const float *kj = k + (base + j * Hkv) * D;
                for (int64_t r = 0; r < rep; ++r) {
                    float dot = 0.f;
                    for (int64_t d = 0; d < D; ++d) dot += qs[r][d] * kj[d];
                    s[r][j] = dot;
                }
            }
            // online softmax: rescale what we have once per block, not per token
            for (int64_t r = 0; r < rep; ++r) {
                float mx = m[r];
                for (int64_t j = 0; j < n; ++j) mx = s[r][j] > mx ? s[r][j] : mx;
                const float corr = expf(m[r] - mx);
                l[r] *= corr;
                for (int64_t d = 0; d < D; ++d) acc[r][d] *= corr;
                for (int64_t j = 0; j < n; ++j) {
                    s[r][j] = expf(s[r][j] - mx);
                    l[r] += s[r][j];
                }
                m[r] = mx;
            }
            for (int64_t j = 0; j < n; ++j) {
                const float *vj = v + (base + j * Hkv) * D;
                for (int64_t r = 0; r < rep; ++r) {
                    const float p = s[r][j];
                    for (int64_t d = 0; d < D; ++d) acc[r][d] += p * vj[d];
                }
            }
        }
        for (int64_t r = 0; r < rep; ++r) {
            float *o = out + (b * Hq + h * rep + r) * D;
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
            for (int64_t d = 0; d < D; ++d) o[d] = acc[r][d] * inv;
        }
    }
    return 0;
}
