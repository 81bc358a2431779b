# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Page-table core: reference counts, the free list and copy-on-write decisions.

Everything here works on flat ``int32`` arrays and the inner functions need
no GIL (their C declarations are in ``_pagecore.pxd`` for other Cython
modules):

* ``refs[p]`` is the number of references to physical page ``p`` (page
  tables of states and checkpoints); 0 means the page is free.
* The free list is a stack of page ids whose count is 0.  ``reserve`` pops,
  ``decref`` pushes the pages whose count reaches 0 and reports them so the
  Python face (:class:`onnxkv.cache.paged.BlockPool`) returns their storage
  to the allocator.
* A page table row maps logical block ``i`` (tokens ``[i*bs, (i+1)*bs)``) to a
  page id, or ``-1`` (never allocated, or evicted).  ``pages_needed`` decides
  for a range of logical blocks about to be written which need a fresh page
  (``-1``) and which need a copy-on-write (shared: count > 1).

:class:`PageCore` owns the arrays.  It is not thread-safe: its owner (a
``BlockPool``) serialises calls.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t

import numpy as np

#: Action codes of :meth:`PageCore.pages_needed`.
KEEP = 0
FRESH = 1
COPY = 2
cdef enum:
    _KEEP = 0
    _FRESH = 1
    _COPY = 2


cdef int64_t okv_pages_needed(const int32_t *refs, const int32_t *row, int64_t first_block,
                              int64_t last_block, int32_t *action) noexcept nogil:
    """action[i - first_block] for blocks first..last-1: KEEP (exclusive), FRESH (-1) or COPY (shared)."""
    cdef int64_t i, n = 0
    cdef int32_t p
    for i in range(first_block, last_block):
        p = row[i]
        if p < 0:
            action[i - first_block] = 1
            n += 1
        elif refs[p] > 1:
            action[i - first_block] = 2
            n += 1
        else:
            action[i - first_block] = 0
    return n


cdef void okv_incref(int32_t *refs, const int32_t *ids, int64_t n) noexcept nogil:
    cdef int64_t i
    for i in range(n):
        if ids[i] >= 0:
            refs[ids[i]] += 1


cdef int64_t okv_decref(int32_t *refs, int32_t *free_stack, int64_t *n_free, const int32_t *ids,
                        int64_t n, int32_t *freed) noexcept nogil:
    """Drop one reference per id (-1 skipped); push and report pages reaching 0."""
    cdef int64_t i, k = 0
    cdef int32_t p
    for i in range(n):
        p = ids[i]
        if p >= 0:
            refs[p] -= 1
            if refs[p] == 0:
                free_stack[n_free[0]] = p
                n_free[0] += 1
                freed[k] = p
                k += 1
    return k


# The largest block size PageCore.write_plan takes (its block arithmetic stays within int64).
cdef int64_t _MAX_BLOCK = 2147483647


cdef inline int64_t _blocks_spanned(int64_t offset, int64_t count, int64_t block_size) noexcept nogil:
    """Blocks that ``count`` >= 1 positions starting ``offset`` in [0, block_size) into a block span
    (block_size <= _MAX_BLOCK: no intermediate value wraps)."""
    return count // block_size + (offset + count % block_size + block_size - 1) // block_size


cdef class PageCore:
    """Reference counts and free list of up to ``max_pages`` pages (None: unbounded, grows).

    ``capacity`` is the current number of page ids; ids are ``0 .. capacity-1``.
    """

    cdef int32_t[::1] _refs
    cdef int32_t[::1] _stack
    cdef int64_t _n_free
    cdef readonly int64_t capacity
    cdef readonly object max_pages

    def __init__(self, int64_t initial=64, max_pages=None):
        if max_pages is not None:
            if max_pages < 1:
                raise ValueError(f"PageCore: max_pages must be >= 1, got {max_pages}")
            initial = min(initial, max_pages)
        if initial < 1:
            raise ValueError(f"PageCore: initial capacity must be >= 1, got {initial}")
        self.max_pages = max_pages
        self.capacity = 0
        self._refs = np.zeros(0, np.int32)
        self._stack = np.zeros(0, np.int32)
        self._n_free = 0
        self._grow(initial)

    cdef _grow(self, int64_t new_cap):
        cdef int64_t old = self.capacity, i
        refs = np.zeros(new_cap, np.int32)
        refs[:old] = np.asarray(self._refs)
        stack = np.zeros(new_cap, np.int32)
        stack[:self._n_free] = np.asarray(self._stack)[:self._n_free]
        # New ids go on the stack so the lowest is popped first.
        for i in range(new_cap - 1, old - 1, -1):
            stack[self._n_free] = i
            self._n_free += 1
        self._refs = refs
        self._stack = stack
        self.capacity = new_cap

    @property
    def free_pages(self) -> int:
        """Ids available without growing (for a bounded pool: all it will ever have)."""
        if self.max_pages is None:
            return self._n_free
        return self._n_free + (self.max_pages - self.capacity)

    @property
    def live_pages(self) -> int:
        return self.capacity - self._n_free

    def refs(self):
        """A read-only view of the reference counts [capacity]."""
        a = np.asarray(self._refs)
        a.flags.writeable = False
        return a

    def reserve(self, int64_t n):
        """Pop ``n`` ids (count 1 each), or return None (nothing changed) if a bounded pool has too few."""
        cdef int64_t i, need
        cdef int32_t p
        if n < 0:
            raise ValueError(f"PageCore.reserve: n must be >= 0, got {n}")
        if self.max_pages is not None and n > self.free_pages:
            return None
        if n > self._n_free:
            need = self.capacity + (n - self._n_free)
            grown = max(need, 2 * self.capacity)
            if self.max_pages is not None:
                grown = min(grown, self.max_pages)
            self._grow(grown)
        out = np.empty(n, np.int32)
        cdef int32_t[::1] o = out
        with nogil:
            for i in range(n):
                self._n_free -= 1
                p = self._stack[self._n_free]
                self._refs[p] = 1
                o[i] = p
        return out

    def incref(self, ids):
        """Add one reference to every id >= 0 of ``ids`` (int32, any shape)."""
        cdef int32_t[::1] a = self._checked(ids, "incref")
        if a.shape[0]:
            with nogil:
                okv_incref(&self._refs[0], &a[0], a.shape[0])

    def decref(self, ids):
        """Drop one reference per id >= 0; return the ids that became free (int32 array)."""
        cdef int32_t[::1] a = self._checked(ids, "decref")
        cdef int64_t k = 0
        freed = np.empty(a.shape[0], np.int32)
        cdef int32_t[::1] f = freed
        if a.shape[0]:
            with nogil:
                k = okv_decref(&self._refs[0], &self._stack[0], &self._n_free, &a[0], a.shape[0], &f[0])
        return freed[:k]

    def appends_in_place(self, const int32_t[:, :] tables, const int64_t[:] starts, const int64_t[:] lengths,
                         int64_t block_size):
        """For a write of one position per row at ``starts`` (int64 [B]): its end (the largest start + 1)
        when every row appends (``starts[b] == lengths[b]``, int64 [B]) into a page it holds alone (the
        block ``starts[b] // block_size`` of row ``b`` of ``tables``, int32 [B, M], is within the row and
        holds a live id with one reference: :meth:`pages_needed` would say KEEP for every row); else -1
        (a start that is not the row's length, a block past the row, a free, out-of-range or shared
        page), which the caller's general path then stages or refuses."""
        cdef int64_t b, blk, n = starts.shape[0], end = 0
        cdef int32_t p
        if block_size < 1 or tables.shape[0] != n or lengths.shape[0] != n:
            return -1
        for b in range(n):
            if starts[b] != lengths[b] or starts[b] < 0:
                return -1
            blk = starts[b] // block_size
            if blk >= tables.shape[1]:
                return -1
            p = tables[b, blk]
            if p < 0 or p >= self.capacity or self._refs[p] != 1:
                return -1
            end = max(end, starts[b] + 1)
        return end

    def pages_needed(self, row, int64_t first_block, int64_t last_block):
        """Action per logical block ``first_block .. last_block-1`` of ``row`` (KEEP/FRESH/COPY), and how many need a page."""
        cdef int32_t[::1] r = self._as_ids(row, "pages_needed")
        if first_block < 0 or last_block > r.shape[0] or first_block > last_block:
            raise ValueError(f"PageCore.pages_needed: blocks [{first_block}, {last_block}) outside a row of "
                             f"{r.shape[0]}")
        action = np.zeros(last_block - first_block, np.int32)
        cdef int32_t[::1] act = action
        cdef int64_t n = 0
        if last_block > first_block:
            self._checked(r, "pages_needed")
            with nogil:
                n = okv_pages_needed(&self._refs[0], &r[0], first_block, last_block, &act[0])
        return action, n

    def write_plan(self, const int32_t[:, ::1] tables, const int64_t[:] starts, const int64_t[:] counts,
                   int64_t block_size, const int64_t[:] committed, const uint8_t[:] nonnative, bint keep_one):
        """The blocks a write of ``counts[b]`` positions from ``starts[b]`` (int64 [B]) into each row of
        ``tables`` (int32 [B, M], C-contiguous, wide enough) needs a page for, each row's decided as
        :meth:`pages_needed` decides them: ``(rows, blocks, actions)``, int64 / int64 / int32 [n] in row then
        block order, each FRESH (no page) or COPY (a shared page; with ``nonnative``,
        uint8 [capacity] or empty, also a page it marks); the blocks to KEEP are left out.

        ``keep_one`` (a write of appending rows, native pages): a page shared only by rows of this write,
        every one of which copies it, is kept by one of them instead -- the first of those writing
        furthest, when no holder has committed positions (``committed``, int64 [B]) past its start (every
        other holder copies the valid tokens first, and the keeper writes past them all).  ValueError for a
        block past a row, an id past the capacity, or arguments of other shapes; nothing changes here.
        """
        cdef int64_t B = tables.shape[0], M = tables.shape[1], b, blk, lo, hi, i, j, n = 0, keeper, holders
        cdef int32_t p, a
        cdef bint ok, first
        if starts.shape[0] != B or counts.shape[0] != B or committed.shape[0] != B or block_size < 1:
            raise ValueError(f"PageCore.write_plan: {B} rows, starts {starts.shape[0]}, counts {counts.shape[0]}, "
                             f"committed {committed.shape[0]}, block size {block_size}")
        if nonnative.shape[0] not in (0, self.capacity):
            raise ValueError(f"PageCore.write_plan: nonnative holds {nonnative.shape[0]} ids, the pool {self.capacity}")
        if block_size > _MAX_BLOCK:
            raise ValueError(f"PageCore.write_plan: block size {block_size} past {_MAX_BLOCK}")
        for b in range(B):  # bounds first (no sum that can wrap), and how many entries at most
            if counts[b] <= 0:
                continue
            if starts[b] < 0:
                raise ValueError(f"PageCore.write_plan: row {b} starts at {starts[b]}")
            lo = starts[b] // block_size
            if lo >= M or _blocks_spanned(starts[b] - lo * block_size, counts[b], block_size) > M - lo:
                raise ValueError(f"PageCore.write_plan: row {b} writes {counts[b]} position(s) from {starts[b]}, "
                                 f"past its {M} blocks of {block_size}")
            hi = lo + _blocks_spanned(starts[b] - lo * block_size, counts[b], block_size)
            for blk in range(lo, hi):
                p = tables[b, blk]
                if p < -1 or p >= self.capacity or (p >= 0 and self._refs[p] <= 0):
                    raise ValueError(f"PageCore.write_plan: row {b}, block {blk} holds {p}, not a live page id "
                                     f"in [0, {self.capacity}) or -1")
            n += hi - lo
        rows, blocks, actions = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int32)
        if n == 0:
            return rows, blocks, actions
        cdef int64_t[::1] rv = rows, bv = blocks
        cdef int32_t[::1] av = actions
        cdef int32_t[::1] row_actions = np.empty(M, np.int32)  # one row's, as pages_needed decides them
        n = 0
        for b in range(B):
            if counts[b] <= 0:
                continue
            lo = starts[b] // block_size
            hi = lo + _blocks_spanned(starts[b] - lo * block_size, counts[b], block_size)
            okv_pages_needed(&self._refs[0], &tables[b, 0], lo, hi, &row_actions[0])
            for blk in range(lo, hi):
                a = row_actions[blk - lo]
                if a == _KEEP and nonnative.shape[0] and nonnative[tables[b, blk]]:
                    a = _COPY  # held alone but not native: back to a native copy first
                if a == _KEEP:
                    continue
                rv[n], bv[n], av[n] = b, blk, a
                n += 1
        if keep_one:
            for i in range(n):
                p = tables[rv[i], bv[i]]
                if av[i] != _COPY:
                    continue
                first = True
                for j in range(i):  # decided at the page's first entry
                    if av[j] != _FRESH and tables[rv[j], bv[j]] == p:
                        first = False
                        break
                if not first:
                    continue
                holders, keeper = 0, i
                for j in range(i, n):  # the entries copying p: do they hold all of its references?
                    if av[j] == _COPY and tables[rv[j], bv[j]] == p:
                        holders += 1
                        if starts[rv[j]] > starts[rv[keeper]]:
                            keeper = j
                if holders != self._refs[p]:
                    continue
                ok = True
                for j in range(i, n):
                    if av[j] == _COPY and tables[rv[j], bv[j]] == p and committed[rv[j]] > starts[rv[keeper]]:
                        ok = False
                        break
                if ok:
                    av[keeper] = _KEEP
        j = 0
        for i in range(n):  # drop the entries kept
            if av[i] != _KEEP:
                rv[j], bv[j], av[j] = rv[i], bv[i], av[i]
                j += 1
        return rows[:j], blocks[:j], actions[:j]

    cdef int32_t[::1] _as_ids(self, ids, str api):
        """``ids`` (integers of any width, any shape; negative: no page) as flat int32, each checked in its own
        width first: ValueError for other dtypes and for ids that are not below the capacity or int32."""
        x = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
        if x.dtype != np.int32:
            if x.size and x.dtype.kind not in "iu":
                raise ValueError(f"PageCore.{api}: page ids must be integers, got dtype {x.dtype}")
            if x.size and (int(x.max()) >= self.capacity or int(x.min()) < -2147483648):
                raise ValueError(f"PageCore.{api}: page ids must be in [0, {self.capacity}) (negative: none), got "
                                 f"{int(x.min())} .. {int(x.max())}")
        return np.ascontiguousarray(x, np.int32).reshape(-1)

    cdef int32_t[::1] _checked(self, ids, str api):
        """``ids`` as flat int32, refused (ValueError, counts unchanged) when an id is past the capacity, when
        incref names a free page, or when decref drops more references to a page than it holds (counted in
        place and restored: no memory in proportion to the pool or the ids, as a failed allocation's undo
        runs when memory has run out)."""
        cdef int32_t[::1] a = self._as_ids(ids, api)
        cdef int32_t[::1] refs = self._refs
        cdef int64_t i, j, n = a.shape[0], bad = -1, need = 0
        cdef int32_t p, hi = -1
        for i in range(n):
            if a[i] > hi:
                hi = a[i]
        if hi >= self.capacity:
            raise ValueError(f"PageCore.{api}: page id {hi} out of range [0, {self.capacity})")
        if api == "incref":
            for i in range(n):
                p = a[i]
                if p >= 0 and refs[p] <= 0:
                    raise ValueError(f"PageCore.incref: page {p} is free")
        elif api != "pages_needed":
            for i in range(n):  # drop them, up to the first that a page does not hold
                p = a[i]
                if p >= 0:
                    if refs[p] <= 0:
                        bad = i
                        break
                    refs[p] -= 1
            for j in range(bad if bad >= 0 else n):  # and give them back
                if a[j] >= 0:
                    refs[a[j]] += 1
            if bad >= 0:
                p = a[bad]
                for i in range(n):
                    need += a[i] == p
                raise ValueError(f"PageCore.{api}: page {p} has {refs[p]} reference(s), fewer than the "
                                 f"{need} dropped")
        return a
