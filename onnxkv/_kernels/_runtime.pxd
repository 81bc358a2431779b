from libc.stdint cimport int64_t

# Kernel settings (okv_settings, simd.h) of the calling thread, shared by cimport (see _runtime.pyx).

cdef extern from "simd.h" nogil:
    ctypedef struct okv_settings:
        int threads
        int simd
        int avx512
        int amx
        int prefetch
        int pf_qk_lines
        int prefill_rg
        int split_tasks
        int paged_heads
        int adaptive
        int vnni
        int flash
        int bf16

cdef okv_settings okv_settings_get() noexcept nogil
cdef okv_settings *okv_settings_mine() noexcept nogil
cdef int okv_avx512_usable() noexcept nogil
cdef int okv_amx_usable() noexcept nogil
cdef int okv_bf16_usable() noexcept nogil

cdef int64_t okv_now_ns() noexcept nogil
cdef int okv_team_threads(okv_settings s, int nt) noexcept nogil
cdef void okv_team_finished(okv_settings s, int64_t t0, int64_t caller_done) noexcept nogil
cdef int okv_team_solo(int solo) noexcept


cdef inline int okv_grain(int nt, int64_t work, int64_t per_thread) noexcept nogil:
    """Threads for a call of ``work`` units (a product's multiply-adds): at most ``nt``, each with at least
    ``per_thread`` of them (a thread woken for less costs more than its share; below 2 * per_thread the call
    runs with no team), as MLAS's thread complexity."""
    if work < per_thread * nt:
        return <int>max(1, work // per_thread)
    return nt
