# Shared run-time switches of the onnxkv kernels (C globals of _runtime).
cdef int okv_threads() noexcept nogil
cdef int okv_simd() noexcept nogil
