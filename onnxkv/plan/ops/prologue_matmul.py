"""``ai.onnxkv::PrologueMatMul``: an RMS norm or SiluMul and the packed or block-quantized product that
reads it, as one node.

Made by :func:`onnxkv.plan.fusion_matmul.fuse_prologue_matmuls`.  Inputs: the
prologue's inputs (``prologue_inputs`` of them: ``x, skip, gamma[, bias]`` of
SkipSimplifiedLayerNormalization, ``x, gamma`` of SimplifiedLayerNormalization,
``gate, up`` of SiluMul), then the product's constant weights (a MatMul's or
SiblingMatMul's weights; a MatMulNBits' B, scales, zero points, or a
SiblingMatMulNBits' inputs).  Outputs: the product's outputs (one for a
MatMul or MatMulNBits, one per weight for the sibling forms), then
the skip norm's sum output when the graph reads it.  Attribute ``body``: the
two nodes it replaces.

A decode step is dominated by streaming the weights; what remains is mostly
per-node work around small kernels whose data the weight stream has pushed out
of the caches.  One node per norm + projection halves that.  For float32,
C-contiguous inputs of the shapes the prologue's kernel takes, ``run`` calls
the prologue's compiled kernel into a private buffer and the product node's
own kernel on it -- the calls, arguments and summation order of the two
separate nodes, so the outputs are bit for bit theirs -- at any row count:
the product's outputs come from the run's buffers (``rt.empty``), which a
prompt's later layers and runs reuse.  Up to ``STEP_M`` rows the node is
compilable (a compiled step records it).  Anything else evaluates the two
nodes literally (``body``), errors included.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv import _kernels as K
from onnxkv.plan.ops._body import Body
from onnxkv.plan.ops.matmul import STEP_M
from onnxkv.plan.ops.matmul_nbits import MatMulNBits
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["PrologueMatMul"]

_F32 = np.dtype(np.float32)
_SKIP, _NORM, _SILU = "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization", "SiluMul"


@register("PrologueMatMul", domain="ai.onnxkv", internal=True)
class PrologueMatMul(Op):
    """See the module docstring.

    Attributes:
        body: the prologue and product nodes with their kernels (the fallback).
        kind: the prologue's op type.
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.body = Body.of(self, ctx, ())
        n_in = int(self.attrs.get("prologue_inputs", 0))
        steps = self.body.steps
        if (
            len(steps) != 2
            or steps[0][0].op_type not in (_SKIP, _NORM, _SILU)
            or not 1 <= n_in <= len(node.input)
            or (getattr(steps[1][1], "packed", None) is None and not isinstance(steps[1][1], MatMulNBits))
        ):
            raise self.error(
                "needs a body of an RMS norm or SiluMul and a MatMul / SiblingMatMul with a packed "
                f"weight or a MatMulNBits, and prologue_inputs in [1, {len(node.input)}]; got body "
                f"{[n.op_type for n, _ in steps]}, prologue_inputs={n_in}"
            )
        self.kind = steps[0][0].op_type
        self.n_in = n_in
        self.eps = getattr(steps[0][1], "eps", 0.0)
        #: The product's kernel (MatMul or SiblingMatMul with packed weights, MatMulNBits or
        #: SiblingMatMulNBits); it runs the product on the prologue's result, its outputs being this node's
        #: first ones.
        self.product = steps[1][1]
        #: The product's K.
        self.k = self.product.k if isinstance(self.product, MatMulNBits) else self.product.packed.shape[1]
        n_product = len(steps[1][0].output)
        #: Output index of the skip norm's sum, after the product's (None: the graph does not read it).
        self.sum_index = n_product if len(node.output) > n_product else None
        self.absorbed_inputs = tuple(range(n_in, len(node.input)))  # the weights live packed in the product

    def _prologue_ok(self, x: np.ndarray, inputs: list) -> bool:
        """True when the prologue's own node would call its compiled kernel (the float32 case)."""
        k = x.shape[-1]
        if self.kind == _SILU:
            up = inputs[1]
            return up.shape == x.shape and up.dtype == _F32 and up.flags.c_contiguous
        gamma = inputs[2] if self.kind == _SKIP else inputs[1]
        if gamma.dtype != _F32:
            return False
        if self.kind == _NORM:
            return gamma.shape == (k,)
        skip = inputs[1]
        return skip.shape == x.shape and skip.dtype == _F32 and skip.flags.c_contiguous

    def _fused(self, x, inputs: list) -> bool:
        """True when ``run`` takes the fused path (the prologue's kernel, then the product's)."""
        k = self.k
        return (
            x.dtype == _F32
            and x.ndim >= 1
            and x.shape[-1] == k
            and x.size
            and x.flags.c_contiguous
            and self._prologue_ok(x, inputs)
        )

    def compilable(self, inputs: list) -> bool:
        """The fused path with a product the compiled step replays (a packed float32 product); a float16 x:
        the body's two nodes, each compilable as a node of its own (their float16 paths)."""
        x = inputs[0]
        if isinstance(x, np.ndarray) and x.dtype == np.float16:
            return (
                all(isinstance(v, np.ndarray) for v in inputs[1 : self.n_in])
                and self.body.steps[0][1].compilable(list(inputs[: self.n_in]))
                and x.size // self.k <= STEP_M
                and self.product.compilable([x])  # the prologue's result has x's shape and dtype
            )
        return (
            isinstance(x, np.ndarray)
            and all(isinstance(v, np.ndarray) for v in inputs[1 : self.n_in])
            and self._fused(x, inputs)
            and x.size // self.k <= STEP_M
            and self.product.compilable([x])  # the prologue's result has x's shape and dtype
        )

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        k = self.k
        if not self._fused(x, inputs):
            return tuple(self.body.evaluate(self.node.input, inputs, rt))
        rows = x.size // k
        h = np.empty((rows, k), _F32)
        x2 = x.reshape(rows, k)
        s = None
        if self.kind == _SKIP:
            s = None if self.sum_index is None else rt.empty(self.sum_index, x.shape, _F32)
            bias = inputs[3] if self.n_in > 3 else None
            K.skip_rms_norm(
                x2, inputs[1].reshape(rows, k), inputs[2], bias, self.eps, h, None if s is None else s.reshape(rows, k)
            )
        elif self.kind == _NORM:
            K.rms_norm(x2, inputs[1], self.eps, h)
        else:
            K.silu_mul(x.reshape(-1), inputs[1].reshape(-1), h.reshape(-1))
        outs = self.product.run([h.reshape(x.shape), None], rt)
        return outs if self.sum_index is None else (*outs, s)
