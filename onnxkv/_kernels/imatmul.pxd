from libc.stdint cimport int64_t, uintptr_t

from onnxkv._kernels._runtime cimport okv_settings

cdef uintptr_t int8_weight_address(object w) except 0
cdef int matmul_dynamic_ptr(const void *w, const float *x, int64_t M, const float *ws, float *out,
                            okv_settings s) noexcept nogil
