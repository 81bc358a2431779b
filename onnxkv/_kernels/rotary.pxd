# The rotary kernel on checked pointers, shared by cimport with the compiled step (step.pyx).
from libc.stdint cimport int64_t

from onnxkv._kernels._runtime cimport okv_settings

cdef void rope_ptr(const float *x, const float *cos, const float *sin, const int64_t *pos, int64_t B, int64_t S,
                   int64_t H, int64_t D, int64_t half, int interleaved, float *out, okv_settings st) noexcept nogil
