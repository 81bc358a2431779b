"""Per-run context handed to kernels: output allocation and storage counters."""

from __future__ import annotations

import numpy as np

from onnxkv.events import COUNTER_FIELDS

__all__ = ["RunContext", "STORAGE_COUNTERS"]

#: Counters a kernel may add to the storage event of the node it runs.
STORAGE_COUNTERS = COUNTER_FIELDS


class RunContext:
    """What a kernel sees of the run it belongs to.

    ``empty(index, shape, dtype)`` returns an uninitialised C-contiguous array
    for output ``index`` of the node being run.  Where the plan owns the
    value's lifetime the memory comes from the session's allocator and is
    returned to it after the value's last use; values that reach the caller
    (graph outputs, or views of them) get ordinary NumPy memory.  The kernel
    must write every element it returns.

    ``count(**counters)`` adds storage counters (names in
    :data:`STORAGE_COUNTERS`) to the current node's event; it costs nothing
    when the event log is off.
    """

    __slots__ = ("_plan_alloc", "_node", "counters", "recording", "step")

    def __init__(self, plan_alloc, recording: bool, step: int) -> None:
        self._plan_alloc = plan_alloc
        self._node = 0
        self.recording = recording
        self.counters: dict[str, int] = {}
        self.step = step

    def empty(self, index: int, shape, dtype) -> np.ndarray:
        return self._plan_alloc(self, index, shape, np.dtype(dtype))

    def count(self, **counters: int) -> None:
        if self.recording:
            c = self.counters
            for k, v in counters.items():
                c[k] = c.get(k, 0) + int(v)
