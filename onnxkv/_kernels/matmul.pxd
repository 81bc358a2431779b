from libc.stdint cimport int64_t

from onnxkv._kernels._runtime cimport okv_settings

cdef int matmul_packed_ptr(const float *x, int64_t M, int64_t K, const void *wp, int half, int64_t P,
                           int64_t N, const float *bias, float *out, okv_settings s) noexcept nogil
