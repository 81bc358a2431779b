# The float16 <-> float32 conversions on checked pointers, shared by cimport with the compiled step (step.pyx).
from libc.stdint cimport int64_t

from onnxkv._kernels._runtime cimport okv_settings

cdef void convert_ptr(const void *x, void *out, int64_t n, int mode, okv_settings s) noexcept nogil
cdef void concat_ptr(const char *a, const char *b, char *out, int64_t outer, int64_t na, int64_t nb) noexcept nogil
cdef void copy_rows_ptr(const char *x, char *out, int64_t rows, int64_t row_bytes, int64_t stride) noexcept nogil
