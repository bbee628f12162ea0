// A whole decode step of a dense decoder on the CPU in one OpenMP parallel region.
//
// Run op by op from Python, a decode step of a small model is mostly dispatch and thread
// wake-ups: ~25 torch calls and 5 parallel regions per layer, each region ending in a
// barrier. Here every layer is seven phases separated by barriers of one region, and work
// that needs no barrier is fused into the phase that produces its input: RoPE, q/k norms
// and the KV-cache write into the QKV matmul (split by heads), the activation's
// quantization into attention (split by heads) and into the gate/up matmul (split by
// column pairs), SiLU/GELU into gate/up.
//
// Phases of layer l (rows: tokens split over threads; cols: output features):
//   P1 rows  x += delta(l-1) [post-norm]; h = norm(x); quantize h -> A
//   P2 cols  qkv = A @ Wqkv (whole heads) + bias; q/k norm; RoPE; K, V -> cache
//   P3 items attention per (stream, kv head) or (stream, query head); quantize -> Bq
//   P4 cols  o = Bq @ Wo
//   P5 rows  [post-norm] x += o; h = norm(x); quantize h -> A
//   P6 cols  gate|up = A @ Wgu (the same 32-column units of gate and up); act(gate) * up;
//            quantize -> Bq
//   P7 cols  delta = Bq @ Wdown
// then the logits rows: h = norm(x + delta), logits = h @ Whead.
//
// `exact` keeps the activations in float32 (csrc/qgemv.c's kernel, Q4_0/Q4_1/Q8_0 only);
// otherwise they are quantized to 8 bits per 32-block (csrc/qgemm.c) for every matmul.
#include "qgemm.c"
#include "qgemv.c"
#include "paged_decode.c"

typedef struct ds_lin {
    const void *w;        // raw ggml rows [N, row_bytes]
    const float *bias;    // [N] or NULL
    int64_t N, K, row_bytes, qtype;
    const void *wp;       // w repacked for the few-row path (qgemm_pack), or NULL
    // n_parts > 0: the rows are these linears' one after another (a fused q|k|v whose parts
    // have different types, as llama.cpp's K-quant mixes give attn_v a wider type); w unused
    const struct ds_lin *parts;
    int64_t n_parts;
} ds_lin;

typedef struct {
    ds_lin qkv, o, gate_up, down;
    // norm weights (Gemma's 1 + w already added); NULL where the family has none
    const float *in_norm, *post_attn_norm, *pre_mlp_norm, *post_mlp_norm, *q_norm, *k_norm;
    void *k_cache, *v_cache;  // [blocks * block_size, hkv, d], float32 or float16 (kv16)
    const float *cos, *sin;    // [positions, rot]
    float scale, softcap;      // softcap 0: none
    int64_t window, rot, act;  // window 0: none; act 0 SiLU, 1 tanh-GELU
} ds_layer;

typedef struct {
    int64_t n_layers, hidden, hq, hkv, d, inter, bs, exact;
    float eps, pad_;
    const float *final_norm;
    ds_lin head;
    const ds_layer *layers;
    int64_t all_packed;  // every linear has its repacked copy: row-major at every row count
    int64_t kv16;        // the KV cache holds float16
} ds_model;

// ---------------------------------------------------------------------------------------
#ifdef QG_AVX2
static inline float ds_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static void ds_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    float ss = 0.f;
    int64_t i = 0;
#ifdef QG_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = ds_hsum(acc);
#endif
    for (; i < n; ++i) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

static void ds_rope(float *p, const float *cos, const float *sin, int64_t pos, int64_t rot) {
    const int64_t half = rot / 2;
    const float *c = cos + pos * rot, *s = sin + pos * rot;
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = p[i], x2 = p[i + half];
        p[i] = x1 * c[i] - x2 * s[i];
        p[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}

// out[j] = act(gate[j]) * up[j]
static void ds_act(float *out, const float *gate, const float *up, int64_t n, int64_t act) {
    int64_t j = 0;
#ifdef KV_W512
    {  // 16 lanes, each lane's operations those of the 8-lane loop below: the same bits
        // (AVX512F alone: bitwise float operations through the integer forms)
#define DS_OR16(a, b) _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)))
#define DS_AND16(a, b) _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)))
        const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
        for (; j + 16 <= n; j += 16) {
            const __m512 g = _mm512_loadu_ps(gate + j);
            __m512 y;
            if (act == 0) {
                const __m512 e = exp_neg16(DS_OR16(g, sign));
                const __mmask16 neg = _mm512_cmplt_epi32_mask(_mm512_castps_si512(g), _mm512_setzero_si512());
                const __m512 num = _mm512_mask_blend_ps(neg, one, e);
                y = _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e)));
            } else {
                const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                               _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g),
                                                               _mm512_mul_ps(g, g), g));
                const __m512 e = exp_neg16(_mm512_mul_ps(_mm512_set1_ps(2.f), DS_OR16(u, sign)));
                __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
                t = DS_OR16(t, DS_AND16(u, sign));
                y = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, t));
            }
            _mm512_storeu_ps(out + j, _mm512_mul_ps(y, _mm512_loadu_ps(up + j)));
        }
#undef DS_OR16
#undef DS_AND16
    }
#endif
#ifdef KV_AVX2
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; j + 8 <= n; j += 8) {
        const __m256 g = _mm256_loadu_ps(gate + j);
        __m256 y;
        if (act == 0) {  // g * sigmoid(g), sigmoid from e = exp(-|g|) <= 1: 1 / (1 + e) for
            // g >= 0, e / (1 + e) below (one division, the numerator picked by g's sign)
            const __m256 e = exp_neg(_mm256_or_ps(g, sign));
            const __m256 num = _mm256_blendv_ps(one, e, g);
            y = _mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(one, e)));
        } else {  // 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh from exp(-2|u|)
            const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                           _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g),
                                                           _mm256_mul_ps(g, g), g));
            const __m256 e = exp_neg(_mm256_mul_ps(_mm256_set1_ps(2.f), _mm256_or_ps(u, sign)));
            __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
            t = _mm256_or_ps(t, _mm256_and_ps(u, sign));  // tanh(|u|) with u's sign
            y = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
        }
        _mm256_storeu_ps(out + j, _mm256_mul_ps(y, _mm256_loadu_ps(up + j)));
    }
#endif
    for (; j < n; ++j) {
        const float g = gate[j];
        float y;
        if (act == 0) {
            y = g / (1.f + expf(-g));
        } else {
            y = 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        }
        out[j] = y * up[j];
    }
}

// Output rows [n0, n1) of a linear for M activation rows: int8 from `a`, or exact from the
// float rows xf (stride ldx).
static void ds_mm(const ds_model *md, const ds_lin *L, int64_t n0, int64_t n1, const qg_act *a,
                  const float *xf, int64_t ldx, int64_t M, float *out, int64_t ldo) {
    if (n0 >= n1) return;
    if (L->n_parts) {  // each part's rows of [n0, n1), into its columns of out
        for (int64_t i = 0, off = 0; i < L->n_parts; off += L->parts[i].N, ++i) {
            const int64_t a0 = n0 > off ? n0 : off, e = off + L->parts[i].N, a1 = n1 < e ? n1 : e;
            ds_mm(md, &L->parts[i], a0 - off, a1 - off, a, xf, ldx, M, out + off, ldo);
        }
    } else if (!md->exact) {
        qg_rows((int)L->qtype, (const uint8_t *)L->w, (const uint8_t *)L->wp, n0, n1, L->row_bytes, a, out, ldo);
    } else {
        const int bb = block_bytes((int)L->qtype);
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t *row = (const uint8_t *)L->w + n * L->row_bytes;
            for (int64_t m0 = 0; m0 < M; m0 += MAX_MB) {
                const int mb = (int)(M - m0 < MAX_MB ? M - m0 : MAX_MB);
                row_dot_any((int)L->qtype, row, L->K / QK, bb, xf + m0 * ldx, ldx, out + m0 * ldo + n, ldo, mb);
            }
        }
    }
    if (L->bias)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = n0; n < n1; ++n) out[m * ldo + n] += L->bias[n];
}

static inline int64_t ds_part(int64_t n, int t, int T) { return n * t / T; }

static int64_t ds_align(int64_t v) { return (v + 63) & ~(int64_t)63; }

typedef struct {
    float *h, *qkv, *att, *tmp, *actf;
    void *abuf, *bbuf;
    int64_t *tiles;  // pd_plan_tiles' starts
} ds_scratch;

static int64_t ds_kmax(const ds_model *md) {
    int64_t k = md->hidden > md->hq * md->d ? md->hidden : md->hq * md->d;
    return k > md->inter ? k : md->inter;
}

static int64_t ds_layout(const ds_model *md, int64_t B, void *base, ds_scratch *s) {
    const int64_t nqkv = md->layers[0].qkv.N;
    const int64_t wide = 2 * md->inter > md->hidden ? 2 * md->inter : md->hidden;
    const int64_t sizes[8] = {
        B * md->hidden * 4, B * nqkv * 4, B * md->hq * md->d * 4, B * wide * 4, B * md->inter * 4,
        qg_act_bytes(B, ds_kmax(md)), qg_act_bytes(B, ds_kmax(md)), (B + 1) * 8,
    };
    char *p = (char *)base;
    int64_t off = 64;  // room to align the base
    void *ptrs[8];
    for (int i = 0; i < 8; ++i) {
        ptrs[i] = p == NULL ? NULL : (void *)(((uintptr_t)p + off + 63) & ~(uintptr_t)63);
        off += ds_align(sizes[i]) + 64;
    }
    if (s != NULL) {
        s->h = ptrs[0];
        s->qkv = ptrs[1];
        s->att = ptrs[2];
        s->tmp = ptrs[3];
        s->actf = ptrs[4];
        s->abuf = ptrs[5];
        s->bbuf = ptrs[6];
        s->tiles = ptrs[7];
    }
    return off;
}

// A new token's K or V row (d a multiple of 8) into the cache at element `off`: float16
// rounded to nearest even, as torch's .half() rounds (the op-by-op path's cache writes).
static inline void ds_put_kv(void *cache, int64_t off, const float *p, int64_t d, int kv16) {
    if (!kv16) {
        memcpy((float *)cache + off, p, d * 4);
        return;
    }
    uint16_t *o = (uint16_t *)cache + off;
#ifdef QG_AVX2  // (with F16C)
    for (int64_t c = 0; c < d; c += 8)
        _mm_storeu_si128((__m128i *)(o + c), _mm256_cvtps_ph(_mm256_loadu_ps(p + c), _MM_FROUND_TO_NEAREST_INT));
#else
    for (int64_t c = 0; c < d; ++c) o[c] = f32_to_fp16(p[c]);
#endif
}

// n floats rounded to float16 by the step's cache write (tests: torch's rounding, every build).
void ds_kv_half(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i + 8 <= n; i += 8) ds_put_kv(out, i, x + i, 8, 1);
}

int64_t decode_step_scratch_bytes(const ds_model *md, int64_t B) { return ds_layout(md, B, NULL, NULL); }

// x: [B, hidden] the residual stream (the embeddings; overwritten); pos, slots: [B] int64;
// tables: [B, max_blocks] int32; lens: [B] int32 (the keys each stream attends, itself
// included); rows: [R] int64, the rows of x whose logits are wanted; logits: [R, vocab].
// Returns 0, or -1 for a geometry the kernels do not take.
int decode_step(const ds_model *md, float *x, int64_t B, const int64_t *pos, const int64_t *slots,
                const int32_t *tables, int64_t max_blocks, const int32_t *lens, const int64_t *rows,
                int64_t R, float *logits, void *scratch, int n_threads) {
    const int64_t H = md->hidden, hq = md->hq, hkv = md->hkv, d = md->d, I = md->inter;
    if (hq % hkv || hq / hkv > MAX_REP || d > MAX_D || md->bs > MAX_BS || d % QG_QK || I % QG_QK ||
        R > B || (md->kv16 && !pd_kv16_fits(md->bs, d)))
        return -1;
    ds_scratch s;
    ds_layout(md, B, scratch, &s);
    const int64_t nqkv = md->layers[0].qkv.N, rep = hq / hkv, ad = hq * d;
    const int exact = (int)md->exact, kv16 = (int)md->kv16;
    qg_act A, Bq;
    // a prompt chunk's (or verify step's) rows attend in tiles of consecutive positions
    const int64_t ntiles = pd_plan_tiles(tables, max_blocks, lens, B, md->bs, hq / hkv, s.tiles);
    // rows the quantizers fill: the interleaved layout pads the last group with zero rows
    const int64_t imin = md->all_packed ? QG_PACKED_INTER_MIN : QG_INTER_MIN;
    const int64_t Bp = B >= imin ? (B + 7) / 8 * 8 : B;
#pragma omp parallel num_threads(n_threads)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        T = omp_get_num_threads();
#endif
        const int64_t r0 = ds_part(Bp, t, T), r1 = ds_part(Bp, t + 1, T);
        if (t == 0) qg_act_init(&A, s.abuf, B, H, imin);
#pragma omp barrier
        for (int64_t l = 0; l < md->n_layers; ++l) {
            const ds_layer *ly = md->layers + l;
            const ds_layer *prev = l > 0 ? ly - 1 : NULL;
            // P1
            for (int64_t m = r0; m < r1; ++m) {
                if (m >= B) {
                    if (!exact) qg_quantize_rows(&A, NULL, 0, m, m + 1);
                    continue;
                }
                float *xm = x + m * H, *hm = s.h + m * H;
                if (prev != NULL) {
                    float *dm = s.tmp + m * H;
                    if (prev->post_mlp_norm) ds_rmsnorm(dm, dm, prev->post_mlp_norm, H, md->eps);
                    for (int64_t i = 0; i < H; ++i) xm[i] += dm[i];
                }
                ds_rmsnorm(hm, xm, ly->in_norm, H, md->eps);
                if (!exact) qg_quantize_rows(&A, s.h, H, m, m + 1);
            }
#pragma omp barrier
            // P2: whole heads of q, k, v
            {
                const int64_t units = nqkv / d, u0 = ds_part(units, t, T), u1 = ds_part(units, t + 1, T);
                ds_mm(md, &ly->qkv, u0 * d, u1 * d, &A, s.h, H, B, s.qkv, nqkv);
                for (int64_t u = u0; u < u1; ++u) {
                    for (int64_t m = 0; m < B; ++m) {
                        float *p = s.qkv + m * nqkv + u * d;
                        if (u < hq + hkv) {
                            const float *nw = u < hq ? ly->q_norm : ly->k_norm;
                            if (nw) ds_rmsnorm(p, p, nw, d, md->eps);
                            ds_rope(p, ly->cos, ly->sin, pos[m], ly->rot);
                            if (u >= hq) ds_put_kv(ly->k_cache, (slots[m] * hkv + (u - hq)) * d, p, d, kv16);
                        } else {
                            ds_put_kv(ly->v_cache, (slots[m] * hkv + (u - hq - hkv)) * d, p, d, kv16);
                        }
                    }
                }
                if (t == 0) qg_act_init(&Bq, s.bbuf, B, ad, imin);
            }
#pragma omp barrier
            // P3: attention; a stream's few KV heads split by query head when there are
            // fewer items than threads to keep busy
            {
                const int fine = B * hkv < 2 * T;
                const int64_t tile_items = fine ? 0 : ntiles * hkv, head_items = fine ? B * hq : 0;
#pragma omp for schedule(dynamic, 1) nowait
                for (int64_t it = 0; it < tile_items; ++it) {
                    const int64_t tl = it / hkv, h = it % hkv, b0 = s.tiles[tl], P = s.tiles[tl + 1] - b0;
                    pd_tile(s.qkv, ly->k_cache, ly->v_cache, kv16, s.att, tables + (b0 + P - 1) * max_blocks,
                            lens[b0], P, b0, h, nqkv, ad, hkv, d, md->bs, rep, ly->scale, ly->window,
                            ly->softcap);
                    if (!exact)
                        for (int64_t b = b0; b < b0 + P; ++b)
                            for (int64_t blk = h * rep * d / QG_QK; blk < (h + 1) * rep * d / QG_QK; ++blk)
                                qg_quantize_block(&Bq, s.att + b * ad + blk * QG_QK, b, blk);
                }
#pragma omp for schedule(dynamic, 1) nowait
                for (int64_t it = 0; it < head_items; ++it) {
                    const int64_t b = it / hq, qh = it % hq;
                    pd_item(s.qkv, ly->k_cache, ly->v_cache, kv16, s.att, tables + b * max_blocks, lens[b], b,
                            qh / rep, nqkv, ad, qh, hkv, d, md->bs, 1, ly->scale, ly->window,
                            ly->softcap);
                    if (!exact)
                        for (int64_t blk = qh * d / QG_QK; blk < (qh + 1) * d / QG_QK; ++blk)
                            qg_quantize_block(&Bq, s.att + b * ad + blk * QG_QK, b, blk);
                }
                if (!exact)
                    for (int64_t m = B + t; m < Bp; m += T) qg_quantize_rows(&Bq, NULL, 0, m, m + 1);
            }
#pragma omp barrier
            // P4
            ds_mm(md, &ly->o, qg_share(H, t, T), qg_share(H, t + 1, T), &Bq, s.att, ad, B, s.tmp, H);
#pragma omp barrier
            // P5
            for (int64_t m = r0; m < r1; ++m) {
                if (m >= B) {
                    if (!exact) qg_quantize_rows(&A, NULL, 0, m, m + 1);
                    continue;
                }
                float *xm = x + m * H, *om = s.tmp + m * H;
                if (ly->post_attn_norm) ds_rmsnorm(om, om, ly->post_attn_norm, H, md->eps);
                for (int64_t i = 0; i < H; ++i) xm[i] += om[i];
                ds_rmsnorm(s.h + m * H, xm, ly->pre_mlp_norm, H, md->eps);
                if (!exact) qg_quantize_rows(&A, s.h, H, m, m + 1);
            }
            if (t == 0) qg_act_init(&Bq, s.bbuf, B, I, imin);
#pragma omp barrier
            // P6: gate and up over the same 32-column units
            {
                const int64_t units = I / QG_QK, u0 = ds_part(units, t, T), u1 = ds_part(units, t + 1, T);
                const int64_t c0 = u0 * QG_QK, c1 = u1 * QG_QK;
                ds_mm(md, &ly->gate_up, c0, c1, &A, s.h, H, B, s.tmp, 2 * I);
                ds_mm(md, &ly->gate_up, I + c0, I + c1, &A, s.h, H, B, s.tmp, 2 * I);
                for (int64_t m = 0; m < Bp; ++m) {
                    if (m >= B) {
                        if (!exact)
                            for (int64_t u = u0; u < u1; ++u) qg_quantize_block(&Bq, NULL, m, u);
                        continue;
                    }
                    float *am = s.actf + m * I;
                    ds_act(am + c0, s.tmp + m * 2 * I + c0, s.tmp + m * 2 * I + I + c0, c1 - c0, ly->act);
                    if (!exact) qg_quantize_run(&Bq, am + u0 * QG_QK, m, u0, u1);
                }
            }
#pragma omp barrier
            // P7
            ds_mm(md, &ly->down, qg_share(H, t, T), qg_share(H, t + 1, T), &Bq, s.actf, I, B, s.tmp, H);
#pragma omp barrier
        }
        // the logits rows
        const ds_layer *last = md->layers + md->n_layers - 1;
        const int64_t Rp = R >= imin ? (R + 7) / 8 * 8 : R;
        if (t == 0) qg_act_init(&A, s.abuf, R, H, imin);
#pragma omp barrier
        for (int64_t i = ds_part(Rp, t, T); i < ds_part(Rp, t + 1, T); ++i) {
            if (i >= R) {
                if (!exact) qg_quantize_rows(&A, NULL, 0, i, i + 1);
                continue;
            }
            const int64_t m = rows[i];
            float *hm = s.h + i * H;
            const float *xm = x + m * H;
            memcpy(hm, s.tmp + m * H, H * 4);  // delta, read only by this phase
            if (last->post_mlp_norm) ds_rmsnorm(hm, hm, last->post_mlp_norm, H, md->eps);
            for (int64_t j = 0; j < H; ++j) hm[j] += xm[j];
            ds_rmsnorm(hm, hm, md->final_norm, H, md->eps);
        }
#pragma omp barrier
        if (!exact)
            for (int64_t i = ds_part(R, t, T); i < ds_part(R, t + 1, T); ++i)
                qg_quantize_rows(&A, s.h, H, i, i + 1);
#pragma omp barrier
        const int64_t V = md->head.N;
        ds_mm(md, &md->head, qg_share(V, t, T), qg_share(V, t + 1, T), &A, s.h, H, R, logits, V);
    }
    return 0;
}

// ---------------------------------------------------------------------------------------
// The step's row operations for the op-by-op forward (prefill and mixed steps), so that a
// decode row gives the same bits in either path (the 8-bit activations would turn the last
// bit of a difference into a different rounding).

// out[r] = norm(x[r]) * w for `rows` rows of n (strides ldx, ldo); in place allowed.
void ds_rms_norm_rows(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo,
                      int64_t rows, int64_t n, float eps, int n_threads) {
#pragma omp parallel for schedule(static) num_threads(n_threads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; ++r) ds_rmsnorm(out + r * ldo, x + r * ldx, w, n, eps);
}

// RoPE in place on `heads` heads of d at each of T tokens (token stride ld), position pos[t].
void ds_rope_rows(float *x, int64_t T, int64_t heads, int64_t ld, int64_t d, const float *cos,
                  const float *sin, const int64_t *pos, int64_t rot, int n_threads) {
#pragma omp parallel for schedule(static) num_threads(n_threads) if (T * heads * d >= 65536)
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < heads; ++h) ds_rope(x + t * ld + h * d, cos, sin, pos[t], rot);
}

// out[t] = act(gu[t, :n]) * gu[t, n:2n] for T rows of gu (stride ld); act 0 SiLU, 1 tanh-GELU.
void ds_act_rows(const float *gu, int64_t T, int64_t n, int64_t ld, float *out, int64_t act,
                 int n_threads) {
#pragma omp parallel for schedule(static) num_threads(n_threads) if (T * n >= 65536)
    for (int64_t t = 0; t < T; ++t) ds_act(out + t * n, gu + t * ld, gu + t * ld + n, n, act);
}
