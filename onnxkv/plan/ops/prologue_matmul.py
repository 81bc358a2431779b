"""``ai.onnxkv::PrologueMatMul``: an RMS norm or SiluMul and the packed product that reads it, as one node.

Made by :func:`onnxkv.plan.fusion_matmul.fuse_prologue_matmuls`.  Inputs: the
prologue's inputs (``prologue_inputs`` of them: ``x, skip, gamma[, bias]`` of
SkipSimplifiedLayerNormalization, ``x, gamma`` of SimplifiedLayerNormalization,
``gate, up`` of SiluMul), then the product's constant weights.  Outputs: the
product's outputs (one for a MatMul, one per weight for a SiblingMatMul), then
the skip norm's sum output when the graph reads it.  Attribute ``body``: the
two nodes it replaces.

A decode step is dominated by streaming the weights; what remains is mostly
per-node work around small kernels whose data the weight stream has pushed out
of the caches.  One node per norm + projection halves that.  For float32,
C-contiguous inputs of the shapes the prologue's kernel takes and at most
``BLAS_M`` rows, ``run`` calls the prologue's compiled kernel into a private
buffer and the product's packed kernel on it -- the calls, arguments and
summation order of the two separate nodes, so the outputs are bit for bit
theirs.  Anything else evaluates the two nodes literally (``body``), errors
included.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv import _kernels as K
from onnxkv._kernels.matmul import matmul_packed
from onnxkv.plan.ops._body import Body
from onnxkv.plan.ops.matmul import BLAS_M
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["PrologueMatMul"]

_F32 = np.dtype(np.float32)
_SKIP, _NORM, _SILU = "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization", "SiluMul"


@register("PrologueMatMul", domain="ai.onnxkv")
class PrologueMatMul(Op):
    """See the module docstring.

    Attributes:
        body: the prologue and product nodes with their kernels (the fallback).
        kind: the prologue's op type.
        packed, bounds: the product kernel's packed weights ([ceil(N/16), K, 16]
            float32, owned by that kernel, read-only) and, for a SiblingMatMul,
            the (start, end) columns of each output (None for a MatMul).
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.body = Body.of(self, ctx, ())
        n_in = int(self.attrs.get("prologue_inputs", 0))
        steps = self.body.steps
        if len(steps) != 2 or steps[0][0].op_type not in (_SKIP, _NORM, _SILU) or not 1 <= n_in <= len(node.input) \
                or getattr(steps[1][1], "packed", None) is None:
            raise self.error("needs a body of an RMS norm or SiluMul and a MatMul / SiblingMatMul with a packed "
                             f"weight, and prologue_inputs in [1, {len(node.input)}]; got body "
                             f"{[n.op_type for n, _ in steps]}, prologue_inputs={n_in}")
        prologue, product = steps[0][1], steps[1][1]
        self.kind = steps[0][0].op_type
        self.n_in = n_in
        self.packed = product.packed
        self.bounds = getattr(product, "bounds", None)
        self._n = product._n
        self.eps = getattr(prologue, "eps", 0.0)
        n_out = len(self.bounds) if self.bounds is not None else 1
        #: Output index of the skip norm's sum (None: the graph does not read it).
        self.sum_index = n_out if self.kind == _SKIP and len(node.output) > n_out else None
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

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        k = self.packed.shape[1]
        if not (x.dtype == _F32 and x.ndim >= 1 and x.shape[-1] == k and x.size and x.flags.c_contiguous
                and x.size // k <= BLAS_M and self._prologue_ok(x, inputs)):
            return tuple(self.body.evaluate(self.node.input, inputs, rt))
        rows = x.size // k
        lead = x.shape[:-1]
        h = np.empty((rows, k), _F32)
        x2 = x.reshape(rows, k)
        outs = []
        if self.kind == _SKIP:
            s = None if self.sum_index is None else rt.empty(self.sum_index, x.shape, _F32)
            bias = inputs[3] if self.n_in > 3 else None
            K.skip_rms_norm(x2, inputs[1].reshape(rows, k), inputs[2], bias, self.eps, h,
                            None if s is None else s.reshape(rows, k))
        elif self.kind == _NORM:
            K.rms_norm(x2, inputs[1], self.eps, h)
        else:
            K.silu_mul(x.reshape(-1), inputs[1].reshape(-1), h.reshape(-1))
        if self.bounds is None:
            out = rt.empty(0, lead + (self._n,), _F32)
            matmul_packed(h, self.packed, out.reshape(rows, self._n))
            outs.append(out)
        else:
            full = np.empty((rows, self._n), _F32)
            matmul_packed(h, self.packed, full)
            for i, (n0, n1) in enumerate(self.bounds):
                if rows == 1:
                    outs.append(full[:, n0:n1].reshape(lead + (n1 - n0,)))
                else:
                    out = rt.empty(i, lead + (n1 - n0,), _F32)
                    np.copyto(out.reshape(rows, n1 - n0), full[:, n0:n1])
                    outs.append(out)
        if self.sum_index is not None:
            outs.append(s)
        return tuple(outs)
