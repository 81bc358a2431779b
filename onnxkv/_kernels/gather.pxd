from libc.stdint cimport int64_t

cdef int64_t gather_rows_ptr(const float *table, int64_t N, int64_t D, const int64_t *indices, int64_t m,
                             float *out, bint wrap) noexcept nogil
