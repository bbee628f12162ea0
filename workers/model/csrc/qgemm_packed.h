// The repacked few-row kernel (qgemm.c), included once per vector width: QV_W 8 lanes
// (one group of 8 weight rows, 256-bit vectors) or 16 (two adjacent groups, 512-bit;
// builds with AVX512-VNNI). The QV_* operations are defined by the includer for the width
// and undefined at the end of this file.
// Every lane does the same operations in the same order at either width, so a row's bits
// do not depend on which width ran it.

// The integer dots of one activation row's block (x: its 32 bytes; o0, o1: its Q6_K
// offsets, o16 both over 32 as one word's halves) with the groups' weight rows (lanes), their
// weights unpacked in u (Q8_0: their magnitudes, sg their signs).
static inline __attribute__((always_inline)) QV_I QV_NAME(qg_pk_idot)(const int qtype, const QV_I u[8],
                                                                     const int8_t *x, const QV_SG sg[8],
                                                                     QV_I sc0, QV_I sc1, QV_I sc01, int32_t o0,
                                                                     int32_t o1, int32_t o16) {
    QV_I acc = QV_ZERO();
    if (qtype == QG_Q8_0) {  // |w| against x with w's sign; one pair fills 16 bits
        for (int g = 0; g < 8; ++g) {
            const QV_I sx = QV_SIGN8(QV_BCAST4(x + 4 * g), sg[g]);
#ifdef QG_VNNI
            acc = QV_DPBUSD(acc, u[g], sx);
#else
            acc = QV_ADD32(acc, QV_ACC_I32(QV_MADDUBS(u[g], sx)));
#endif
        }
    } else if (qtype == QG_Q6_K) {  // 2 x 2 products of 6 bits fill 16 bits
        QV_I h[2];
        for (int k = 0; k < 2; ++k) {
            const QV_I sc = k ? sc1 : sc0;
#ifdef QG_VNNI  // the half's sum starts at its offset
            QV_I p = QV_B32(k ? o1 : o0);
            for (int g = 4 * k; g < 4 * k + 4; ++g) p = QV_DPBUSD(p, u[g], QV_BCAST4(x + 4 * g));
            h[k] = QV_MULLO32(p, sc);
#else
            const QV_I p = QV_ADD16(QV_MADDUBS(u[4 * k], QV_BCAST4(x + 16 * k)),
                                    QV_MADDUBS(u[4 * k + 1], QV_BCAST4(x + 16 * k + 4)));
            const QV_I r = QV_ADD16(QV_MADDUBS(u[4 * k + 2], QV_BCAST4(x + 16 * k + 8)),
                                    QV_MADDUBS(u[4 * k + 3], QV_BCAST4(x + 16 * k + 12)));
            h[k] = QV_ADD32(QV_MADD(p, sc), QV_MADD(r, sc));
#endif
        }
        acc = QV_ADD32(h[0], h[1]);
#ifndef QG_VNNI  // both halves' offsets in one madd: 32 (sc0 o0 / 32 + sc1 o1 / 32), exact
        acc = QV_ADD32(acc, QV_SLLI32(QV_MADD(sc01, QV_B32(o16)), 5));
        (void)o0;
        (void)o1;
#else
        (void)sc01;
        (void)o16;
#endif
    } else if (qg_five(qtype)) {  // 4 x 2 products of 5 bits fill 16 bits
        QV_I h1 = QV_ZERO();
        for (int g = 0; g < 4; ++g) {
            acc = QV_ACC_ADD(acc, u[g], QV_BCAST4(x + 4 * g));
            h1 = QV_ACC_ADD(h1, u[g + 4], QV_BCAST4(x + 16 + 4 * g));
        }
        acc = QV_ADD32(QV_ACC_I32(acc), QV_ACC_I32(h1));
    } else {  // 8 x 2 products of 4 bits: within 16 bits
        for (int g = 0; g < 8; ++g) acc = QV_ACC_ADD(acc, u[g], QV_BCAST4(x + 4 * g));
        acc = QV_ACC_I32(acc);
    }
    return acc;
}

// v_b of the lanes (idot: their integer dots; d, s: the activation row's scalars) added into
// their partial sum P (first: P not yet written, its first term).
static inline __attribute__((always_inline)) void QV_NAME(qg_pk_add)(const int qtype, const int first, QV_F *P, QV_I acc,
                                                                    QV_F ws, QV_F coef, float d, float s) {
    QV_F v = QV_MULF(QV_CVTF(acc), QV_MULF(ws, QV_BF(d)));
    if (qg_sum_term(qtype)) v = QV_FMA(coef, QV_BF(s), v);
    *P = QV_ADDF(first ? QV_ZEROF() : *P, v);  // first: P's first term, as 0 + v
}

// Block b of the group at pp (h: which of its pair): the lanes' float factors (ws, coef),
// Q6_K's 16-weight scales (sc0, sc1; without VNNI also both as the halves of one word, sc01)
// and the weights unpacked for the integer dots (u; Q8_0: their magnitudes, sg their signs).
static inline __attribute__((always_inline)) void QV_NAME(qg_pk_block)(const int qtype, const uint8_t *pp,
                                                                      const int h, int64_t b, QV_F *ws,
                                                                      QV_F *coef, QV_I *sc0, QV_I *sc1,
                                                                      QV_I *sc01, QV_I u[8], QV_SG sg[8]) {
    const int64_t blk = 8 * qg_block_bytes(qtype), hdr = qg_pk_hdr(qtype);
    const QV_I m4 = QV_B8(0x0F);
    const QV_F neg = QV_BF(-0.0f);
    // K-quants: a super-block's header, then its slices (qg_pk_kpiece); the others: blocks
    const int64_t khdr = qg_pk_kpiece(qtype, 1), kslice = qg_pk_kpiece(qtype, 0);
    const int64_t sbb = khdr + 8 * kslice;
    *sc0 = *sc1 = *sc01 = QV_ZERO();
    const uint8_t *wq;
    int64_t gs = blk;  // from a piece of the first group to the second's (16 lanes)
    if (qtype == QG_Q6_K || qg_k4like(qtype)) {
        const uint8_t *sp = pp + (b / 8) * sbb * QG_PAIR, *sb = sp + h * khdr;
        const uint8_t *sl = sp + QG_PAIR * khdr + (QG_PAIR * (b % 8) + h) * kslice;
        gs = kslice;
        if (qtype == QG_Q6_K) {  // as qg_scalars: d, the halves' scales
            *ws = QV_PH(sb, khdr);
            *coef = QV_ZEROF();
            *sc0 = QV_I8(sl, kslice);
            *sc1 = QV_I8(sl + 8, kslice);
#ifndef QG_VNNI  // madd's 16-bit factors: the row's scale in both halves of its lane
            *sc01 = QV_OR(QV_AND(*sc0, QV_B32(0xFFFF)), QV_SLLI32(*sc1, 16));
            *sc0 = QV_OR(QV_AND(*sc0, QV_B32(0xFFFF)), QV_SLLI32(*sc0, 16));
            *sc1 = QV_OR(QV_AND(*sc1, QV_B32(0xFFFF)), QV_SLLI32(*sc1, 16));
#endif
        } else {  // as qg_scalars: d * sc, -(dmin * mn)
            const QV_F sc = QV_CVTF(QV_U8(sl, kslice)), mn = QV_CVTF(QV_U8(sl + 8, kslice));
            *ws = QV_MULF(QV_PH(sb, khdr), sc);
            *coef = QV_XORF(QV_MULF(QV_PH(sb + 16, khdr), mn), neg);
        }
        wq = sl + 16;
    } else {
        const uint8_t *p = pp + (b * QG_PAIR + h) * blk;
        *ws = QV_PH(p, blk);
        *coef = qg_min32(qtype)   ? QV_PH(p + 16, blk)
               : qg_off32(qtype) ? QV_MULF(QV_BF((float)-qg_off32(qtype)), *ws)
                                 : QV_ZEROF();
        wq = p + hdr;
    }
    (void)gs;
#if QV_W == 16
    // the pair's bytes 4 KB ahead, as many as this block reads: without, one to 8 rows
    // waited on memory and ran 0.56-1.2x the 256-bit kernel's speed (0.95-1.7x with)
    for (int64_t o = 0; o < 2 * gs; o += 64) _mm_prefetch((const char *)wq + 4096 + o, _MM_HINT_T0);
#endif
    if (qtype == QG_Q8_0) {
        for (int g = 0; g < 8; ++g) {
            const QV_I v = QV_LOADW(wq + 32 * g, gs);
            u[g] = QV_ABS8(v);
            sg[g] = QV_SG_OF(v, wq + 32 * g);
        }
    } else if (qtype == QG_Q6_K) {
        const QV_I m2 = QV_B8(0x03), hq[2] = {QV_LOADW(wq + 128, gs), QV_LOADW(wq + 160, gs)};
        for (int i = 0; i < 4; ++i) {
            const QV_I v = QV_LOADW(wq + 32 * i, gs);
            u[i] = QV_AND(v, m4);
            u[i + 4] = QV_AND(QV_SRLI16(v, 4), m4);
        }
        for (int g = 0; g < 8; ++g) {  // weights 4g..4g+3: bits 2 * (g / 2) of vector g % 2
            const QV_I t = QV_AND(QV_SRLI16(hq[g % 2], 2 * (g / 2)), m2);
            u[g] = QV_OR(u[g], QV_SLLI16(t, 4));
        }
    } else {
        for (int i = 0; i < 4; ++i) {
            const QV_I v = QV_LOADW(wq + 32 * i, gs);
            u[i] = QV_AND(v, m4);
            u[i + 4] = QV_AND(QV_SRLI16(v, 4), m4);
        }
        if (qg_five(qtype)) {  // bit g of the fifth-bit vector: weights 4g..4g+3
            const QV_I hv = QV_LOADW(wq + 128, gs);
            for (int g = 0; g < 8; ++g) u[g] = QV_OR(u[g], QV_BIT_TO4(hv, g));
        }
    }
}

// Weights repacked once at load (qgemm_pack) for the few-row path:
// per 8 consecutive weight rows and block, their 8 scales (f16), Q4_1's 8 mins, then vectors
// whose lane r holds 4 bytes of row r's quants (Q4: 4 vectors, bytes 4h..4h+3 of the
// nibbles, i.e. weights 4h..4h+3 low and 16+4h.. high; Q8_0: 8 vectors, weights 4g..4g+3).
// Q4_K: per super-block the 8 rows' d and dmin, then per 32-weight slice the rows' 6-bit
// scales and mins as bytes (ws = d * sc and coef = -(dmin * mn) are formed as qg_scalars
// forms them) and the slice's weights re-nibbled into Q4's vectors. Q6_K (QG_PK_K6_*): the
// low 4 bits as Q4's vectors, the top 2 in two more, and the rows' 16-weight scales, which
// scale the integer dot's halves per lane.
// Lane r of every vector is then output row n + r (at 16 lanes, lanes 8-15 are the pair's
// second group, whose piece follows the first's: qgemm_pack): each activation row's 4-byte
// slices are broadcast and meet QV_W weight rows per instruction, with no horizontal sums and
// nothing transposed per step. pp: the group's bytes (QG_PAIR 2: its pair's), h: which of
// the pair (0 at 16 lanes).
// Each lane adds v_b into P_{b mod 8} in order of b and ends with the fixed tree: the same
// bits as every other path.
static inline __attribute__((always_inline)) void QV_NAME(qg_rows_packed)(const int qtype, const uint8_t *pp,
                                                                         const int h, const qg_act *a,
                                                                         float *out, int64_t ldo, int64_t n,
                                                                         const int MR) {
    QV_F part[QG_SMALL_MAX][8];
    for (int m = 0; m < MR; ++m)
        for (int j = 0; j < 8; ++j) part[m][j] = QV_ZEROF();
    QV_I idot[QG_SMALL_MAX];  // QG_SPLIT_MIN rows and more: a block's integer dots
    // where row m's block b starts: its bytes at m * qm + b * qb, its floats at m * fm + b * fb
    const int64_t qm = a->blocked ? QG_QK : a->K, qb = a->blocked ? a->M * QG_QK : QG_QK;
    const int64_t fm = a->blocked ? 1 : a->nb, fb = a->blocked ? a->M : 1;
    // the activation's arrays in locals, which the vector stores (may_alias) cannot change
    const float *ad = a->d, *as = a->s;
    const int32_t *ao0 = a->o0, *ao1 = a->o1, *ao16 = a->o16;
    for (int64_t b = 0; b < a->nb; ++b) {
        QV_F ws, coef;
        QV_I sc0, sc1, sc01, u[8];
        QV_SG sg[8];
        QV_NAME(qg_pk_block)(qtype, pp, h, b, &ws, &coef, &sc0, &sc1, &sc01, u, sg);
        // The split below, not for Q8_0 (0.96x) nor at 16 lanes, where a row's 512-bit dots and
        // its float steps' multiplies share two pipes and the split's stores and loads of the
        // dots bought no overlap (without: Q6_K 1.02-1.12x at 4-64 rows, weights streamed from
        // memory; the others level or better)
        if (MR < QG_SPLIT_MIN || qtype == QG_Q8_0 || QV_W == 16) {
            for (int m = 0; m < MR; ++m) {
                const int64_t f = m * fm + b * fb;
                QV_NAME(qg_pk_add)(qtype, 0, &part[m][b % 8],
                                   QV_NAME(qg_pk_idot)(qtype, u, a->q + m * qm + b * qb, sg, sc0, sc1, sc01, ao0[f],
                                                       ao1[f], ao16[f]),
                                   ws, coef, ad[f], as[f]);
            }
            continue;
        }
        // Every row's integer dots, then every row's float steps: two short chains a row
        // instead of one long one, so more rows are in flight (on an AVX2 host 1.1-1.2x at
        // 64-512 rows, 1.05-1.3x at 4-48 with the weights streamed from memory by 2 threads
        // as decode reads them; at 2-3 rows no faster).
        for (int m = 0; m < MR; ++m)
            idot[m] = QV_NAME(qg_pk_idot)(qtype, u, a->q + m * qm + b * qb, sg, sc0, sc1, sc01, ao0[m * fm + b * fb],
                                          ao1[m * fm + b * fb], ao16[m * fm + b * fb]);
        for (int m = 0; m < MR; ++m)
            QV_NAME(qg_pk_add)(qtype, 0, &part[m][b % 8], idot[m], ws, coef, ad[m * fm + b * fb],
                               as[m * fm + b * fb]);
    }
    for (int m = 0; m < MR; ++m) {
        const QV_F *P = part[m];
        QV_STOREF(out + m * ldo + n, QV_ADDF(QV_ADDF(QV_ADDF(P[0], P[1]), QV_ADDF(P[2], P[3])),
                                             QV_ADDF(QV_ADDF(P[4], P[5]), QV_ADDF(P[6], P[7]))));
    }
}

#if QV_W == 16
// The integer dots of one activation row's block (x; o0, o1: its Q6_K offsets) with two
// pairs' weights (u0, u1; not Q8_0): as qg_pk_idot's for each, every broadcast of x meeting
// both.
static inline __attribute__((always_inline)) void QV_NAME(qg_pk_idot2)(const int qtype, const QV_I u0[8],
                                                                      const QV_I u1[8], const int8_t *x,
                                                                      const QV_I sc[4], int32_t o0, int32_t o1,
                                                                      QV_I acc[2]) {
    QV_I a0 = QV_ZERO(), a1 = QV_ZERO(), b0 = QV_ZERO(), b1 = QV_ZERO();
    if (qtype == QG_Q6_K) {  // its halves' sums start at their offsets
        a0 = a1 = QV_B32(o0);
        b0 = b1 = QV_B32(o1);
    }
    for (int g = 0; g < 8; ++g) {  // a: weights 0-15, b: 16-31 (Q6_K: its halves; 5 bits: h1)
        const QV_I bx = QV_BCAST4(x + 4 * g);
        if (g < 4 || qtype == QG_Q4_0 || qtype == QG_Q4_1 || qtype == QG_Q4_K) {
            a0 = QV_DPBUSD(a0, u0[g], bx);
            a1 = QV_DPBUSD(a1, u1[g], bx);
        } else {
            b0 = QV_DPBUSD(b0, u0[g], bx);
            b1 = QV_DPBUSD(b1, u1[g], bx);
        }
    }
    if (qtype == QG_Q6_K) {
        acc[0] = QV_ADD32(QV_MULLO32(a0, sc[0]), QV_MULLO32(b0, sc[1]));
        acc[1] = QV_ADD32(QV_MULLO32(a1, sc[2]), QV_MULLO32(b1, sc[3]));
    } else {
        acc[0] = QV_ADD32(a0, b0);
        acc[1] = QV_ADD32(a1, b1);
    }
}

// qg_rows_packed for two pairs of groups at once (pp and the next pair's bytes, output rows
// n .. n + 31; qg_quad): each broadcast of an activation row's bytes meets 32 weight rows
// (prompt passes were bound by the broadcasts' loads and the multiplies beside them). Each
// lane's operations and order are qg_rows_packed's: the same bits. MR: at most
// QG_QUAD_ROWS rows. A row's integer dots go straight into its float steps: storing every
// row's dots and reading them back for the float steps (qg_rows_packed's split) cost this
// kernel 1.07-1.10x (Q5_K, Q6_K) at 512 rows, where its 512-bit dots and the float steps'
// multiplies share two pipes and the stores and loads bought no overlap.
static inline __attribute__((always_inline)) void QV_NAME(qg_rows_quad)(const int qtype, const uint8_t *pp,
                                                                       const qg_act *a, float *out,
                                                                       int64_t ldo, int64_t n, const int MR) {
    const int64_t row_bytes = a->K / qg_block_size(qtype) * qg_block_bytes(qtype);
    const uint8_t *pp1 = pp + (int64_t)QG_PAIR * 8 * qg_pk_row_bytes(qtype, a->K, row_bytes);
    // P_j of row m's pair p at part[j * ps + 2 * m + p]: a block's sums are one run of bytes
    // (as [m][j] they fell in 8 of L1's 64 sets), the runs no multiple of 4 KB apart (a store
    // to one and a load from the next looked dependent). A sum starts at its first block's
    // value (0 + v_b, no load: zeroing the sums a call cost 4% of a prompt's matmuls).
    const int ps = 2 * MR + 1;
    QV_F part[8 * (2 * QG_QUAD_ROWS + 1)];
    for (int j = (int)(a->nb < 8 ? a->nb : 8); j < 8; ++j)  // (sums no block adds to)
        for (int i = 0; i < 2 * MR; ++i) part[j * ps + i] = QV_ZEROF();
    const int64_t qm = a->blocked ? QG_QK : a->K, qb = a->blocked ? a->M * QG_QK : QG_QK;
    const int64_t fm = a->blocked ? 1 : a->nb, fb = a->blocked ? a->M : 1;
    const float *ad = a->d, *as = a->s;  // (as qg_rows_packed)
    const int32_t *ao0 = a->o0, *ao1 = a->o1;
    for (int64_t b = 0; b < a->nb; ++b) {
        QV_F ws[2], coef[2];
        QV_I sc[4], sc01, u0[8], u1[8];  // (sc01: builds without VNNI, which have no quad)
        QV_SG sg[8];
        QV_NAME(qg_pk_block)(qtype, pp, 0, b, &ws[0], &coef[0], &sc[0], &sc[1], &sc01, u0, sg);
        QV_NAME(qg_pk_block)(qtype, pp1, 0, b, &ws[1], &coef[1], &sc[2], &sc[3], &sc01, u1, sg);
        QV_F *pb = part + (b % 8) * ps;
        const int first = b < 8;
        for (int m = 0; m < MR; ++m) {
            const int64_t f = m * fm + b * fb;
            QV_I acc[2];
            QV_NAME(qg_pk_idot2)(qtype, u0, u1, a->q + m * qm + b * qb, sc, ao0[f], ao1[f], acc);
            for (int p = 0; p < 2; ++p)
                QV_NAME(qg_pk_add)(qtype, first, pb + 2 * m + p, acc[p], ws[p], coef[p], ad[f], as[f]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int p = 0; p < 2; ++p) {
            const QV_F *P = part + 2 * m + p;
            QV_STOREF(out + m * ldo + n + 16 * p,
                      QV_ADDF(QV_ADDF(QV_ADDF(P[0], P[ps]), QV_ADDF(P[2 * ps], P[3 * ps])),
                              QV_ADDF(QV_ADDF(P[4 * ps], P[5 * ps]), QV_ADDF(P[6 * ps], P[7 * ps]))));
        }
}
#endif

#undef QV_W
#undef QV_I
#undef QV_F
#undef QV_ZERO
#undef QV_ZEROF
#undef QV_B8
#undef QV_B32
#undef QV_BF
#undef QV_AND
#undef QV_OR
#undef QV_SRLI16
#undef QV_SLLI16
#undef QV_SLLI32
#undef QV_ABS8
#undef QV_ADD16
#undef QV_ADD32
#undef QV_MULLO32
#undef QV_MADDUBS
#undef QV_MADD
#undef QV_DPBUSD
#undef QV_ACC_ADD
#undef QV_ACC_I32
#undef QV_SG
#undef QV_SG_OF
#undef QV_SIGN8
#undef QV_BIT_TO4
#undef QV_BCAST4
#undef QV_LOADW
#undef QV_PH
#undef QV_U8
#undef QV_I8
#undef QV_CVTF
#undef QV_MULF
#undef QV_FMA
#undef QV_ADDF
#undef QV_XORF
#undef QV_STOREF
