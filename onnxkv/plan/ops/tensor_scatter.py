"""ONNX ``TensorScatter`` (opset 24): write a sequence update into a fixed-size cache.

Inputs: ``past_cache`` [B, D1, ..., max_len (at ``axis``), ..., Dn] of any dtype;
``update`` of the same shape except ``seq_len <= max_len`` at ``axis``;
``write_indices`` [B] int64 (optional, zeros when absent; any integer dtype is
accepted and checked in its own width).  Attributes:
``axis`` (default -2, never the batch axis 0), ``mode`` ``"linear"`` (requires
``0 <= write_indices[b]`` and ``write_indices[b] + seq_len <= max_len``) or
``"circular"`` (positions taken modulo ``max_len``).

Output ``present_cache``: a copy of ``past_cache`` where, for every batch row
``b`` and update step ``s``, sequence position ``write_indices[b] + s`` (mod
``max_len`` when circular) holds ``update[b, ..., s, ...]``.

This tensor path copies: storage counters are one allocation of the output's
size, ``prefix_copied_bytes`` = bytes of ``past_cache`` and
``append_copied_bytes`` = bytes of ``update``.

In a state whose static cache is bound to ``past_cache`` the update is
written in place instead (:meth:`~onnxkv.plan.context.RunContext.cache_write`,
linear mode): the cache saves the slots it overwrites and puts them back if
the run fails or is cancelled, and its length becomes the high-water mark of
the positions written (see :mod:`onnxkv.cache.contiguous`).  The present is then a view of the
cache; in a paged state a gathered copy, or a placeholder when every node reading it reads the
cache's pages itself (:func:`._page_readers.share_pages`: the form's ``Attention``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from onnxkv._kernels import _validate as V
from onnxkv._kernels._record import current as _recorder
from onnxkv.errors import InputError
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._static_record import note_scatter_rows
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["TensorScatter"]


@register("TensorScatter", since=24)
class TensorScatter(Op):
    """Kernel object of one TensorScatter node (see the module docstring)."""

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attrs.get("axis", -2))
        self.mode = str(self.attrs.get("mode", "linear"))
        if self.mode not in ("linear", "circular"):
            raise self.error(f"mode must be 'linear' or 'circular', got {self.mode!r}")
        if self.axis == 0:
            raise self.error("axis must not be 0 (the batch axis)")
        self.bound_past = node.input[0] if ctx.bindings_for(node) else None
        #: Every reader of the present reads the pages of a paged state's cache itself (``_page_readers.share_pages``):
        #: in a paged state the node then returns a placeholder instead of a gathered copy.
        self.pages_read = False

    #: Inputs a recorded write does not read (the past view: it writes the cache buffer taken by name).
    replay_unread = (0,)

    def compilable(self, inputs: list) -> bool:
        """Bound to a state's cache in linear mode: its in-place write into a static contiguous cache is one a
        compiled step replays (``run`` notes it; any other run refuses the recording)."""
        return self.bound_past is not None and self.mode == "linear"

    def _input_error(self, message: str) -> InputError:
        return InputError(f"{self.op_type} node '{self.name}': {message}")

    def _starts(self, indices: np.ndarray | None, batch: int, max_len: int, seq: int) -> np.ndarray:
        """Per-row first write position as int64 [B], in ``[0, max_len)`` (zeros without ``write_indices``).

        ``write_indices`` of any integer dtype is checked in its own width before any conversion: in linear
        mode each index must lie in ``[0, max_len - seq]``; in circular mode any value is reduced modulo
        ``max_len`` exactly first (``(w + s) mod L == ((w mod L) + s) mod L``, so no sum can overflow).
        """
        if indices is None:
            return np.zeros(batch, np.int64)
        arr = np.asarray(indices)
        if arr.dtype.kind not in "iu" or arr.shape != (batch,):
            raise self._input_error(f"write_indices must be [{batch}] integers, got {arr.dtype} {arr.shape}")
        if self.mode == "circular":
            if not max_len:
                return np.zeros(batch, np.int64)
            if arr.dtype == np.uint64:  # the one width int64 does not hold
                return (arr % np.uint64(max_len)).astype(np.int64)
            return arr.astype(np.int64) % max_len
        bad = V.outside(arr, 0, max_len - seq)
        if bad.any():
            row = int(np.argmax(bad))
            raise self._input_error(
                f"write_indices[{row}]={int(arr[row])} with {seq} update steps exceeds the cache: linear mode needs "
                f"0 <= index <= {max_len - seq} (index + {seq} <= {max_len})"
            )
        return arr.astype(np.int64)

    def run(self, inputs: list, rt: RunContext) -> Sequence[np.ndarray]:
        past, update = inputs[0], inputs[1]
        indices = inputs[2] if len(inputs) > 2 else None
        rank = past.ndim
        if rank < 2 or not -rank <= self.axis < rank or self.axis % rank == 0:
            raise self._input_error(f"axis={self.axis} is not a non-batch axis of past_cache with shape {past.shape}")
        axis = self.axis % rank
        if (
            update.ndim != rank
            or any(u != p for i, (u, p) in enumerate(zip(update.shape, past.shape)) if i != axis)
            or update.shape[axis] > past.shape[axis]
        ):
            raise self._input_error(
                f"update shape {update.shape} must equal past_cache shape {past.shape} except at axis {axis}, "
                f"where it may not exceed {past.shape[axis]}"
            )
        if update.dtype != past.dtype:
            raise self._input_error(f"update dtype {update.dtype} differs from past_cache dtype {past.dtype}")
        batch, max_len, seq = past.shape[0], past.shape[axis], update.shape[axis]
        starts = self._starts(indices, batch, max_len, seq)

        rec = _recorder()
        if self.bound_past is not None and rt.in_place(self.bound_past):
            # In place: the update goes straight into the state's static cache.
            present = rt.cache_write(self.bound_past, update, starts, max_len, materialize=not self.pages_read)
            if rec is not None:
                note_scatter_rows(self, rec, rt, update, indices if self.mode == "linear" else None, max_len)
            return (present,)
        if rec is not None:
            rec.refused.append(f"{self.op_type} node '{self.name}': not a write into a state's cache")
        present = rt.empty(0, past.shape, past.dtype)
        present[...] = past
        steps = np.arange(seq, dtype=np.int64)
        for b in range(batch):
            positions = (starts[b] + steps) % max_len if self.mode == "circular" else starts[b] + steps
            np.moveaxis(present[b], axis - 1, 0)[positions] = np.moveaxis(update[b], axis - 1, 0)
        rt.count(
            allocations=1,
            allocated_bytes=present.nbytes,
            prefix_copied_bytes=past.nbytes,
            append_copied_bytes=update.nbytes,
        )
        return (present,)
