/* onnxkv/_kernels/top_indices.h -- the n largest entries of a float32 row, best first (beam search's
 * candidates: sampling.top_indices).
 *
 * okv_top_row(x, N, n, idx, val, simd) writes to idx[0..n) the indices of the n largest of x[0..N)
 * (n <= N, no NaN in x), in descending value, equal values in ascending index -- so of equal values at the
 * boundary the lower indices are taken -- and their values to val (scratch of n floats).  One pass:
 * the best so far are kept sorted; an entry enters only when it is strictly above the worst of n kept
 * (an equal one comes later, so its index is higher).  The AVX2 path tests 8 entries at a time against
 * that worst value and visits the lanes above it in index order, so it keeps what the scalar path keeps:
 * the same indices at every level.  An increasing row enters every entry, each shifting up to n kept:
 * above OKV_TOP_PASS_MAX the caller sorts the row instead (okv_top_row_sorted).
 */
#ifndef ONNXKV_TOP_INDICES_H
#define ONNXKV_TOP_INDICES_H

#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

/* Enter x[i] = v among the ``*count`` kept (sorted as above): after the equal ones, the worst dropped
 * when n are kept already (the caller checked v is above it then). */
static inline void okv_top_enter(float v, int64_t i, int64_t n, int64_t *idx, float *val, int64_t *count) {
    int64_t j = *count < n ? (*count)++ : n - 1;
    while (j > 0 && val[j - 1] < v) {
        val[j] = val[j - 1];
        idx[j] = idx[j - 1];
        j--;
    }
    val[j] = v;
    idx[j] = i;
}

static inline void okv_top_row_scalar(const float *x, int64_t N, int64_t n, int64_t *idx, float *val) {
    int64_t i, count = 0;
    for (i = 0; i < N; i++)
        if (count < n || x[i] > val[n - 1]) okv_top_enter(x[i], i, n, idx, val, &count);
}

#if OKV_X86_SIMD
OKV_AVX2 static inline void okv_top_row_avx2(const float *x, int64_t N, int64_t n, int64_t *idx, float *val) {
    int64_t i, count = 0;
    for (i = 0; i < N && count < n; i++) okv_top_enter(x[i], i, n, idx, val, &count);
    for (; i < N && (i & 7); i++)
        if (x[i] > val[n - 1]) okv_top_enter(x[i], i, n, idx, val, &count);
    for (; i + 8 <= N; i += 8) {
        unsigned mask = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(val[n - 1]), _CMP_GT_OQ));
        while (mask) {   /* lanes above the worst kept when the block was tested, lowest index first */
            int lane = __builtin_ctz(mask);
            mask &= mask - 1;
            if (x[i + lane] > val[n - 1]) okv_top_enter(x[i + lane], i + lane, n, idx, val, &count);
        }
    }
    for (; i < N; i++)
        if (x[i] > val[n - 1]) okv_top_enter(x[i], i, n, idx, val, &count);
}
#endif

static void okv_top_row(const float *x, int64_t N, int64_t n, int64_t *idx, float *val, int simd) {
    OKV_DISPATCH(simd, okv_top_row_avx2(x, N, n, idx, val), okv_top_row_scalar(x, N, n, idx, val));
}

/* Many of a row (n above OKV_TOP_PASS_MAX, where entering one entry may shift n kept): every entry sorted
 * by value descending, then index ascending (pairs: N of scratch), the first n taken -- the same indices. */
#define OKV_TOP_PASS_MAX 64

typedef struct {
    float v;
    int64_t i;
} okv_top_pair;

static int okv_top_pair_cmp(const void *a, const void *b) {
    const okv_top_pair *p = (const okv_top_pair *)a, *q = (const okv_top_pair *)b;
    if (p->v != q->v) return p->v > q->v ? -1 : 1;
    return p->i < q->i ? -1 : (p->i > q->i);
}

static void okv_top_row_sorted(const float *x, int64_t N, int64_t n, int64_t *idx, okv_top_pair *pairs) {
    int64_t i;
    for (i = 0; i < N; i++) {
        pairs[i].v = x[i];
        pairs[i].i = i;
    }
    qsort(pairs, (size_t)N, sizeof(okv_top_pair), okv_top_pair_cmp);
    for (i = 0; i < n; i++) idx[i] = pairs[i].i;
}

#endif /* ONNXKV_TOP_INDICES_H */
