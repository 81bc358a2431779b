"""Where a plan's weights live (:func:`weight_bytes`): kernel-owned layouts, file mappings, memory.

The event log counts cache storage; this counts the model's side.  Three kinds of bytes:

* ``kernels``: arrays the kernel objects hold for themselves -- packed float32 panels, 4- and 8-bit
  panels (``PackedNBits``, ``PackedInt8Weight``), gathered quantized tables, codebooks, attribute
  tensors -- in the process's memory for the session's lifetime;
* ``mapped``: constants the plan reads at run time from read-only file mappings (external data, and
  the large inline tensors :mod:`onnxkv.model.inline_data` leaves in the model file): page cache,
  resident only while read and shared with every process mapping the file;
* ``in_memory``: the plan's other run-time constants (small inline tensors, folded values, aligned
  copies of misaligned mappings).

Each buffer counts once, under the first kind that reaches it (the plan's values before kernels), and
subgraph plans (control flow) count with their node's plan.  Weights a kernel packed are not counted
again where they came from: their mappings are released and the plan drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf.message import Message

__all__ = ["WeightBytes", "weight_bytes"]

_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None), Message, np.generic, np.dtype, type)
_DEPTH = 6


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of a plan's weights by where they live (see the module docstring)."""

    kernels: int
    mapped: int
    in_memory: int

    @property
    def resident(self) -> int:
        """Bytes the process holds whatever it reads: ``kernels`` + ``in_memory``."""
        return self.kernels + self.in_memory


def _root(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """The array owning ``a``'s memory (the last array of its base chain) and whether it is a file mapping."""
    mapped = False
    while True:
        mapped = mapped or (isinstance(a, np.memmap) and a.filename is not None)
        if not isinstance(a.base, np.ndarray):
            return a, mapped
        a = a.base


class _Tally:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = {"kernels": 0, "mapped": 0, "in_memory": 0}

    def array(self, a: np.ndarray, kind: str) -> None:
        root, mapped = _root(a)
        if id(root) not in self.seen:
            self.seen.add(id(root))
            self.bytes["mapped" if mapped else kind] += root.nbytes

    def plan(self, plan) -> None:
        for value in plan._template:
            if isinstance(value, np.ndarray):
                self.array(value, "in_memory")
        for kernel in plan.kernels:
            self.walk(kernel, _DEPTH, set())

    def walk(self, obj, depth: int, visiting: set[int]) -> None:
        """Arrays and packed weights reachable from ``obj`` (attributes, containers, nested kernels)."""
        from onnxkv.plan.plan import Plan
        from onnxkv.plan.registry import BuildContext

        if isinstance(obj, _SCALARS) or isinstance(obj, BuildContext) or depth == 0 or id(obj) in visiting:
            return
        if isinstance(obj, np.ndarray):
            self.array(obj, "kernels")
            return
        if isinstance(obj, Plan):
            self.plan(obj)
            return
        nbytes = getattr(type(obj), "nbytes", None)
        if nbytes is not None and not hasattr(obj, "__dict__"):  # a compiled packed weight (its own arrays)
            if hasattr(type(obj), "arrays"):  # arrays it may share with another weight: counted by their roots
                for a in obj.arrays:
                    self.array(a, "kernels")
            elif id(obj) not in self.seen:
                self.seen.add(id(obj))
                self.bytes["kernels"] += int(obj.nbytes)
            return
        visiting.add(id(obj))
        if isinstance(obj, dict):
            items = obj.values()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = obj
        else:
            items = getattr(obj, "__dict__", {}).values()
        for item in items:
            self.walk(item, depth - 1, visiting)
        visiting.discard(id(obj))


def weight_bytes(plan) -> WeightBytes:
    """The bytes of ``plan``'s weights by where they live (see the module docstring)."""
    tally = _Tally()
    tally.plan(plan)
    return WeightBytes(**tally.bytes)
