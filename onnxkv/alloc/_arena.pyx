"""Arena bookkeeping: one reserved region carved into blocks, in C, GIL-free.

Layout. The region is one ``malloc`` made at construction, aligned to
``max(granule, 4096)``. Blocks tile the region without gaps; every block
starts at a multiple of the granule (a power of two >= 64) and its size is a
multiple of the granule. Block headers live out of band in a block table (an
array of :c:type:`ArenaBlock` grown by ``realloc``), so the region holds only
user bytes and a user writing past its buffer cannot corrupt the bookkeeping.

Free lists. Free blocks sit in one of ``ARENA_NCLASSES`` doubly linked lists
by size class of their granule count ``n``: exact classes for ``n < 8``, then
four classes per doubling (``[8,10) [10,12) [12,14) [14,16) [16,20) ...``).
A bitmap marks non-empty classes. A request of ``n`` granules scans its own
class first-fit (blocks there may be smaller), then takes the first fitting
block of the next non-empty classes. The block is split: an alignment pad in
front (only for alignments above the granule) and the tail beyond the request
go back to the free lists as free blocks. Lists are LIFO, so a block freed
and requested again at the same size comes back at the same offset.

Coalescing. Each block links its neighbours by address (``prev_phys`` /
``next_phys``). ``arena_free`` merges the freed block with a free neighbour on
either side, so no two free blocks are ever adjacent: once everything is
freed the region is one free block again.

Determinism. Offsets depend only on the sequence of calls (and, for
alignments above ``max(granule, 4096)``, on the region's address).

Threads. Every operation runs under the arena's ``PyThread`` lock, which
needs no GIL; the Python methods release the GIL around the C calls.
"""

from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memset
from cpython.buffer cimport PyBuffer_FillInfo
from cpython.pythread cimport (
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    WAIT_LOCK,
)

from onnxkv.errors import OutOfMemory

cdef enum:
    BLOCK_UNUSED = 0
    BLOCK_FREE = 1
    BLOCK_USED = 2
    MIN_TABLE = 16
    REGION_ALIGN = 4096


cdef inline Py_ssize_t size_class(size_t units) noexcept nogil:
    """Class of a block of ``units`` (>= 1) granules."""
    cdef int e = 0
    cdef size_t n = units
    if units < 8:
        return <Py_ssize_t>units - 1
    while n > 1:
        n >>= 1
        e += 1
    return 7 + (e - 3) * 4 + <Py_ssize_t>((units >> (e - 2)) & 3)


cdef inline void list_push(Arena* a, Py_ssize_t i) noexcept nogil:
    cdef ArenaBlock* b = &a.blocks[i]
    cdef Py_ssize_t c = size_class(b.size // a.granule)
    b.state = BLOCK_FREE
    b.prev_free = -1
    b.next_free = a.heads[c]
    if b.next_free >= 0:
        a.blocks[b.next_free].prev_free = i
    a.heads[c] = i
    a.nonempty[c >> 6] |= (<uint64_t>1) << (c & 63)
    a.free_blocks += 1


cdef inline void list_remove(Arena* a, Py_ssize_t i) noexcept nogil:
    """Unlink free block ``i``; its size must be the one it was pushed with."""
    cdef ArenaBlock* b = &a.blocks[i]
    cdef Py_ssize_t c = size_class(b.size // a.granule)
    if b.prev_free >= 0:
        a.blocks[b.prev_free].next_free = b.next_free
    else:
        a.heads[c] = b.next_free
        if b.next_free < 0:
            a.nonempty[c >> 6] &= ~((<uint64_t>1) << (c & 63))
    if b.next_free >= 0:
        a.blocks[b.next_free].prev_free = b.prev_free
    a.free_blocks -= 1


cdef inline bint table_reserve(Arena* a, Py_ssize_t n) noexcept nogil:
    """Make sure ``n`` table entries can be taken without failing."""
    cdef ArenaBlock* grown
    if a.spare_count + a.table_size - a.table_used >= n:
        return True
    grown = <ArenaBlock*>realloc(a.blocks, 2 * a.table_size * sizeof(ArenaBlock))
    if grown == NULL:
        return False
    a.blocks = grown
    a.table_size *= 2
    return True


cdef inline Py_ssize_t entry_take(Arena* a) noexcept nogil:
    cdef Py_ssize_t i
    if a.spare >= 0:
        i = a.spare
        a.spare = a.blocks[i].next_free
        a.spare_count -= 1
    else:
        i = a.table_used
        a.table_used += 1
    return i


cdef inline void entry_release(Arena* a, Py_ssize_t i) noexcept nogil:
    a.blocks[i].state = BLOCK_UNUSED
    a.blocks[i].next_free = a.spare
    a.spare = i
    a.spare_count += 1


cdef inline Py_ssize_t split(Arena* a, Py_ssize_t i, size_t keep) noexcept nogil:
    """Cut block ``i`` after ``keep`` bytes; return the tail, a new block in no list."""
    cdef Py_ssize_t j = entry_take(a)
    cdef ArenaBlock* b = &a.blocks[i]
    cdef ArenaBlock* t = &a.blocks[j]
    t.offset = b.offset + keep
    t.size = b.size - keep
    t.prev_phys = i
    t.next_phys = b.next_phys
    if b.next_phys >= 0:
        a.blocks[b.next_phys].prev_phys = j
    b.next_phys = j
    b.size = keep
    return j


cdef inline void absorb_next(Arena* a, Py_ssize_t i) noexcept nogil:
    """Merge the next block by address (in no list) into block ``i``."""
    cdef ArenaBlock* b = &a.blocks[i]
    cdef Py_ssize_t j = b.next_phys
    cdef ArenaBlock* t = &a.blocks[j]
    b.size += t.size
    b.next_phys = t.next_phys
    if t.next_phys >= 0:
        a.blocks[t.next_phys].prev_phys = i
    entry_release(a, j)


cdef inline size_t padding(Arena* a, Py_ssize_t i, size_t alignment) noexcept nogil:
    cdef uintptr_t address = <uintptr_t>(a.base + a.blocks[i].offset)
    return (alignment - (address & (alignment - 1))) & (alignment - 1)


cdef Py_ssize_t find_fit(Arena* a, size_t size, size_t alignment, size_t* pad) noexcept nogil:
    """First free block that holds ``size`` bytes at ``alignment``, or -1."""
    cdef Py_ssize_t c = size_class(size // a.granule)
    cdef Py_ssize_t i
    cdef uint64_t word
    while c < ARENA_NCLASSES:
        word = a.nonempty[c >> 6] >> (c & 63)
        if word == 0:
            c = ((c >> 6) + 1) << 6
            continue
        while not (word & 1):
            word >>= 1
            c += 1
        i = a.heads[c]
        while i >= 0:
            pad[0] = padding(a, i, alignment)
            if a.blocks[i].size >= size and a.blocks[i].size - size >= pad[0]:
                return i
            i = a.blocks[i].next_free
        c += 1
    return -1


cdef size_t largest_free(Arena* a) noexcept nogil:
    cdef Py_ssize_t c = ARENA_NCLASSES - 1
    cdef Py_ssize_t i
    cdef size_t best = 0
    while c >= 0 and not (a.nonempty[c >> 6] >> (c & 63)) & 1:
        c -= 1
    if c >= 0:
        i = a.heads[c]
        while i >= 0:
            if a.blocks[i].size > best:
                best = a.blocks[i].size
            i = a.blocks[i].next_free
    return best


cdef void fresh_layout(Arena* a) noexcept nogil:
    """One free block covering the region; counters at zero (generations keep counting)."""
    cdef Py_ssize_t c
    for c in range(ARENA_NCLASSES):
        a.heads[c] = -1
    for c in range(ARENA_BITMAP_WORDS):
        a.nonempty[c] = 0
    a.table_used = 1
    a.spare = -1
    a.spare_count = 0
    a.blocks[0].offset = 0
    a.blocks[0].size = a.capacity
    a.blocks[0].prev_phys = -1
    a.blocks[0].next_phys = -1
    a.free_blocks = 0
    list_push(a, 0)
    a.live = 0
    a.peak = 0
    a.allocations = 0
    a.frees = 0
    a.live_blocks = 0


cdef int arena_init(Arena* a, size_t capacity, size_t granule) noexcept:
    """Reserve the region. Preconditions: ``granule`` a power of two >= 64,
    ``capacity`` a positive multiple of it. Needs the GIL (allocates the lock)."""
    cdef size_t align = granule if granule > REGION_ALIGN else REGION_ALIGN
    memset(a, 0, sizeof(Arena))
    a.raw = malloc(capacity + align)
    a.blocks = <ArenaBlock*>malloc(MIN_TABLE * sizeof(ArenaBlock))
    a.lock = PyThread_allocate_lock()
    if a.raw == NULL or a.blocks == NULL or a.lock == NULL:
        arena_release(a)
        return ARENA_NO_MEMORY
    a.base = <char*>((<uintptr_t>a.raw + align - 1) & ~(<uintptr_t>align - 1))
    a.capacity = capacity
    a.granule = granule
    a.table_size = MIN_TABLE
    fresh_layout(a)
    return ARENA_OK


cdef void arena_release(Arena* a) noexcept:
    """Give the region back. Needs the GIL and no other user of the arena."""
    free(a.raw)
    free(a.blocks)
    if a.lock != NULL:
        PyThread_free_lock(a.lock)
    memset(a, 0, sizeof(Arena))


cdef int arena_allocate(Arena* a, size_t nbytes, size_t alignment, ArenaHandle* out) noexcept nogil:
    """Lease a block of ``nbytes`` (0 allowed: one granule) at ``alignment``
    (a power of two; values below the granule mean the granule)."""
    cdef size_t size, pad = 0
    cdef Py_ssize_t i, j
    cdef int status = ARENA_OK
    if nbytes > a.capacity:
        return ARENA_NO_SPACE
    size = (nbytes + a.granule - 1) & ~(a.granule - 1)
    if size == 0:
        size = a.granule
    if alignment < a.granule:
        alignment = a.granule
    PyThread_acquire_lock(a.lock, WAIT_LOCK)
    if not table_reserve(a, 2):
        status = ARENA_NO_MEMORY
    else:
        i = find_fit(a, size, alignment, &pad)
        if i < 0:
            status = ARENA_NO_SPACE
        else:
            list_remove(a, i)
            if pad:
                j = split(a, i, pad)
                list_push(a, i)
                i = j
            if a.blocks[i].size > size:
                list_push(a, split(a, i, size))
            a.blocks[i].state = BLOCK_USED
            a.next_generation += 1
            a.blocks[i].generation = a.next_generation
            a.live += size
            if a.live > a.peak:
                a.peak = a.live
            a.allocations += 1
            a.live_blocks += 1
            out.block = i
            out.generation = a.next_generation
            out.offset = a.blocks[i].offset
            out.size = size
    PyThread_release_lock(a.lock)
    return status


cdef int arena_free(Arena* a, ArenaHandle handle) noexcept nogil:
    """Take back a live block and merge it with free neighbours."""
    cdef Py_ssize_t i = handle.block
    cdef Py_ssize_t n, p
    cdef int status = ARENA_OK
    PyThread_acquire_lock(a.lock, WAIT_LOCK)
    if (i < 0 or i >= a.table_used or a.blocks[i].state != BLOCK_USED
            or a.blocks[i].generation != handle.generation or a.blocks[i].offset != handle.offset):
        status = ARENA_BAD_HANDLE
    else:
        a.live -= a.blocks[i].size
        a.frees += 1
        a.live_blocks -= 1
        n = a.blocks[i].next_phys
        if n >= 0 and a.blocks[n].state == BLOCK_FREE:
            list_remove(a, n)
            absorb_next(a, i)
        p = a.blocks[i].prev_phys
        if p >= 0 and a.blocks[p].state == BLOCK_FREE:
            list_remove(a, p)
            absorb_next(a, p)
            i = p
        list_push(a, i)
    PyThread_release_lock(a.lock)
    return status


cdef int arena_reset(Arena* a) noexcept nogil:
    """Back to the fresh layout and zero counters; ARENA_BUSY if blocks are live."""
    cdef int status = ARENA_OK
    PyThread_acquire_lock(a.lock, WAIT_LOCK)
    if a.live_blocks:
        status = ARENA_BUSY
    else:
        fresh_layout(a)
    PyThread_release_lock(a.lock)
    return status


cdef void arena_stats(Arena* a, ArenaStats* out) noexcept nogil:
    """A consistent snapshot of the accounting."""
    PyThread_acquire_lock(a.lock, WAIT_LOCK)
    out.capacity = a.capacity
    out.live = a.live
    out.peak = a.peak
    out.largest_free = largest_free(a)
    out.allocations = a.allocations
    out.frees = a.frees
    out.live_blocks = a.live_blocks
    out.free_blocks = a.free_blocks
    PyThread_release_lock(a.lock)


cdef class ArenaCore:
    """Python wrapper of one :c:type:`Arena`; owns the region and exports it
    (writable) through the buffer protocol, so NumPy arrays over the region keep
    it alive. Handles are ``(block, generation, offset, size)`` tuples."""

    def __cinit__(self, size_t capacity, size_t granule):
        if granule < 64 or granule & (granule - 1):
            raise ValueError(f"granule must be a power of two >= 64, got {granule}")
        if capacity == 0 or capacity % granule:
            raise ValueError(f"capacity must be a positive multiple of {granule}, got {capacity}")
        if arena_init(&self.arena, capacity, granule) != ARENA_OK:
            raise OutOfMemory(f"cannot reserve {capacity} bytes for an arena")

    def __dealloc__(self):
        arena_release(&self.arena)

    @property
    def address(self) -> int:
        """Address of the region's first byte."""
        return <uintptr_t>self.arena.base

    @property
    def capacity(self) -> int:
        return self.arena.capacity

    @property
    def granule(self) -> int:
        return self.arena.granule

    def allocate(self, nbytes: int, alignment: int) -> tuple:
        """Lease ``nbytes`` (an int >= 0) at ``alignment`` (a power of two).
        Raises ``OutOfMemory`` (and changes nothing) if no free block fits."""
        cdef ArenaHandle h
        cdef int status = ARENA_NO_SPACE
        cdef size_t n, align
        if nbytes <= self.arena.capacity and alignment <= ((<size_t>-1) >> 1) + 1:
            n = nbytes
            align = alignment
            with nogil:
                status = arena_allocate(&self.arena, n, align, &h)
        if status == ARENA_OK:
            return (h.block, h.generation, h.offset, h.size)
        s = self.stats()
        if status == ARENA_NO_MEMORY:
            raise OutOfMemory(f"arena of {s['capacity']} bytes: its block table could not grow")
        raise OutOfMemory(
            f"arena cannot allocate {nbytes} bytes aligned to {alignment}: "
            f"{s['live']} bytes live of capacity {s['capacity']}, "
            f"largest free block {s['largest_free']} bytes"
        )

    def free(self, Py_ssize_t block, uint64_t generation, size_t offset) -> None:
        """Take back a live handle; ``ValueError`` (nothing changed) if it is not live."""
        cdef ArenaHandle h
        cdef int status
        h.block = block
        h.generation = generation
        h.offset = offset
        with nogil:
            status = arena_free(&self.arena, h)
        if status != ARENA_OK:
            raise ValueError(f"block {block} at offset {offset} is not live in this arena")

    def reset(self) -> None:
        """Fresh layout and zero counters; ``RuntimeError`` if blocks are live."""
        cdef int status
        with nogil:
            status = arena_reset(&self.arena)
        if status == ARENA_BUSY:
            s = self.stats()
            raise RuntimeError(
                f"cannot reset an arena with {s['live_blocks']} live blocks ({s['live']} bytes)"
            )

    def stats(self) -> dict:
        """Snapshot: capacity, live, peak, largest_free, allocations, frees,
        live_blocks, free_blocks."""
        cdef ArenaStats s
        with nogil:
            arena_stats(&self.arena, &s)
        return s

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, self.arena.base, self.arena.capacity, 0, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass
