from libc.stdint cimport int64_t

from onnxkv._kernels._runtime cimport okv_settings

cdef int decode_token_ptr(const float *q, int64_t qs, const float *k, int64_t ks, const float *v, int64_t vs,
                          const float *cos, const float *sin, int64_t half, int inter, float *k_cache,
                          float *v_cache, int64_t Hq, int64_t Hkv, int64_t Cap, int64_t D, int64_t S, int64_t pos,
                          float scale, float softcap, int64_t window, float *out, okv_settings s) noexcept nogil
