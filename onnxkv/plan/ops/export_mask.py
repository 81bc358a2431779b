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

The kernel evaluates that formula (``masks.causal_mask`` in one pass for a
float32 or bool mask over an int64 padding mask, else a few NumPy calls)
instead of the body's 30 to 45 nodes, when every extent is >= 0 and the keys and batch rows lie
within the mask (the body's reads of the flattened mask stay in its rows);
otherwise the body runs literally, with the same values and errors as the
unfused graph.  Either way the values equal the body's exactly: the formula
is a proof over all inputs, and the outputs are bools or copies of the
export's own scalars.
"""

from __future__ import annotations

import numpy as np

from onnxkv._kernels.masks import causal_mask
from onnxkv.plan.fusion import FUSED_DOMAIN
from onnxkv.plan.mask_formula import analyse, mask_formula
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
        position = {n: i for i, n in enumerate(names)}
        #: Per output: (formula, its batch / queries / keys / q0 as (constant, ((input, axis, coeff), ...)), the
        #: mask's input position or -1), or None when the body must run (never for a node the fusion wrote).
        self._plans = [
            None
            if f is None
            else (
                f,
                tuple(
                    (0, ()) if lin is None else (lin.const, tuple((position[v], axis, c) for (v, axis), c in lin.terms))
                    for lin in (f.batch, f.queries, f.keys, f.q0)
                ),
                -1 if f.mask is None else position[f.mask],
            )
            for f in formulas
        ]

    #: Reads nothing through BLAS (a run whose Python nodes are such leaves the BLAS thread limit alone).
    uses_blas = False

    def run(self, inputs: list, rt) -> tuple:
        outs = []
        for index, plan in enumerate(self._plans):
            out = None if plan is None else self._formula(plan, inputs, rt, index)
            if out is None:
                return tuple(self.body.evaluate(self.node.input, inputs, rt))
            outs.append(out)
        return tuple(outs)

    def loop_masks(self, inputs: list, mask: str, width: int) -> list[tuple[str, int, int, float, float, bool]] | None:
        """For a decode step whose graph mask ``mask`` (an input name) is ``width`` columns, each row's
        non-zeros after its zeros (all non-zeros, or a left-padded row's), or each row's ones, zeros, then a
        last one (the engine's rows of different lengths; the compiled generation loop's:
        :func:`onnxkv._kernels.token_loop.decode_steps` writes the outputs then): per output ``(kind,
        window, rows, visible, hidden, padded)`` -- ``"float32"`` or ``"bool"``, the window (0: none), 1 or
        the batch rows, the values of a visible and a hidden key (float32), whether the formula reads
        ``mask`` (a row's padding then hides its keys) -- when this run's ``inputs`` make it one query at
        position ``width - 1`` over ``width`` keys, each key visible within the window and where the row's
        mask shows it; else None (the formula does not say so, or its output is of another type)."""
        out = []
        for plan in self._plans:
            if plan is None:
                return None
            f, lins, at = plan
            rows, nq, nk, q0 = (self._value(lin, inputs) for lin in lins)
            if at >= 0 and self.node.input[at] != mask:
                return None
            kind = "bool" if f.values is None else f.values[0].dtype.name
            if nq != 1 or nk != width or q0 != width - 1 or f.window < 0 or kind not in ("bool", "float32"):
                return None
            a, b = (1.0, 0.0) if f.values is None else (float(v.reshape(-1)[0]) for v in f.values)
            out.append((kind, f.window, 1 if f.batch is None else rows, a, b, at >= 0))
        return out

    @staticmethod
    def _value(lin: tuple, inputs: list) -> int | None:
        """A Lin compiled as (constant, ((input, axis, coeff), ...)) for this run; None when an input lacks
        the axis (the body then raises as the graph does)."""
        total = lin[0]
        for i, axis, c in lin[1]:
            x = inputs[i]
            if type(x) is not np.ndarray or x.ndim <= axis:
                return None
            total += c * x.shape[axis]
        return total

    def _formula(self, plan: tuple, inputs: list, rt, index: int) -> np.ndarray | None:
        """Output ``index`` from its formula, or None when this run is outside the formula's conditions."""
        f, lins, at = plan
        rows, nq, nk, q0 = (self._value(lin, inputs) for lin in lins)
        if rows is None or nq is None or nk is None or q0 is None:
            return None
        rows = 1 if f.batch is None else rows
        if min(nq, nk, rows) < 0:
            return None
        mask = None
        if at >= 0:
            mask = inputs[at]
            if type(mask) is not np.ndarray or mask.ndim != 2 or nk > mask.shape[1] or rows > mask.shape[0]:
                return None
        shape = (rows, 1, nq, nk)
        kind = np.dtype(np.bool_) if f.values is None else f.values[0].dtype
        if (
            kind in (np.float32, np.bool_)
            and f.window >= 0
            and (mask is None or (mask.dtype == np.int64 and mask.flags.c_contiguous))
            and max(rows, nq, nk, abs(q0)) <= 2**62
        ):
            out = rt.empty(index, shape, kind)
            a, b = (0.0, 0.0) if f.values is None else (float(v.reshape(-1)[0]) for v in f.values)
            causal_mask(mask, rows, nq, nk, q0, f.window, out, a, b)
            return out
        k = np.arange(nk, dtype=np.int64)
        q = np.arange(q0, q0 + nq, dtype=np.int64)[:, None]
        visible = k <= q
        if f.window:
            visible &= k > q - f.window
        if mask is not None:
            visible = visible & (mask[:rows, None, :nk] != 0)
        visible = np.broadcast_to(visible, (rows, nq, nk)).reshape(shape)  # explicit: nq or nk may be 0
        if f.values is None:
            out = rt.empty(index, shape, np.bool_)
            out[...] = visible
            return out
        a, b = f.values
        out = rt.empty(index, shape, a.dtype)
        out[...] = b
        np.copyto(out, a, where=visible)
        return out
