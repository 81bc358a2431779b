from libc.stdint cimport int64_t

from onnxkv._kernels._runtime cimport okv_settings

cdef void act_f32_ptr(int mode, const float *x, const float *up, float *out, int64_t n,
                      okv_settings s) noexcept nogil
