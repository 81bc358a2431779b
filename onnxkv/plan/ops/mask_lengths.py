"""``ai.onnxkv::MaskLengths``: GroupQueryAttention's ``seqlens_k`` and ``total_sequence_length`` from the mask.

Written by :func:`onnxkv.plan.fusion_mask.fuse_mask_lengths` over the six
nodes of the GenAI builder's mask chains (its ``body``).  Inputs: the mask
[B, L], then the constants the body reads (ReduceSum's axes, Sub's ``one``,
Gather's ``index``).  Outputs: ``seqlens_k`` = int32(sum(mask, axis 1) -
one) [B] and ``total`` = int32(L), of the shape of ``index`` (a scalar or
[1]).  Computed in one call when the mask is an int64 [B, L] array and the
constants are axes [1] (or [-1]), one 1 and index 1 (int64, at most one
dimension, checked once per constant array); else the body runs literally
(the same values and errors as the unfused graph).

Compilable on that fast path: the call is noted as ``KIND_MASK_LENGTHS``
(:mod:`onnxkv._kernels._record`), with the mask taken whole and its length
read when replayed, so one compiled decode step serves every mask length.
"""

from __future__ import annotations

import numpy as np

from onnxkv._kernels import _record
from onnxkv.plan.fusion import FUSED_DOMAIN
from onnxkv.plan.ops._body import Body
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["MaskLengths"]


def _int_value(x, allowed: tuple[int, ...]) -> bool:
    return (
        isinstance(x, np.ndarray) and x.dtype == np.int64 and x.ndim <= 1 and x.size == 1 and int(x.flat[0]) in allowed
    )


@register("MaskLengths", domain=FUSED_DOMAIN, internal=True)
class MaskLengths(Op):
    """Kernel of one MaskLengths node (see the module docstring)."""

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.body = Body.of(self, ctx, ("mask",))
        names = list(node.input)
        red, sub, gather = self.body.node("ReduceSum"), self.body.node("Sub"), self.body.node("Gather")
        if red is None or sub is None or gather is None:
            raise self.error("body needs ReduceSum, Sub and Gather nodes")
        axes = list(red.input[1:2])
        self._axes = names.index(axes[0]) if axes and axes[0] else None
        self._axes_attr = next((list(a.ints) for a in red.attribute if a.name == "axes"), None)
        self._one, self._index = names.index(sub.input[1]), names.index(gather.input[1])
        self._checked: tuple | None = None  # the constant arrays found fit, by identity

    def _fits(self, inputs: list) -> bool:
        key = tuple(id(inputs[i]) if i is not None else None for i in (self._axes, self._one, self._index))
        if key == self._checked:
            return True
        axes = inputs[self._axes] if self._axes is not None else None
        ok = (
            (
                (axes is None and self._axes_attr in ([1], [-1]))
                or (axes is not None and self._axes_attr is None and _int_value(axes, (1, -1)) and axes.ndim == 1)
            )
            and _int_value(inputs[self._one], (1,))
            and _int_value(inputs[self._index], (1,))
        )
        if ok:
            self._checked = key
        return ok

    def _fast(self, inputs: list) -> bool:
        mask = inputs[0]
        return type(mask) is np.ndarray and mask.ndim == 2 and mask.dtype == np.int64 and self._fits(inputs)

    def compilable(self, inputs: list) -> bool:
        return self._fast(inputs) and inputs[0].flags.c_contiguous and inputs[0].shape[1] <= np.iinfo(np.int32).max

    def run(self, inputs: list, rt) -> tuple:
        if not self._fast(inputs):
            return tuple(self.body.evaluate(self.node.input, inputs, rt))
        mask, one = inputs[0], inputs[self._one]
        seqlens = np.subtract(mask.sum(axis=1), one).astype(np.int32)
        total = np.full(inputs[self._index].shape, mask.shape[1], dtype=np.int32)
        rec = _record.current()
        if rec is not None:
            rec.note(_record.MASK_LENGTHS, (mask, seqlens, total), mask.shape, ())
            rec.ragged_last(mask)
        return seqlens, total
