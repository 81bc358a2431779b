"""Contiguous, persistent, in-place KV cache storage.

A :class:`CacheTensor` holds one cache value (the keys *or* the values of one
layer) as ``[batch, kv_heads, capacity, head_size]`` in a buffer from the
state's persistent allocator.  ``length`` is the number of positions that are
valid (the view a standard model sees as its ``past``); positions at and
after ``length`` hold garbage.

Writes only ever touch positions ``>= start`` of the rows being written, and
the new length is *staged*: the owning state commits it after the whole run
succeeded, or discards it.  So a failed run leaves every valid byte as it was.

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
from onnxkv.errors import CacheCapacityError

__all__ = ["CacheTensor", "WriteCost", "stored_to_float32"]


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


@dataclass
class WriteCost:
    """Bytes one cache action allocated and copied (for the event log)."""

    allocations: int = 0
    allocated_bytes: int = 0
    prefix_copied_bytes: int = 0
    append_copied_bytes: int = 0
    cow_copied_bytes: int = 0


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

    Ownership: the state owning this object is the only writer.  ``view()``
    and ``buffer`` are handed to kernels of that state's runs only.
    """

    def __init__(self, name: str, shape: tuple[int, int, int], dtype, allocator, capacity: int,
                 growable: bool = True, max_capacity: int | None = None, storage: str | None = None) -> None:
        if capacity < 1:
            raise CacheCapacityError(f"cache '{name}': capacity must be at least 1, got {capacity}")
        self.name = name
        self.batch, self.heads, self.head_size = (int(x) for x in shape)
        if storage not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"cache '{name}': storage must be None, 'float32', 'float16' or 'bfloat16', got {storage!r}")
        #: Name of the stored format ("bfloat16" is held as uint16 bit patterns).
        self.storage = storage or np.dtype(dtype).name
        self.dtype = np.dtype(np.uint16) if self.storage == "bfloat16" else np.dtype(self.storage)
        self.allocator = allocator
        self.growable = growable
        self.max_capacity = max_capacity
        self.length = 0
        self.staged: int | None = None
        self.growths = 0
        self._buf, self.buffer = self._allocate(capacity)

    # -- storage ---------------------------------------------------------
    def _allocate(self, capacity: int):
        """(buffer, array [B, H, capacity, D]) leased and checked (:func:`onnxkv.alloc.checked.lease`)."""
        shape = (self.batch, self.heads, capacity, self.head_size)
        nbytes = self.batch * self.heads * capacity * self.head_size * self.dtype.itemsize
        buf, arr = checked.lease(self.allocator, nbytes, 64, self.dtype, shape, f"cache '{self.name}'")
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
        buf = self._buf
        if buf is not None:
            bound.unregister(id(buf))
            self._buf = None
            self.buffer = None
            checked.release(self.allocator, [buf], f"cache '{self.name}'")

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
            raise CacheCapacityError(
                f"cache '{self.name}': {needed} positions needed, fixed capacity is {cap}")
        new_cap = cap
        while new_cap < needed:
            new_cap *= 2
        if self.max_capacity is not None:
            if needed > self.max_capacity:
                raise CacheCapacityError(
                    f"cache '{self.name}': {needed} positions needed, max capacity is {self.max_capacity}")
            new_cap = min(new_cap, self.max_capacity)
        new_buf, arr = self._allocate(new_cap)  # OutOfMemory here leaves everything as it was
        valid = max(self.length, self.staged or 0)
        arr[:, :, :valid] = self.buffer[:, :, :valid]
        old = self._buf
        bound.unregister(id(old))
        self._buf, self.buffer = new_buf, arr
        self.growths += 1
        checked.release(self.allocator, [old], f"cache '{self.name}'", strict=True)
        return WriteCost(1, arr.nbytes, self.batch * self.heads * valid * self.head_size * self.dtype.itemsize, 0)

    def write(self, new: np.ndarray, starts: np.ndarray | int, length: int) -> WriteCost:
        """Write ``new`` [B, H, S, D] at positions ``starts[b] ...`` of each row; stage ``length``.

        ``starts`` is one int for every row or an int array [B].  Returns the
        cost: growth (if any) plus the appended bytes.
        """
        b, h, s, d = new.shape
        if (b, h, d) != (self.batch, self.heads, self.head_size):
            raise CacheCapacityError(
                f"cache '{self.name}': update of shape {new.shape} does not fit "
                f"[{self.batch}, {self.heads}, capacity, {self.head_size}]")
        if self.storage == "bfloat16":
            new = _to_bf16(new)
        if not isinstance(starts, np.ndarray) or starts.ndim == 0:
            start = int(starts)
            cost = self.reserve(max(start + s, length))
            self.buffer[:, :, start:start + s] = new
        else:
            first = int(starts[0])
            if b == 1 or (starts == first).all():
                cost = self.reserve(max(first + s, length))
                self.buffer[:, :, first:first + s] = new
            else:
                cost = self.reserve(max(int(starts.max()) + s, length))
                for row in range(b):
                    p = int(starts[row])
                    self.buffer[row, :, p:p + s] = new[row]
        return self._staged_append(cost, s, length)

    def appended(self, s: int, length: int, cost: WriteCost | None = None) -> WriteCost:
        """Account for ``s`` positions of every row that a kernel wrote in place
        (within the capacity, at or after the valid length) and stage
        ``length``; returns ``cost`` (e.g. a growth by :meth:`reserve`) plus
        the appended bytes."""
        return self._staged_append(cost or WriteCost(), s, length)

    def _staged_append(self, cost: WriteCost, s: int, length: int) -> WriteCost:
        cost.append_copied_bytes += self.batch * self.heads * s * self.head_size * self.dtype.itemsize
        self.staged = length
        return cost

    def commit(self) -> None:
        """Publish the staged length (after a successful run)."""
        if self.staged is not None:
            self.length = self.staged
            self.staged = None

    def discard(self) -> None:
        """Forget the staged length (after a failed run)."""
        self.staged = None
