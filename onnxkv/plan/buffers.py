"""Buffers of one run: taken from the session's allocator, recycled within the run.

A run allocates the outputs of its kernels through :meth:`RunBuffers.take` and
gives them back through :meth:`RunBuffers.release` after the last use of their
storage class.  A released buffer is kept in a free list keyed by its size and
handed out again to the next request of that size class (:func:`size_class`) in the same run
(decoder layers repeat the same shapes, so most requests after the first layer
are reuses, counted as ``reuse_count``).  At most ``pool_limit`` bytes are
kept for reuse; a released buffer that would exceed it goes straight back to
the allocator, so a long prefill does not hold every temporary it ever made.
:meth:`close` returns everything to the allocator at the end of the run, so
between runs the plan holds nothing -- unless the plan keeps its buffers
(``Plan(keep_buffers=True)``, what a session does with its own allocator):
then :meth:`recycle` ends a successful run instead, and the next run starts
with this run's buffers in its free lists.  Decode steps repeat the same
sizes, so a step then allocates nothing.  A buffer kept from one run that the
next run does not take is returned to the allocator at the end of that run
(a prefill's large temporaries do not outlive the first decode step), and a
buffer an output of the run may view is never kept.
"""

from __future__ import annotations

from collections import defaultdict
from math import prod

import numpy as np

from onnxkv.alloc import checked

__all__ = ["RunBuffers", "size_class", "slot_allocator"]

_WHO = "Plan temporaries"


def size_class(nbytes: int) -> int:
    """The bytes of the buffer a request of ``nbytes`` takes: a multiple of 64, and above 1 KiB of 1/16 of the
    largest power of two not above ``nbytes`` (at most 6.25% more).  A value that grows by a column per decode
    step (a mask over the cache length) then reuses its buffer for many steps instead of allocating one per
    step."""
    if nbytes <= 1024:
        return -(-nbytes // 64) * 64
    step = 1 << (nbytes.bit_length() - 5)
    return -(-nbytes // step) * step


class RunBuffers:
    """Owner of one run's temporaries (not thread-safe: one per run).

    An entry is ``(buffer, raw uint8 view of its bytes, nbytes)``.
    """

    __slots__ = ("allocator", "held", "free_lists", "pooled", "pool_limit", "used", "plan_alloc", "retired", "lent")

    def __init__(self, allocator, pool_limit: int = 64 << 20) -> None:
        self.allocator = allocator
        self.held: dict[int, tuple] = {}  # slot -> entry
        self.free_lists: defaultdict[int, list] = defaultdict(list)  # nbytes -> entries
        self.pooled = 0
        self.pool_limit = pool_limit
        self.used: set[int] = set()  # id() of the entries taken since the last recycle
        #: The run's allocation function (see slot_allocator), made once per RunBuffers.
        self.plan_alloc = None
        self.retired: list[tuple] = []  # entries kept until close, never handed out again (compiled steps)
        self.lent: dict[int, tuple] = {}  # id() of a lent array -> its entry (see lend)

    def take(self, slot: int, shape: tuple, dtype: np.dtype) -> tuple[np.ndarray, bool]:
        """A C-contiguous ``dtype`` array of ``shape`` (non-negative ints) owned by ``slot``; True if it was a reuse."""
        held = self.held
        if slot in held:
            self.release(slot)
        entry, reused, view = self._entry(shape, dtype)
        held[slot] = entry
        return view, reused

    def lend(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """A C-contiguous ``dtype`` array of ``shape`` for a node's own temporary (owned by no slot), from the
        free lists when a buffer of its size class is there.  The node gives it back (:meth:`give_back`)
        before it returns, and returns no view of it; one not given back goes to the allocator at the end of
        the run."""
        entry, _, view = self._entry(shape, dtype)
        self.lent[id(view)] = entry  # the array object itself comes back (alive until then)
        return view

    def give_back(self, array: np.ndarray) -> None:
        """Return an array of :meth:`lend` (the array object it returned, not a view of it) to the free lists
        (to the allocator past ``pool_limit``)."""
        entry = self.lent.pop(id(array))
        if not self._keep(entry):
            checked.release(self.allocator, [entry[0]], _WHO, strict=True)

    def _entry(self, shape: tuple, dtype: np.dtype) -> tuple[tuple, bool, np.ndarray]:
        """(entry, reused, the ``dtype`` array of ``shape`` on it) for a new request, marked used."""
        nbytes = dtype.itemsize * int(prod(shape))
        size = size_class(nbytes)
        lst = self.free_lists.get(size)
        if lst:
            entry = lst.pop()
            self.pooled -= size
            reused = True
        else:
            buf, raw = checked.lease(self.allocator, size, 64, np.uint8, (size,), _WHO)
            entry = (buf, raw, size)
            reused = False
        self.used.add(id(entry))
        return entry, reused, entry[1][:nbytes].view(dtype).reshape(shape)

    def release(self, slot: int) -> None:
        """Return ``slot``'s buffer to the free lists (to the allocator past ``pool_limit``); no-op if it has none.

        A ``free`` that raises (the run is still going: nothing is published)
        raises :class:`~onnxkv.errors.StateError` naming the allocator; the
        buffer is forgotten either way.
        """
        entry = self.held.pop(slot, None)
        if entry is not None and not self._keep(entry):
            checked.release(self.allocator, [entry[0]], _WHO, strict=True)

    def _keep(self, entry: tuple) -> bool:
        """Put ``entry`` in the free lists if it fits under ``pool_limit``; False if it does not."""
        n = entry[2]
        if self.pooled + n > self.pool_limit:
            return False
        self.free_lists[n].append(entry)
        self.pooled += n
        return True

    def recycle(self, outputs) -> None:
        """End a successful run keeping buffers for the next one (see the module docstring).

        Free-list entries not taken since the last recycle and held entries
        that one of ``outputs`` (the arrays the run returns) may view go back
        to the allocator; every other held entry moves to the free lists.
        The run has succeeded: a ``free`` that raises is logged.
        """
        used = self.used
        if not self.held and not any(self.free_lists.values()) and not self.lent:  # kept nothing (a replayed step)
            used.clear()
            return
        gone = list(self.lent.values())  # lent and never given back (a node's error path): not kept
        self.lent.clear()
        free_lists = self.free_lists
        for n, lst in list(free_lists.items()):
            stale = [e for e in lst if id(e) not in used]
            if stale:
                lst[:] = [e for e in lst if id(e) in used]
                self.pooled -= n * len(stale)
                gone += stale
            if not lst:  # sizes that grow every step (a cache-length mask) must not pile up keys
                del free_lists[n]
        arrays = [o for o in outputs if isinstance(o, np.ndarray)]
        for slot, entry in list(self.held.items()):
            del self.held[slot]
            if any(np.may_share_memory(o, entry[1]) for o in arrays) or not self._keep(entry):
                gone.append(entry)
        used.clear()
        if gone:
            checked.release(self.allocator, [e[0] for e in gone], _WHO)

    def close(self) -> None:
        """Return every buffer to the allocator (the end of a run, failed or not: a ``free`` that raises is
        logged)."""
        gone = [e[0] for e in self.held.values()] + [e[0] for lst in self.free_lists.values() for e in lst]
        gone += [e[0] for e in self.retired] + [e[0] for e in self.lent.values()]
        self.retired.clear()
        self.lent.clear()
        self.held.clear()
        self.free_lists.clear()
        self.pooled = 0
        checked.release(self.allocator, gone, _WHO)


def slot_allocator(bufs: RunBuffers, persistent: list[bool], out_idx: list[tuple]):
    """The ``rt.empty`` of a plan's runs using ``bufs``: output ``index`` of the running node as a new
    array when its slot is persistent (it may reach the caller) or the node has no such output, else
    a buffer of ``bufs`` owned by the slot; counted in the run's counters when it records.  Its attribute
    ``buffers`` is ``bufs`` (the run's temporaries, :meth:`RunContext.scratch`)."""
    take = bufs.take

    def alloc(rt, index: int, shape, dtype: np.dtype) -> np.ndarray:
        s = out_idx[rt._node][index]
        if s < 0 or persistent[s]:
            arr, reused = np.empty(shape, dtype), False
        else:
            arr, reused = take(s, shape, dtype)
        if rt.recording:
            c = rt.counters
            if reused:
                c["reuse_count"] = c.get("reuse_count", 0) + 1
            else:
                c["allocations"] = c.get("allocations", 0) + 1
                c["allocated_bytes"] = c.get("allocated_bytes", 0) + arr.nbytes
        return arr

    alloc.buffers = bufs
    return alloc
