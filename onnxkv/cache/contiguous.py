"""Contiguous, persistent, in-place KV cache storage.

A :class:`CacheTensor` holds one cache value (the keys *or* the values of one
layer) as ``[batch, kv_heads, capacity, head_size]`` in a buffer from the
state's persistent allocator.  ``length`` is the number of positions that are
valid (the view a standard model sees as its ``past``: the longest row);
``lengths`` (int64 [batch]) is what each row has written: row ``b`` holds
values this cache was given at positions ``[0, lengths[b])`` (a row that
rewrites earlier positions keeps its length, as ``length`` does).

Rows are bounded by what they wrote: a write starting past a row's written
length (a claimed past the row never wrote) raises
:class:`~onnxkv.errors.InputError` before any byte is written.  As defence in
depth every buffer is zero-filled when it is allocated (a growth: the part
past the copied prefix), so bytes of an earlier request that used the same
memory are never readable, whatever reads the buffer.

Writes only ever touch positions ``>= start`` of the rows being written, and
the new lengths are *staged*: the owning state commits them after the whole
run succeeded, or discards them.  A write that overwrites committed positions
(below ``length``; anywhere in a static cache) first saves exactly the bytes
it replaces (O(new tokens)), and a growth keeps the previous buffer until the
run ends; :meth:`CacheTensor.discard` puts both back.  So a failed run leaves
every committed byte, the lengths and the storage as they were.

A *static* cache (``static=True``, the TensorScatter convention) has a fixed
capacity that is the whole past the model reads (zeros where nothing was
written); its ``length`` is the valid length: one past the highest position
any committed write reached (0 before the first write).  Its writes may go
to any position (the zeros before them are what the model reads there), so
the row bound above does not apply to it.

Storage may be narrower than the model's element type: ``storage="float16"``
or ``"bfloat16"`` (bf16 kept as uint16 bit patterns) halves the bytes held and
read; writes convert (round to nearest even) and the attention kernel converts
back in its load step.

Capacity is fixed (``growable=False``: overflow raises
:class:`~onnxkv.errors.CacheCapacityError` before anything is written) or
grows geometrically, doubling until it fits (the valid prefix is copied once
per growth; the copy is reported to the caller for the event log).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxkv import _kernels
from onnxkv.alloc import checked
from onnxkv.cache import bound
from onnxkv.errors import CacheCapacityError, InputError

__all__ = ["CacheTensor", "WriteCost", "stored_to_float32", "rows_past"]


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round to nearest even (compiled kernel)."""
    src = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(src.shape, np.uint16)
    _kernels.f32_to_bf16(src, out)
    return out


def stored_to_float32(v: np.ndarray, storage: str) -> np.ndarray:
    """A float32 copy of cache elements stored as ``storage`` (bfloat16 as uint16 bit patterns)."""
    if storage == "bfloat16":
        out = np.empty(v.shape, np.float32)
        _kernels.bf16_to_f32(np.ascontiguousarray(v), out)
        return out
    return v.astype(np.float32)


def rows_past(starts: np.ndarray | int, lengths: np.ndarray) -> tuple[int, int, int] | None:
    """``(row, start, length)`` of the first row whose start (``starts``: one int or int [B]) passes its
    length (``lengths`` int [B]), or None.  O(B)."""
    if not (isinstance(starts, np.ndarray) and starts.shape == lengths.shape):  # a row each already: as given
        starts = np.broadcast_to(np.asarray(starts), lengths.shape)
    over = starts > lengths
    if not over.any():
        return None
    row = int(np.argmax(over))
    return row, int(starts[row]), int(lengths[row])


@dataclass
class WriteCost:
    """Bytes one cache action allocated and copied (for the event log)."""

    allocations: int = 0
    allocated_bytes: int = 0
    prefix_copied_bytes: int = 0
    append_copied_bytes: int = 0
    cow_copied_bytes: int = 0


def _uniform(rows: np.ndarray) -> int | np.ndarray:
    """Per-row written lengths as one int when every row has the same (the common case: later appends at
    one start stay on the int path, no array work per token), else ``rows`` itself."""
    if not rows.shape[0]:
        return rows
    first = int(rows[0])
    return first if rows.shape[0] == 1 or bool((rows == first).all()) else rows


class CacheTensor:
    """One persistent cache value; see the module docstring.

    Args:
        name: the graph input it feeds (``past_key_values.N.key``).
        shape: ``(batch, kv_heads, head_size)``.
        dtype: element type.
        allocator: persistent allocator (``allocate``/``free``/``stats``).
        capacity: initial capacity in positions (> 0).
        growable: grow geometrically past ``capacity`` instead of raising.
        max_capacity: never grow past this (None = unbounded).
        static: a static cache (see the module docstring): never grows,
            ``length`` is the high-water mark of the positions written and
            every position of the capacity is committed storage.

    Ownership: the state owning this object is the only writer.  ``view()``
    and ``buffer`` are handed to kernels of that state's runs only.

    ``length`` (int) and ``lengths`` (int64 [batch], read only) are the
    committed valid length and each row's written length; ``staged`` the
    length the run in progress staged (None when it has written nothing).
    Row lengths are held as one int while every row has the same (appends
    of every row, a batch of one: no array operation per token), else as an
    array.  Setting ``length`` below its value (truncation) cuts every row
    to at most the new length; raising it without a write (a static cache:
    the whole zero-filled buffer is valid) makes every row hold that many
    positions.
    """

    def __init__(
        self,
        name: str,
        shape: tuple[int, int, int],
        dtype,
        allocator,
        capacity: int,
        growable: bool = True,
        max_capacity: int | None = None,
        storage: str | None = None,
        static: bool = False,
    ) -> None:
        if capacity < 1:
            raise CacheCapacityError(f"cache '{name}': capacity must be at least 1, got {capacity}")
        self.name = name
        self.batch, self.heads, self.head_size = (int(x) for x in shape)
        if storage not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(
                f"cache '{name}': storage must be None, 'float32', 'float16' or 'bfloat16', got {storage!r}"
            )
        #: Name of the stored format ("bfloat16" is held as uint16 bit patterns).
        self.storage = storage or np.dtype(dtype).name
        self.dtype = np.dtype(np.uint16) if self.storage == "bfloat16" else np.dtype(self.storage)
        self.allocator = allocator
        self.static = bool(static)
        self.growable = growable and not self.static
        self.max_capacity = max_capacity
        self._length = 0
        # positions each row has written: one int for every row, or int64 [batch]; committed and staged
        self._rows: int | np.ndarray = 0
        self._staged_rows: int | np.ndarray | None = None
        self.staged: int | None = None
        self.growths = 0
        self._buf, self.buffer = self._allocate(capacity, 0)
        #: The run's undo: (row or None, start, saved bytes) of committed positions it overwrote, and the
        #: (buffer, array) it grew from; :meth:`commit` drops them, :meth:`discard` puts them back.
        self._saved: list[tuple[int | None, int, np.ndarray]] = []
        self._grown_from: tuple | None = None

    @property
    def length(self) -> int:
        """Committed valid length (the longest row's)."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        value = int(value)
        rows = self._rows
        if value > self._length:
            self._rows = value
        else:
            self._rows = min(rows, value) if isinstance(rows, int) else _uniform(np.minimum(rows, value))
        self._length = value

    @property
    def lengths(self) -> np.ndarray:
        """Committed positions each row has written (int64 [batch]; a new array when rows are equal)."""
        rows = self._rows
        return np.full(self.batch, rows, np.int64) if isinstance(rows, int) else rows

    def short_row(self, starts: np.ndarray | int) -> tuple[int, int, int] | None:
        """``(row, start, written length)`` of the first row whose start (``starts``: one int or int [B])
        passes what it has written, or None (always None for a static cache: it may be written anywhere)."""
        if self.static:
            return None
        rows = self._rows
        if isinstance(rows, int) and isinstance(starts, int):
            return None if starts <= rows else (0, starts, rows)
        return rows_past(starts, self.lengths)

    # -- storage ---------------------------------------------------------
    def _allocate(self, capacity: int, keep: int):
        """(buffer, array [B, H, capacity, D]) leased and checked (:func:`onnxkv.alloc.checked.lease`),
        zero-filled past position ``keep`` (the prefix the caller copies in): one fill per allocation, never
        per token."""
        shape = (self.batch, self.heads, capacity, self.head_size)
        nbytes = self.batch * self.heads * capacity * self.head_size * self.dtype.itemsize
        buf, arr = checked.lease(self.allocator, nbytes, 64, self.dtype, shape, f"cache '{self.name}'")
        arr[:, :, keep:] = 0
        bound.register(id(buf), arr)
        return buf, arr

    @property
    def capacity(self) -> int:
        return self.buffer.shape[2]

    @property
    def nbytes(self) -> int:
        """Committed bytes of this cache value (its whole capacity)."""
        return self.buffer.nbytes

    def as_float32(self, length: int | None = None) -> np.ndarray:
        """A float32 copy of ``view(length)`` (converting from the stored format)."""
        return stored_to_float32(self.view(length), self.storage)

    def view(self, length: int | None = None) -> np.ndarray:
        """Zero-copy view ``buffer[:, :, :length]`` (default: the valid length)."""
        return self.buffer[:, :, : self.length if length is None else length]

    def release(self) -> None:
        """Return the storage to the allocator (the object is unusable after).

        The storage is forgotten first; a ``free`` that raises is logged (a
        state releases every cache whatever the allocator does).
        """
        self._saved = []
        if self._grown_from is not None:
            self._free(self._grown_from[0])
            self._grown_from = None
        buf = self._buf
        if buf is not None:
            self._buf = None
            self.buffer = None
            self._free(buf)

    def _free(self, buf, strict: bool = False) -> None:
        """Give ``buf`` back (:func:`onnxkv.alloc.checked.release`): a ``free`` that raises is logged, or
        with ``strict`` (storage of a run still in progress) raised as StateError once the cache is whole."""
        bound.unregister(id(buf))
        checked.release(self.allocator, [buf], f"cache '{self.name}'", strict=strict)

    # -- writes ------------------------------------------------------------
    def reserve(self, needed: int) -> WriteCost:
        """Make room for ``needed`` positions, growing geometrically if allowed.

        Raises :class:`CacheCapacityError` (nothing changed) when the cache is
        fixed or would pass ``max_capacity``, or the allocator's errors
        (:func:`onnxkv.alloc.checked.lease`, nothing changed).  After a
        growth the old storage is freed: a ``free`` that raises leaves the
        grown cache in place and raises :class:`~onnxkv.errors.StateError`
        naming the allocator (the run fails before anything is published).
        """
        cap = self.capacity
        if needed <= cap:
            return WriteCost()
        if not self.growable:
            raise CacheCapacityError(f"cache '{self.name}': {needed} positions needed, fixed capacity is {cap}")
        new_cap = cap
        while new_cap < needed:
            new_cap *= 2
        if self.max_capacity is not None:
            if needed > self.max_capacity:
                raise CacheCapacityError(
                    f"cache '{self.name}': {needed} positions needed, max capacity is {self.max_capacity}"
                )
            new_cap = min(new_cap, self.max_capacity)
        valid = max(self.length, self.staged or 0)
        new_buf, arr = self._allocate(new_cap, valid)  # OutOfMemory here leaves everything as it was
        arr[:, :, :valid] = self.buffer[:, :, :valid]
        old = None
        if self._grown_from is None:
            self._grown_from = (self._buf, self.buffer)  # the committed storage: kept until the run ends
        else:
            old = self._buf  # a buffer this run grew into before: nobody else holds it
        self._buf, self.buffer = new_buf, arr
        self.growths += 1
        if old is not None:
            self._free(old, strict=True)
        return WriteCost(1, arr.nbytes, self.batch * self.heads * valid * self.head_size * self.dtype.itemsize, 0)

    def write(self, new: np.ndarray, starts: np.ndarray | int, length: int) -> WriteCost:
        """Write ``new`` [B, H, S, D] at positions ``starts[b] ...`` of each row; stage ``length`` and
        the rows' written lengths (at least ``starts[b] + S``).

        ``starts`` is one int for every row or an int array [B], each at most
        the row's written length (:meth:`check_starts`; InputError before
        anything is written otherwise).  Returns the cost: growth (if any)
        plus the appended bytes.
        """
        b, h, s, d = new.shape
        if (b, h, d) != (self.batch, self.heads, self.head_size):
            raise CacheCapacityError(
                f"cache '{self.name}': update of shape {new.shape} does not fit "
                f"[{self.batch}, {self.heads}, capacity, {self.head_size}]"
            )
        self.check_starts(starts)
        if self.storage == "bfloat16":
            new = _to_bf16(new)
        if not isinstance(starts, np.ndarray) or starts.ndim == 0:
            start = int(starts)
            cost = self.reserve(max(start + s, length))
            self._save(None, start, s)
            self.buffer[:, :, start : start + s] = new
            end = start + s
        else:
            first = int(starts[0])
            if b == 1 or (starts == first).all():
                cost = self.reserve(max(first + s, length))
                self._save(None, first, s)
                self.buffer[:, :, first : first + s] = new
                end = first + s
            else:
                end = int(starts.max()) + s
                cost = self.reserve(max(end, length))
                for row in range(b):
                    p = int(starts[row])
                    self._save(row, p, s)
                    self.buffer[row, :, p : p + s] = new[row]
        if self.static:
            length = self._static_length(end if s else 0)
        return self._staged_append(cost, s, length, starts)

    def _static_length(self, end: int) -> int:
        """A static cache's length after a write ending at ``end`` (0: none): one past the highest position
        written, by this run or committed."""
        return max(self.length if self.staged is None else self.staged, end)

    def _save(self, row: int | None, start: int, s: int) -> None:
        """Keep the committed bytes that positions ``[start, start + s)`` of ``row`` (None: every row) hold."""
        stop = min(start + s, self.capacity if self.static else self.length)
        if start < stop:
            rows = slice(None) if row is None else row
            self._saved.append((row, start, self.buffer[rows, :, start:stop].copy()))

    def save_rows(self, starts: np.ndarray, s: int) -> None:
        """Keep the committed bytes that positions ``[starts[b], starts[b] + s)`` of each row hold (int64 [B];
        below :attr:`length`), as :meth:`write` does before writing there: for a kernel about to write those
        positions in place (:meth:`appended` then stages them), so that :meth:`discard` restores them."""
        for row in np.flatnonzero(starts < self.length).tolist():
            self._save(row, int(starts[row]), s)

    def saved_rows(self, starts: np.ndarray, s: int, old: np.ndarray) -> None:
        """:meth:`save_rows` for bytes a kernel copied itself before writing: ``old`` [B, H, s, D] holds, for
        each row with ``starts[b]`` below :attr:`length` (a static cache: its capacity), what positions
        ``[starts[b], min(starts[b] + s, length))`` held (copied here: the kernel's buffer is reused)."""
        limit = self.capacity if self.static else self.length
        for row in np.flatnonzero(starts < limit).tolist():
            start = int(starts[row])
            self._saved.append((row, start, old[row, :, : min(s, limit - start)].copy()))

    def check_starts(self, starts: np.ndarray | int) -> None:
        """Raise :class:`~onnxkv.errors.InputError` when a write at ``starts`` (one int or int [B]) would
        leave positions a row never wrote before its new values: ``starts[b]`` past ``lengths[b]``."""
        short = self.short_row(starts)
        if short is not None:
            raise InputError(
                f"cache '{self.name}': row {short[0]} would be written at position {short[1]} but "
                f"has written only {short[2]} positions; a row may only continue from what it wrote"
            )

    def scattered(self, starts: np.ndarray, s: int, saved: np.ndarray) -> WriteCost:
        """Account for ``s`` positions of each row that a kernel wrote in place into this static cache at
        ``starts`` (int64 [B], each in ``[0, capacity - s]``, checked by the caller) after copying the bytes
        they replaced into ``saved`` [B, H, s, D] (kept, copied, to undo the run); stage the lengths as
        :meth:`write` does for a static cache.  Returns the appended bytes."""
        for row in range(self.batch):
            self._saved.append((row, int(starts[row]), saved[row].copy()))
        length = self._static_length(int(starts.max()) + s if s else 0)
        return self._staged_append(WriteCost(), s, length, starts)

    def appended(self, s: int, length: int, cost: WriteCost | None, starts: np.ndarray | int) -> WriteCost:
        """Account for ``s`` positions of every row that a kernel wrote in place
        at ``starts`` (within the capacity, each at most the row's written
        length, checked by the caller) and stage ``length``; returns ``cost``
        (e.g. a growth by :meth:`reserve`) plus the appended bytes."""
        return self._staged_append(cost or WriteCost(), s, length, starts)

    def _staged_append(self, cost: WriteCost, s: int, length: int, starts: np.ndarray | int) -> WriteCost:
        cost.append_copied_bytes += self.batch * self.heads * s * self.head_size * self.dtype.itemsize
        self.stage(s, length, starts)
        return cost

    def stage(self, s: int, length: int, starts: np.ndarray | int) -> None:
        """:meth:`appended` without its cost, for a run that records no events: stage ``length`` and the
        rows' written lengths after ``s`` positions written at ``starts``."""
        self.staged = length
        if s:
            rows = self._rows
            if isinstance(rows, int) and isinstance(starts, int):
                self._staged_rows = max(rows, starts + s)
            else:
                self._staged_rows = _uniform(np.maximum(rows, np.add(starts, s, dtype=np.int64)))

    def commit(self) -> None:
        """Publish the staged lengths (after a successful run); free the storage a growth replaced."""
        if self.staged is not None:
            self._length = self.staged
            self.staged = None
        if self._staged_rows is not None:
            self._rows = self._staged_rows
            self._staged_rows = None
        self._saved = []
        if self._grown_from is not None:
            self._free(self._grown_from[0])
            self._grown_from = None

    def discard(self) -> None:
        """Undo the run (after a failure): back to the storage before any growth, the overwritten
        committed bytes restored, the staged lengths forgotten."""
        self.staged = None
        self._staged_rows = None
        if self._grown_from is not None:
            self._free(self._buf)
            (self._buf, self.buffer), self._grown_from = self._grown_from, None
        saved, self._saved = self._saved, []
        for row, start, old in reversed(saved):
            self.buffer[slice(None) if row is None else row, :, start : start + old.shape[-2]] = old
