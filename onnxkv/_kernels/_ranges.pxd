# Byte-range tests of the kernels' C-speed argument checks (inline, no GIL; shared by cimport).

cdef inline bint _disjoint(const void *a, size_t an, const void *b, size_t bn) noexcept nogil:
    """True when the byte ranges [a, a + an) and [b, b + bn) do not intersect."""
    cdef const char *pa = <const char *>a
    cdef const char *pb = <const char *>b
    return pa + an <= pb or pb + bn <= pa


cdef inline bint _same_or_disjoint(const void *a, const void *b, size_t nb) noexcept nogil:
    """True when two ranges of ``nb`` bytes are the same memory or do not intersect."""
    return a == b or _disjoint(a, nb, b, nb)
