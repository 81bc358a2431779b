/* onnxkv/_kernels/attention_impl.h -- body of one attention work unit.
 *
 * Included twice by attention.h: once with OKV_SFX = _scalar and once (x86)
 * with OKV_SFX = _avx2 and OKV_ATTR = the avx2/fma/f16c target attribute, so
 * the primitives inline into a single function per instruction set.
 *
 * A work unit is (batch b, kv head hk, query tokens [t0, t1), keys [c0, c1)).
 * The G = Hq/Hkv query heads of the group and the nt = t1-t0 query tokens form
 * R = G*nt rows; keys are streamed in blocks of OKV_BK, each K/V block is read
 * from memory once and used by all R rows (online softmax per row).  Within a
 * block, heads g and g+1 of the same token see the same keys and are scored /
 * accumulated together so that each K/V vector load feeds two rows.
 *
 * ws: float workspace of at least R*(D + OKV_BK + 2) floats.
 * part == NULL: normalise and write out[b, hk*G+g, t, :].
 * part != NULL: write the unnormalised partial state per row as
 *               part[r*(D+2) + 0] = running max, [1] = sum, [2..] = acc.
 */
#define OKV_CAT_(a, b) a##b
#define OKV_CAT(a, b) OKV_CAT_(a, b)
#define OKV_F(name) OKV_CAT(name, OKV_SFX)

/* Online-softmax step for one row over n fresh scores s: applies the softcap,
 * rescales (acc, sum) to the new running max and turns s into weights. */
OKV_ATTR static inline void OKV_F(okv_attn_update)(float *s, int64_t n, float softcap, float *mx, float *sm,
                                                   float *acc, int64_t D) {
    float bm, mnew;
    int64_t j;
    if (softcap > 0.f)
        for (j = 0; j < n; j++) s[j] = softcap * tanhf(s[j] / softcap);
    bm = OKV_F(okv_max_f32)(s, n);
    mnew = bm > *mx ? bm : *mx;
    if (mnew > *mx) {
        if (*mx != -INFINITY) {
            float alpha = expf(*mx - mnew);
            OKV_F(okv_scal_f32)(alpha, acc, D);
            *sm *= alpha;
        }
        *mx = mnew;
    }
    *sm += OKV_F(okv_exp_sub_sum_f32)(s, mnew, n);
}

OKV_ATTR static void OKV_F(okv_attn_unit)(const okv_attn_args *a, int64_t b, int64_t hk, int64_t t0, int64_t t1,
                                          int64_t c0, int64_t c1, float *ws, float *part) {
    const int64_t D = a->D, G = a->Hq / a->Hkv, nt = t1 - t0, R = G * nt;
    const int64_t kvl = a->kv_len[b], kvs = a->kv_start ? a->kv_start[b] : 0;
    float *acc = ws;                  /* R*D */
    float *sc = acc + R * D;          /* R*OKV_BK */
    float *mx = sc + R * OKV_BK;      /* R */
    float *sm = mx + R;               /* R */
    int64_t lo[OKV_MAX_TQ], hi[OKV_MAX_TQ];
    int64_t jlo = INT64_MAX, jhi = INT64_MIN, t, g, r, j0;
    const float scale = a->scale, softcap = a->softcap;

    for (t = 0; t < nt; t++) {
        int64_t p = a->q_pos[b * a->Sq + t0 + t];
        int64_t l = kvs > c0 ? kvs : c0;
        int64_t h = p + 1;
        if (a->window >= 0 && p - a->window > l) l = p - a->window;
        if (kvl < h) h = kvl;
        if (c1 < h) h = c1;
        lo[t] = l; hi[t] = h;
        if (l < h) {
            if (l < jlo) jlo = l;
            if (h > jhi) jhi = h;
        }
    }
    memset(acc, 0, (size_t)(R * D) * sizeof(float));
    for (r = 0; r < R; r++) { mx[r] = -INFINITY; sm[r] = 0.f; }

    for (j0 = jlo; j0 < jhi; j0 += OKV_BK) {
        int64_t j1 = j0 + OKV_BK < jhi ? j0 + OKV_BK : jhi;
        for (t = 0; t < nt; t++) {
            const int64_t a0 = lo[t] > j0 ? lo[t] : j0, a1 = hi[t] < j1 ? hi[t] : j1, n = a1 - a0;
            const float *kb, *vb;
            if (a0 >= a1) continue;
            kb = a->k + ((b * a->Hkv + hk) * a->Cap + a0) * D;
            vb = a->v + ((b * a->Hkv + hk) * a->Cap + a0) * D;
            /* heads g and g+1 see the same keys: score and accumulate them in pairs */
            for (g = 0; g < G; g += 2) {
                const int64_t r0 = g * nt + t, r1 = (g + 1) * nt + t;
                const float *q0 = a->q + ((b * a->Hq + hk * G + g) * a->Sq + t0 + t) * D;
                float *s0 = sc + r0 * OKV_BK, *s1 = sc + r1 * OKV_BK;
                if (g + 1 < G) {
                    OKV_F(okv_scores2_f32)(q0, q0 + a->Sq * D, kb, n, D, scale, s0, s1);
                    OKV_F(okv_attn_update)(s0, n, softcap, mx + r0, sm + r0, acc + r0 * D, D);
                    OKV_F(okv_attn_update)(s1, n, softcap, mx + r1, sm + r1, acc + r1 * D, D);
                    OKV_F(okv_pv2_f32)(s0, s1, vb, n, D, acc + r0 * D, acc + r1 * D);
                } else {
                    OKV_F(okv_scores_f32)(q0, kb, n, D, scale, s0);
                    OKV_F(okv_attn_update)(s0, n, softcap, mx + r0, sm + r0, acc + r0 * D, D);
                    OKV_F(okv_pv_f32)(s0, vb, n, D, acc + r0 * D);
                }
            }
        }
    }

    for (g = 0; g < G; g++) {
        const int64_t hq = hk * G + g;
        for (t = 0; t < nt; t++) {
            r = g * nt + t;
            if (part) {
                float *pr = part + r * (D + 2);
                pr[0] = mx[r];
                pr[1] = sm[r];
                memcpy(pr + 2, acc + r * D, (size_t)D * sizeof(float));
            } else {
                float *o = a->out + ((b * a->Hq + hq) * a->Sq + t0 + t) * D;
                if (sm[r] > 0.f) {
                    float inv = 1.f / sm[r];
                    int64_t i;
                    for (i = 0; i < D; i++) o[i] = acc[r * D + i] * inv;
                } else {
                    memset(o, 0, (size_t)D * sizeof(float));
                }
            }
        }
    }
}

#undef OKV_F
