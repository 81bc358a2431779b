"""``ai.onnxkv::ExportMask``: the attention masks of an export, computed from their formula.

Written by :func:`onnxkv.plan.fusion_export_mask.fuse_export_masks` over the
nodes with which an export builds its masks from ``attention_mask`` (its
``body``).  Inputs: every value the body reads (the mask, the tensors whose
dims it reads, constants).  Outputs: the masks, each proved by
:func:`onnxkv.plan.mask_formula.mask_formula` to be ``[batch or 1, 1, S, T]``
with query ``q`` seeing key ``k`` when ``k <= q0 + q`` (and ``k > q0 + q - W``
for a window ``W``) and ``mask[b, k] != 0`` (for a padded mask), as bool or as
``where(visible, a, b)`` with the export's two scalars; the extents ``S``,
``T``, ``batch`` and ``q0`` are sums of the inputs' dims.

The kernel evaluates that formula in a few NumPy calls instead of the body's
30 to 45 nodes, when every extent is >= 0 and the keys and batch rows lie
within the mask (the body's reads of the flattened mask stay in its rows);
otherwise the body runs literally, with the same values and errors as the
unfused graph.  Either way the values equal the body's exactly: the formula
is a proof over all inputs, and the outputs are bools or copies of the
export's own scalars.
"""

from __future__ import annotations

import numpy as np

from onnxkv.plan.fusion import FUSED_DOMAIN
from onnxkv.plan.mask_formula import Lin, MaskFormula, analyse, mask_formula
from onnxkv.plan.ops._body import Body
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["ExportMask"]


@register("ExportMask", domain=FUSED_DOMAIN, internal=True)
class ExportMask(Op):
    """Kernel of one ExportMask node (see the module docstring)."""

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.body = Body.of(self, ctx, ())
        names = list(node.input)
        graph = self.attrs["body"]
        constants = {n: ctx.constant(n) for n in names if n and ctx.constant(n) is not None}
        values = analyse(list(graph.node), constants, {n for n in names if n and n not in constants})
        formulas = [mask_formula(values.get(o)) for o in self.body.outputs]
        #: Per output, its formula, or None when the body must run (never for a node the fusion wrote).
        self._formulas: list[MaskFormula | None] = formulas
        atoms = {
            atom
            for f in formulas
            if f is not None
            for lin in (f.batch, f.queries, f.keys, f.q0)
            if lin is not None
            for atom, _ in lin.terms
        }
        #: (input name, input position, axis) of every dim the formulas read.
        self._atoms = tuple(sorted((name, names.index(name), axis) for name, axis in atoms))
        self._position = {n: i for i, n in enumerate(names)}

    def _dims(self, inputs: list) -> dict | None:
        """Input name -> shape for the dims the formulas read; None when an input lacks the axis."""
        shapes: dict = {}
        for name, i, axis in self._atoms:
            x = inputs[i]
            if not isinstance(x, np.ndarray) or x.ndim <= axis:
                return None
            shapes[name] = x.shape
        return shapes

    def run(self, inputs: list, rt) -> tuple:
        shapes = self._dims(inputs) if None not in self._formulas else None
        outs = (
            None if shapes is None else [self._formula(f, inputs, shapes, rt, i) for i, f in enumerate(self._formulas)]
        )
        if outs is None or any(o is None for o in outs):
            return tuple(self.body.evaluate(self.node.input, inputs, rt))
        return tuple(outs)

    def _formula(self, f: MaskFormula, inputs: list, shapes: dict, rt, index: int) -> np.ndarray | None:
        """Output ``index`` from its formula, or None when this run is outside the formula's conditions."""
        value = Lin.value
        nq, nk, q0 = value(f.queries, shapes), value(f.keys, shapes), value(f.q0, shapes)
        rows = 1 if f.batch is None else value(f.batch, shapes)
        if min(nq, nk, rows) < 0:
            return None
        mask = None
        if f.mask is not None:
            mask = inputs[self._position[f.mask]]
            if not isinstance(mask, np.ndarray) or mask.ndim != 2 or nk > mask.shape[1] or rows > mask.shape[0]:
                return None
        q = np.arange(q0, q0 + nq, dtype=np.int64)[:, None]
        k = np.arange(nk, dtype=np.int64)
        visible = k <= q
        if f.window:
            visible &= k > q - f.window
        if mask is not None:
            visible = visible & mask[:rows, None, :nk].astype(bool)
        shape = (rows, 1, nq, nk)
        if f.values is None:
            out = rt.empty(index, shape, np.bool_)
            out[...] = visible.reshape((-1, 1, nq, nk))
            return out
        a, b = f.values
        out = rt.empty(index, shape, a.dtype)
        out[...] = b
        np.copyto(out, a, where=visible.reshape((-1, 1, nq, nk)))
        return out
