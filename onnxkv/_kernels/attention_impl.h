/* onnxkv/_kernels/attention_impl.h -- body of one attention work unit.
 *
 * Included twice by attention.h: once with OKV_SFX = _scalar and once (x86)
 * with OKV_SFX = _avx2 and OKV_ATTR = the avx2/fma/f16c target attribute, so
 * the primitives inline into a single function per instruction set.
 *
 * A work unit is (batch b, kv head hk, query tokens [t0, t1), keys [c0, c1)).
 * The G = Hq/Hkv query heads of the group and the nt = t1-t0 query tokens form
 * R = G*nt rows; keys are streamed in blocks of OKV_BK, each K/V block is read
 * from memory once and used by all R rows (online softmax per row).
 *
 * ws: float workspace of at least R*(D + OKV_BK + 2) floats.
 * part == NULL: normalise and write out[b, hk*G+g, t, :].
 * part != NULL: write the unnormalised partial state per row as
 *               part[r*(D+2) + 0] = running max, [1] = sum, [2..] = acc.
 */
#define OKV_CAT_(a, b) a##b
#define OKV_CAT(a, b) OKV_CAT_(a, b)
#define OKV_F(name) OKV_CAT(name, OKV_SFX)

OKV_ATTR static void OKV_F(okv_attn_unit)(const okv_attn_args *a, int64_t b, int64_t hk, int64_t t0, int64_t t1,
                                          int64_t c0, int64_t c1, float *ws, float *part) {
    const int64_t D = a->D, G = a->Hq / a->Hkv, nt = t1 - t0, R = G * nt;
    const int64_t kvl = a->kv_len[b], kvs = a->kv_start ? a->kv_start[b] : 0;
    float *acc = ws;                  /* R*D */
    float *sc = acc + R * D;          /* R*OKV_BK */
    float *mx = sc + R * OKV_BK;      /* R */
    float *sm = mx + R;               /* R */
    int64_t lo[OKV_MAX_TQ], hi[OKV_MAX_TQ];
    int64_t jlo = INT64_MAX, jhi = INT64_MIN, t, g, r, j0, j;
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
        for (g = 0; g < G; g++) {
            const int64_t hq = hk * G + g;
            for (t = 0; t < nt; t++) {
                int64_t a0 = lo[t] > j0 ? lo[t] : j0, a1 = hi[t] < j1 ? hi[t] : j1;
                const float *qrow = a->q + ((b * a->Hq + hq) * a->Sq + t0 + t) * D;
                float *s, *accr, bm, mnew;
                r = g * nt + t;
                if (a0 >= a1) continue;
                s = sc + r * OKV_BK;
                accr = acc + r * D;
                OKV_F(okv_scores_f32)(qrow, a->k + ((b * a->Hkv + hk) * a->Cap + a0) * D, a1 - a0, D, scale, s);
                if (softcap > 0.f)
                    for (j = 0; j < a1 - a0; j++) s[j] = softcap * tanhf(s[j] / softcap);
                bm = OKV_F(okv_max_f32)(s, a1 - a0);
                mnew = bm > mx[r] ? bm : mx[r];
                if (mnew > mx[r]) {
                    if (mx[r] != -INFINITY) {
                        float alpha = expf(mx[r] - mnew);
                        OKV_F(okv_scal_f32)(alpha, accr, D);
                        sm[r] *= alpha;
                    }
                    mx[r] = mnew;
                }
                sm[r] += OKV_F(okv_exp_sub_sum_f32)(s, mnew, a1 - a0);
                OKV_F(okv_pv_f32)(s, a->v + ((b * a->Hkv + hk) * a->Cap + a0) * D, a1 - a0, D, accr);
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
