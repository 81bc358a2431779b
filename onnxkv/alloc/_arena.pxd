# Arena bookkeeping in C, callable without the GIL.
#
# Kernels may `cimport onnxkv.alloc._arena` and call arena_allocate/arena_free
# on `&core.arena` of an `ArenaCore` without holding the GIL. Every function
# taking an `Arena*` (except arena_init/arena_release, which need the GIL and
# exclusive access) takes the arena's lock, so any number of threads may call
# them concurrently. On any status other than ARENA_OK nothing has changed.

from libc.stdint cimport uint64_t
from cpython.pythread cimport PyThread_type_lock

cdef enum:
    ARENA_NCLASSES = 256          # size classes (4 per doubling of the granule count)
    ARENA_BITMAP_WORDS = 4        # ARENA_NCLASSES / 64

cdef enum ArenaStatus:
    ARENA_OK = 0
    ARENA_NO_SPACE = 1            # no free block can hold the request
    ARENA_NO_MEMORY = 2           # the block table (or the region at init) could not be malloc'd
    ARENA_BAD_HANDLE = 3          # free of a handle that is not live in this arena
    ARENA_BUSY = 4                # reset while blocks are live

cdef struct ArenaHandle:
    Py_ssize_t block              # index into Arena.blocks
    uint64_t generation           # unique per allocation: stale handles never match
    size_t offset                 # bytes from Arena.base
    size_t size                   # block bytes (request rounded up to the granule, >= 1 granule)

cdef struct ArenaBlock:
    size_t offset
    size_t size
    Py_ssize_t prev_phys          # neighbour blocks by address (-1: none)
    Py_ssize_t next_phys
    Py_ssize_t prev_free          # links in the size-class free list (-1: none);
    Py_ssize_t next_free          # next_free also links unused table entries
    uint64_t generation
    int state                     # BLOCK_FREE / BLOCK_USED / BLOCK_UNUSED

cdef struct ArenaStats:
    size_t capacity
    size_t live                   # bytes of live blocks
    size_t peak
    size_t largest_free
    uint64_t allocations          # successful arena_allocate calls
    uint64_t frees                # successful arena_free calls
    Py_ssize_t live_blocks
    Py_ssize_t free_blocks

cdef struct Arena:
    char* base                    # region start, aligned to max(granule, 4096)
    void* raw                     # what malloc returned for the region
    size_t capacity               # region bytes, a multiple of granule
    size_t granule                # block alignment and size unit, power of two >= 64
    ArenaBlock* blocks            # block table
    Py_ssize_t table_size         # entries malloc'd
    Py_ssize_t table_used         # entries ever handed out since init/reset
    Py_ssize_t spare              # stack of released entries (linked by next_free)
    Py_ssize_t spare_count
    Py_ssize_t heads[ARENA_NCLASSES]
    uint64_t nonempty[ARENA_BITMAP_WORDS]
    size_t live
    size_t peak
    uint64_t allocations
    uint64_t frees
    uint64_t next_generation
    Py_ssize_t live_blocks
    Py_ssize_t free_blocks
    PyThread_type_lock lock

cdef int arena_init(Arena* arena, size_t capacity, size_t granule) noexcept
cdef void arena_release(Arena* arena) noexcept
cdef int arena_allocate(Arena* arena, size_t nbytes, size_t alignment, ArenaHandle* out) noexcept nogil
cdef int arena_free(Arena* arena, ArenaHandle handle) noexcept nogil
cdef int arena_reset(Arena* arena) noexcept nogil
cdef void arena_stats(Arena* arena, ArenaStats* out) noexcept nogil

cdef class ArenaCore:
    cdef Arena arena
