from libc.stdint cimport int32_t, int64_t, uint64_t

from onnxkv._kernels._runtime cimport okv_settings

cdef int decode_token_ptr(const void *q, int64_t qs, const void *k, int64_t ks, const void *v, int64_t vs,
                          const float *cos, const float *sin, int64_t half, int inter, void *k_cache,
                          void *v_cache, int64_t B, int64_t Hq, int64_t Hkv, int64_t Cap, int64_t D, int64_t S,
                          const int64_t *pos, float scale, float softcap, int64_t window, void *out, okv_settings s,
                          int io16, int kv_type) noexcept nogil
cdef bint decode_paged_ok(const uint64_t *kp, const uint64_t *vp, int64_t P, const int32_t *tables, int64_t M,
                          int64_t bs, const int32_t *last, int64_t B, int64_t S, int64_t rows,
                          int64_t window, const void *const *spans, const size_t *span_bytes, int nspans,
                          size_t page_bytes) noexcept nogil
cdef int decode_paged_ptr(const void *q, int64_t qs, const void *k, int64_t ks, const void *v, int64_t vs,
                          const float *cos, const float *sin, int64_t half, int inter, const uint64_t *kp,
                          const uint64_t *vp, const int32_t *tables, int64_t M, int64_t bs, const int32_t *last,
                          int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, float scale, float softcap,
                          int64_t window, void *out, okv_settings s, int64_t *stats, int io16,
                          int kv_type, const int32_t *kv_start) noexcept nogil
cdef int page_rows_ptr(const void *src, const uint64_t *pages, const int32_t *tables, int64_t M, int64_t bs,
                       const int32_t *last, int64_t B, int64_t H, int64_t S, int64_t D, int io16, int kv_type,
                       okv_settings s) noexcept nogil
cdef bint masked_ranges(const void *mask, int kind, int causal, int64_t mb, int64_t ms, int64_t T, int64_t B,
                        int64_t S, int32_t *kv_start, int32_t *q_pos, const int64_t *ends,
                        const int64_t *gaps) noexcept nogil
cdef int masked_decode_ptr(const void *q, const void *k_cache, const void *v_cache, int64_t B, int64_t Hq,
                           int64_t Hkv, int64_t S, int64_t D, int64_t Cap, int64_t T, const int32_t *kv_start,
                           const int32_t *q_pos, int32_t *kv_len, float scale, float softcap, void *out,
                           okv_settings s, int io16, int kv_type, const int64_t *ends) noexcept nogil
