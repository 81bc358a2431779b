"""Per-run context handed to kernels: output allocation and storage counters."""

from __future__ import annotations

import math

import numpy as np

from onnxkv.events import COUNTER_FIELDS

__all__ = ["RunContext", "SCRATCH_POOLED", "STORAGE_COUNTERS"]

#: Counters a kernel may add to the storage event of the node it runs.
STORAGE_COUNTERS = COUNTER_FIELDS
#: Bytes from which :meth:`RunContext.scratch` lends the run's buffers.
SCRATCH_POOLED = 1 << 16


class RunContext:
    """What a kernel sees of the run it belongs to.

    ``empty(index, shape, dtype)`` returns an uninitialised C-contiguous array
    for output ``index`` of the node being run.  Where the plan owns the
    value's lifetime the memory comes from the session's allocator and is
    returned to it after the value's last use; values that reach the caller
    (graph outputs, or views of them) get ordinary NumPy memory.  The kernel
    must write every element it returns.

    ``caches`` maps bound past inputs to their persistent
    :class:`~onnxkv.cache.contiguous.CacheTensor` or
    :class:`~onnxkv.cache.paged.PagedPlane` when the run belongs to a state
    (None for a stateless run); kernels bound to a cache write through
    :meth:`cache_write`.  ``cache_allocator`` is the running state's
    persistent allocator (None for a stateless run): storage a kernel adds to
    a cache that outlives the run comes from it.

    ``defer(commit, rollback)`` registers a change a kernel made to storage
    that outlives the run: the plan calls every ``commit`` after the last
    node succeeded, or every ``rollback`` (newest first) when the run fails
    or is cancelled, so a failed run leaves that storage as it was.
    :meth:`preserve` is the common case: a kernel about to overwrite part of
    the running state's storage in place saves exactly those elements.

    ``count(**counters)`` adds storage counters (names in
    :data:`STORAGE_COUNTERS`) to the current node's event; it costs nothing
    when the event log is off.

    ``cancel`` is the run's cancellation token (an object with a
    ``cancelled`` flag, or None): the plan checks it between nodes, and a
    kernel that repeats work (a ``Loop``) between repetitions.
    :meth:`nested` is the context of a plan run inside the current node.
    """

    __slots__ = (
        "_plan_alloc",
        "_scratch",
        "_node",
        "counters",
        "recording",
        "step",
        "caches",
        "cache_events",
        "cache_allocator",
        "deferred",
        "cancel",
        "on_python",
    )

    def __init__(
        self,
        plan_alloc,
        recording: bool,
        step: int,
        caches: dict | None = None,
        cache_allocator=None,
        cancel=None,
        on_python=None,
    ) -> None:
        self._plan_alloc = plan_alloc
        #: The run's buffers that scratch() lends from (the ``buffers`` of a slot_allocator), or None.
        self._scratch = getattr(plan_alloc, "buffers", None)
        self._node = 0
        self.recording = recording
        self.counters: dict[str, int] = {}
        self.step = step
        self.caches = caches
        self.cache_events: list = []
        self.cache_allocator = cache_allocator
        self.deferred: list[tuple] = []
        self.cancel = cancel
        #: Called (then cleared) before the run's first node that runs in Python and may call BLAS
        #: (``Op.uses_blas``), or None: the session's BLAS thread limit (:mod:`onnxkv._threads`), which a
        #: replayed compiled step and BLAS-free Python nodes do not need.
        self.on_python = on_python

    def nested(self, plan_alloc) -> RunContext:
        """The context of nodes run inside the current node (a subgraph's plan, a fused node's body).

        It allocates through ``plan_alloc`` and keeps its own node index;
        everything the run owns is shared with this context: deferred commits
        and rollbacks (a failed run undoes a nested node's writes too), the
        current node's storage counters and cache events, the state's caches,
        the cache allocator and the cancellation token.
        """
        sub = RunContext(plan_alloc, self.recording, self.step, self.caches, self.cache_allocator, self.cancel)
        sub.deferred, sub.counters, sub.cache_events = self.deferred, self.counters, self.cache_events
        if sub._scratch is None:  # a fused node's body: its nodes' temporaries still come from the run
            sub._scratch = self._scratch
        return sub

    def empty(self, index: int, shape, dtype) -> np.ndarray:
        return self._plan_alloc(self, index, shape, np.dtype(dtype))

    def scratch(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous temporary of the running node (a float32 widening of float16
        operands, say).  One of at least :data:`SCRATCH_POOLED` bytes comes from the run's buffers: a reuse
        when one of its size class is free, so a prompt's layers do not each map and fault in fresh memory;
        a smaller one is a NumPy array (malloc's small blocks fault nothing, and cost less than the pool's
        bookkeeping at decode sizes).  The node hands it back with :meth:`unscratch` before it returns and
        returns no view of it (one not handed back is freed when the run ends).  A nested context (a fused
        node's body) lends from its parent's run; one made by hand gives NumPy arrays."""
        bufs = self._scratch
        shape = tuple(shape)
        dtype = np.dtype(dtype)
        if bufs is None or math.prod(shape) * dtype.itemsize < SCRATCH_POOLED:
            return np.empty(shape, dtype)
        return bufs.lend(shape, dtype)

    def unscratch(self, *arrays: np.ndarray) -> None:
        """Hand back temporaries of :meth:`scratch` (the arrays it returned)."""
        bufs = self._scratch
        if bufs is not None and bufs.lent:
            for a in arrays:
                if id(a) in bufs.lent:
                    bufs.give_back(a)

    def in_place(self, past: str) -> bool:
        """True when this run binds the graph input ``past`` to a persistent cache."""
        return self.caches is not None and past in self.caches

    def cache_write(self, past: str, new: np.ndarray, starts, length: int, materialize: bool = False) -> np.ndarray:
        """Write ``new`` [B, H, S, D] into the cache bound to ``past`` in place.

        Row ``b`` is written at ``starts[b]`` (or ``starts`` for all rows); the
        cache's valid length becomes ``length`` when the run is committed.
        Returns the present value ``[:, :, :length]``: a zero-copy view of a
        contiguous cache.  A paged cache has no contiguous view: it returns a
        zero-byte placeholder of the right shape (for kernels that read the
        pages themselves), or with ``materialize=True`` a gathered copy for
        tensor consumers (counted as ``prefix_copied_bytes``).  Growth,
        copy-on-write and appended bytes are recorded as a ``cache_write``
        event of this node when the event log is on.
        """
        cache = self.caches[past]
        cost = cache.write(new, starts, length)
        if getattr(cache, "paged", False):
            present = cache.gather(length) if materialize else cache.placeholder(length)
            if materialize:
                cost.prefix_copied_bytes += present.nbytes
                cost.allocations += 1
                cost.allocated_bytes += present.nbytes
        else:
            present = cache.view(length)
        if self.recording:
            self.cache_events.append((past, cost))
        return present

    def cache_write_segments(self, past: str, new: np.ndarray) -> np.ndarray:
        """Write ``new`` [1, H, T, D], the new tokens of a run of segments (each row's after the rows before
        it, :attr:`PagedPlane.segments <onnxkv.cache.paged.PagedPlane.segments>`), into the paged cache bound
        to ``past``, each row's at its committed length; returns the present placeholder (the longest row's
        length after the write).  Recorded like :meth:`cache_write`."""
        cache = self.caches[past]
        cost = cache.write_segments(new)
        if self.recording:
            self.cache_events.append((past, cost))
        return cache.placeholder(int(cache.cache.lengths.max()))

    def cache_rows_hold(self, past: str, lengths: np.ndarray) -> None:
        """Each row ``b`` of the paged cache bound to ``past`` holds its first ``lengths[b]`` positions (int64
        [B], at most what this run wrote there): a first prompt of rows padded on the right wrote the
        padding too, which the row's next token overwrites.  A sliding window evicts from these lengths,
        not from the padded width.  A contiguous cache keeps one length for every row: nothing changes."""
        cache = self.caches[past]
        if getattr(cache, "paged", False):
            cache.cache.hold_rows(lengths)

    def cache_staged(self, past: str, cost) -> None:
        """Record the :class:`WriteCost` ``cost`` of rows a kernel wrote into the paged cache bound to
        ``past`` (staged by the cache's ``appended``), as :meth:`cache_write` records its writes."""
        if self.recording:
            self.cache_events.append((past, cost))

    def cache_appended(self, past: str, s: int, length: int, grown, starts) -> np.ndarray:
        """Record that a kernel wrote ``s`` new positions of every row of the
        contiguous cache bound to ``past`` in place at ``starts`` (one int or
        int [B]), within its capacity (see :meth:`CacheTensor.appended`),
        after the growth ``grown`` (the :class:`WriteCost` of the cache's
        ``reserve``, or None); stage ``length`` and return the present view
        ``[:, :, :length]``.  Recorded like :meth:`cache_write`."""
        cache = self.caches[past]
        if self.recording:
            self.cache_events.append((past, cache.appended(s, length, grown, starts)))
        else:  # the cost would go nowhere
            cache.stage(s, length, starts)
        return cache.view(length)

    def cache_scattered(self, past: str, s: int, starts: np.ndarray, saved: np.ndarray, length: int) -> np.ndarray:
        """Record that a kernel wrote ``s`` new positions of each row of the static contiguous cache bound to
        ``past`` in place at ``starts`` (int64 [B]), having saved the bytes it replaced in ``saved`` (see
        :meth:`CacheTensor.scattered`); return the present view ``[:, :, :length]``.  Recorded like
        :meth:`cache_write`."""
        cache = self.caches[past]
        cost = cache.scattered(starts, s, saved)
        if self.recording:
            self.cache_events.append((past, cost))
        return cache.view(length)

    def defer(self, commit, rollback) -> None:
        """Call ``commit()`` when the run succeeds, ``rollback()`` when it fails (see the class docstring);
        either may be None (nothing to do then)."""
        self.deferred.append((commit, rollback))

    def holds(self, array: np.ndarray) -> bool:
        """True when ``array`` is the whole of a value the running state holds (its persistent storage)."""
        if self.caches is None:
            return False
        address = array.__array_interface__["data"][0]
        for held in self.caches.values():
            if (
                isinstance(held, np.ndarray)
                and held.__array_interface__["data"][0] == address
                and held.shape == array.shape
                and held.dtype == array.dtype
            ):
                return True
        return False

    def preserve(self, array: np.ndarray, index) -> None:
        """Before a kernel writes ``array[index]`` in place: if ``array`` is the running state's storage
        (:meth:`holds`), save those elements (a copy of what is about to be overwritten, never more) and
        defer writing them back should the run fail or be cancelled.

        A caller's array in a plain run (MUST_ALIAS) is not saved: it is the node's output, so the
        positions a node wrote stay written whatever happens after that node.  Call it before the write
        (the rollback is then registered even if the write itself raises); ``index`` must not name an
        element twice.
        """
        if not self.holds(array):
            return
        saved = array[index]
        if np.may_share_memory(saved, array):  # basic indexing: a view, not yet a copy
            saved = saved.copy()
        self.deferred.append((None, lambda: array.__setitem__(index, saved)))

    def finish(self, ok: bool) -> None:
        """Run the deferred commits (``ok``) or rollbacks (newest first); called once by the plan."""
        work, self.deferred = self.deferred, []
        if ok:
            for commit, _ in work:
                if commit is not None:
                    commit()
        else:  # every rollback runs, even after one raised; the first error is raised after them
            error = None
            for _, rollback in reversed(work):
                if rollback is not None:
                    try:
                        rollback()
                    except BaseException as e:
                        error = error or e
            if error is not None:
                raise error

    def count(self, **counters: int) -> None:
        if self.recording:
            c = self.counters
            for k, v in counters.items():
                c[k] = c.get(k, 0) + int(v)
