# C-level API of the page-table core (see _pagecore.pyx).  Every function
# works on flat int32 arrays and needs no GIL, so kernels may call it.
from libc.stdint cimport int32_t, int64_t

cdef int64_t okv_pages_needed(const int32_t *refs, const int32_t *row, int64_t first_block,
                              int64_t last_block, int32_t *action) noexcept nogil
cdef void okv_incref(int32_t *refs, const int32_t *ids, int64_t n) noexcept nogil
cdef int64_t okv_decref(int32_t *refs, int32_t *free_stack, int64_t *n_free, const int32_t *ids,
                        int64_t n, int32_t *freed) noexcept nogil
