from libc.stdint cimport int64_t

from onnxkv._kernels._runtime cimport okv_settings

cdef void rms_f32_ptr(const float *x, const float *g, float eps, float *out, int64_t rows, int64_t n,
                      okv_settings s) noexcept nogil
cdef void skip_rms_f32_ptr(const float *x, const float *skip, const float *bias, const float *g, float eps,
                           float *out, float *sum_out, int64_t rows, int64_t n, okv_settings s) noexcept nogil
