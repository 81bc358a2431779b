"""Allocators that break the Allocator protocol in one chosen way (for the tests of what onnxkv checks).

:class:`Hostile` delegates to an inner allocator (a new
:class:`~onnxkv.alloc.SystemAllocator` unless given).
While its ``mode`` is set, every allocation after the first ``after`` ones is
broken that way; ``mode = None`` makes it a good allocator again.  With
``free_raises`` set, ``free`` forgets nothing and raises ``RuntimeError``.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from onnxkv.alloc import AllocatorStats, SystemAllocator
from onnxkv.errors import InputError, OutOfMemory

#: mode -> (onnxkv error raised for it, a fragment of its message)
MODES = {
    "negative": (InputError, "negative strides"),
    "flat": (InputError, "returned shape"),
    "short": (InputError, "returned shape"),
    "misaligned": (InputError, "not a multiple of the alignment"),
    "readonly": (InputError, "read-only"),
    "strided": (InputError, "not C-contiguous"),
    "not-array": (InputError, "not a NumPy array"),
    "other": (InputError, "not at the buffer's address"),
    "twice": (InputError, "still leased"),
    "overlap": (InputError, "still leased"),
    "small": (OutOfMemory, "fewer than"),
    "raise-type": (OutOfMemory, "raised TypeError"),
    "raise-memory": (OutOfMemory, "raised MemoryError"),
}
#: modes whose views are fine for one-dimensional byte requests but break only typed ones
TYPED_ONLY = {"byteswapped": (InputError, "returned dtype")}


class HostileBuffer:
    """``nbytes`` bytes of ``inner`` (a buffer of the inner allocator) from ``offset`` on, viewed the ``mode`` way."""

    def __init__(self, inner, nbytes: int, mode: str | None, offset: int = 0, owns: bool = True) -> None:
        self.inner, self.mode, self.offset, self.owns = inner, mode, offset, owns
        self.nbytes = nbytes
        self.address = inner.address + offset

    def view(self, dtype, shape):
        dt = np.dtype(dtype)
        shape = tuple(shape) if isinstance(shape, tuple) else (shape,)
        size = int(np.prod(shape)) * dt.itemsize
        raw = self.inner.view(np.uint8, (self.inner.nbytes,))[self.offset :]
        good = raw[:size].view(dt).reshape(shape)
        mode = self.mode
        if mode == "negative":
            return good[::-1]
        if mode == "flat":
            return good.reshape(1, -1) if good.ndim == 1 else good.reshape(-1)
        if mode == "short":
            return good.reshape(-1)[: max(0, good.size - 1)]
        if mode == "readonly":
            good.flags.writeable = False
            return good
        if mode == "strided":
            return as_strided(raw.view(dt), shape, tuple(2 * s for s in good.strides), writeable=True)
        if mode == "not-array":
            return memoryview(good)
        if mode == "other":
            return np.zeros(shape, dt)
        if mode == "byteswapped":
            return good.view(dt.newbyteorder())
        return good

    def __repr__(self) -> str:
        return f"<HostileBuffer {self.mode or 'good'} nbytes={self.nbytes}>"


class Hostile:
    """An allocator whose allocations after the first ``after`` are broken the ``mode`` way."""

    def __init__(self, mode: str | None = None, after: int = 0, inner=None) -> None:
        self.inner = SystemAllocator() if inner is None else inner
        self.mode, self.after = mode, after
        self.calls = 0
        self.free_raises = False
        self.live: dict[int, HostileBuffer] = {}  # the buffers handed out and not freed, by id

    def allocate(self, nbytes: int, alignment: int = 64) -> HostileBuffer:
        self.calls += 1
        mode = self.mode if self.calls > self.after else None
        if mode == "raise-type":
            raise TypeError("hostile allocate refuses")
        if mode == "raise-memory":
            raise MemoryError("hostile allocate is out of memory")
        big = max(self.live.values(), key=lambda b: b.nbytes, default=None)
        if mode in ("twice", "overlap") and big is not None and big.nbytes >= nbytes:
            if mode == "twice":  # the largest live buffer, again
                return big
            return HostileBuffer(big.inner, nbytes, None, big.offset, owns=False)
        if mode == "small":
            inner = self.inner.allocate(max(0, nbytes - 1), alignment)
            return HostileBuffer(inner, max(0, nbytes - 1), None)
        if mode == "misaligned":
            return HostileBuffer(self.inner.allocate(nbytes + 64, alignment), nbytes, None, offset=8)
        if mode == "strided":
            return HostileBuffer(self.inner.allocate(2 * nbytes, alignment), nbytes, mode)
        buf = HostileBuffer(self.inner.allocate(nbytes, alignment), nbytes, mode)
        self.live[id(buf)] = buf
        return buf

    def free(self, buffer: HostileBuffer) -> None:
        if self.free_raises:
            raise RuntimeError(f"hostile free refuses {buffer!r}")
        self.live.pop(id(buffer), None)
        if buffer.owns:
            self.inner.free(buffer.inner)

    def stats(self) -> AllocatorStats:
        return self.inner.stats()

    def __repr__(self) -> str:
        return f"Hostile({self.mode!r})"
