"""``ai.onnxkv::ViewChain``: a chain of view/layout operators run as one plan node.

Made by :func:`onnxkv.plan.fusion_view.fuse_view_chains`.  Input 0 is the
chain's data, the others the values its operators read besides (reshape
targets, axes); attribute ``body`` holds the chain (``Reshape``,
``Transpose``, ``Squeeze``, ``Unsqueeze``, ``Flatten``; at most one
``Transpose``).  Output: the last operator's result, exactly the chain's.

Two paths give it:

* **view** (chains with a ``Transpose``): when input 0 is C-contiguous and
  the ``Transpose`` only moves axes of length 1 (the decode head split
  ``[B, 1, H*D] -> [B, 1, H, D] -> [B, H, 1, D]`` and the merge back), the
  chain keeps the row-major order of the elements, so its result is
  ``x.reshape(final_shape)``: a C-contiguous view of input 0, no buffer, no
  per-operator call.  The final shape (or "not a view") is learnt once per
  distinct (input-0 shape, values of the non-constant other inputs) by
  running the chain's own kernels on a zero-stride probe of that shape,
  and remembered (:class:`~onnxkv.plan.ops._util.LayoutMemo`).
* **literal**: otherwise each operator runs its registered kernel on the
  previous result; the ``Transpose`` writes the one array of the chain
  (from the plan's buffer for this output).  Errors come from this path.
  Chains without a ``Transpose`` always take it: their operators return
  views already, and their input shapes (mask and position vectors) grow
  with every decode step, so there is nothing to remember.
"""

from __future__ import annotations

import numpy as np

from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._body import Body
from onnxkv.plan.ops._util import LayoutMemo
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["ViewChain"]

#: Marks the input position that takes the previous step's result.
_PREVIOUS = -1


def _probe(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A writable array of ``shape`` over one element (all strides 0): the chain's kernels keep it a view."""
    return np.ndarray(shape, dtype, np.zeros(1, dtype), 0, (0,) * len(shape))


_PROBE_RT = RunContext(lambda _rt, _i, shape, dtype: _probe(tuple(shape), dtype), False, -1)


@register("ViewChain", domain="ai.onnxkv", internal=True)
class ViewChain(Op):
    """See the module docstring."""

    view_inputs = (0,)

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        body = Body.of(self, ctx, ("x",))
        names = list(node.input)
        steps = []
        perms = []
        previous = node.input[0]
        for n, kernel in body.steps:
            if not n.input or n.input[0] != previous or any(x and x != previous and x not in names for x in n.input):
                raise self.error(
                    f"body node '{n.name or n.output[0]}' does not continue the chain from "
                    f"'{previous}' over the node's inputs"
                )
            steps.append(
                (kernel.run, tuple(_PREVIOUS if x == previous else names.index(x) if x else None for x in n.input))
            )
            perms.append((tuple(kernel.attrs.get("perm") or ()) or None) if n.op_type == "Transpose" else ())
            previous = n.output[0]
        self._steps = tuple(steps)
        #: Per step: () for a view operator, the Transpose's perm otherwise (None = reversed axes).
        self._perms = tuple(perms)
        self._transposes = any(p != () for p in perms)
        #: Input positions besides the data whose values are only known at run time (part of the memo key).
        #: Each is an integer tensor of a fixed dtype, so equal bytes mean equal values.
        self._keyed = tuple(i for i in range(1, len(names)) if names[i] and ctx.constant(names[i]) is None)
        self._memo = LayoutMemo()

    @staticmethod
    def _step(run, sources: tuple, y: np.ndarray, inputs: list, rt: RunContext) -> np.ndarray:
        """One operator of the chain on the previous result ``y``."""
        return run([y if s == _PREVIOUS else None if s is None else inputs[s] for s in sources], rt)[0]

    def _chain(self, x: np.ndarray, inputs: list, rt: RunContext) -> np.ndarray:
        """The literal chain: each operator's kernel on the previous result."""
        y = x
        for run, sources in self._steps:
            y = self._step(run, sources, y, inputs, rt)
        return y

    def _view_shape(self, x: np.ndarray, inputs: list) -> tuple[int, ...] | None:
        """The chain's result shape if it keeps the row-major element order of ``x``, else None (see the
        module docstring); None too when the chain fails (the literal path then raises)."""
        y = _probe(x.shape, x.dtype)
        for (run, sources), perm in zip(self._steps, self._perms):
            if perm != ():
                order = perm if perm is not None else tuple(range(y.ndim))[::-1]
                if len(order) != y.ndim:
                    return None
                moved = [a for a in order if y.shape[a] != 1]
                if moved != sorted(moved):
                    return None
            try:
                y = self._step(run, sources, y, inputs, _PROBE_RT)
            except Exception:  # noqa: BLE001 -- any failure: the literal path reports it
                return None
        return y.shape

    def run(self, inputs: list, rt: RunContext) -> tuple:
        x = inputs[0]
        if not self._transposes:
            return (self._chain(x, inputs, rt),)
        key = (x.shape, *[inputs[i].tobytes() for i in self._keyed]) if self._keyed else x.shape
        shape = self._memo.get(key, self._view_shape, x, inputs)
        if shape is not None and x.flags.c_contiguous:
            return (x.reshape(shape),)
        return (self._chain(x, inputs, rt),)
