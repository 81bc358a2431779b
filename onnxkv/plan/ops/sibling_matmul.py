"""``ai.onnxkv::SiblingMatMul``: one input times several constant weights, as one packed product.

Made by :func:`onnxkv.plan.fusion_matmul.fuse_sibling_matmuls`.  Inputs: ``x``
``[..., K]`` and weights ``W1 ... Wn`` (2-D initializers ``[K, N_i]``, all
float32 or all float16, x of their dtype); outputs ``Y_i = x @ W_i``
(``[..., N_i]``), as the n MatMuls it replaces.  With ``biased=1``
(:func:`~onnxkv.plan.fusion_matmul.absorb_sibling_biases`: float32 weights, the
Adds of a bias after each product, as Qwen2's q/k/v projections; one weight
is enough then: a biased MatMul) the inputs end
with the biases ``b1 ... bn`` (float32 initializers ``[N_i]``) and ``Y_i = x @
W_i + b_i``, each sum starting from its bias (the kernel's bias; not the
rounding of a separate Add).  float16 runs as
:class:`onnxkv.plan.ops.matmul.MatMul` runs it: float16 panels, x widened
once, float32 sums, each Y rounded once to float16.

The weights are concatenated along N and packed once when the plan is built
(the panel layout of ``onnxkv._kernels.matmul.pack_weight``; the plan drops
its own copies of the initializers), then every call is one product exactly
as :class:`onnxkv.plan.ops.matmul.MatMul` computes it (``matmul_packed``).  Each output element is summed over K
in the same order as the separate kernel would.  A single row (decoding)
returns the outputs as views of the one product (each is C-contiguous).
Several rows (a speculative verification, a prompt chunk) take one product per output when every output starts on a panel boundary
(the panels of an output are then a contiguous slice of the packed weight,
and each element is summed as in the one product; float16 outputs are each
rounded from their own float32 product); otherwise they get contiguous
copies of the column blocks of the one product.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv._kernels.matmul import PANEL, matmul_packed, pack_weight
from onnxkv.plan.constant_data import release_pages
from onnxkv.plan.ops._util import round_into, widened
from onnxkv.plan.ops.matmul import MatMul
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["SiblingMatMul"]


@register("SiblingMatMul", domain="ai.onnxkv", internal=True)
class SiblingMatMul(MatMul):
    """See the module docstring.

    Attributes:
        packed: the packed concatenation of the weights ([ceil(N/16), K, 16]
            of their dtype, N = sum of N_i; owned by this object, read-only).
        bounds: (start, end) columns of each output in the product.
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        Op.__init__(self, node, ctx)
        biased = bool(self.attrs.get("biased", 0))
        n = len(node.output)
        weights = [ctx.constant(w) for w in node.input[1 : 1 + n if biased else None]]
        biases = [ctx.constant(b) for b in node.input[1 + n :]] if biased else []
        if (
            len(weights) < (1 if biased else 2)
            or len(node.output) != len(weights)
            or any(
                not isinstance(w, np.ndarray)
                or w.ndim != 2
                or w.dtype not in (np.float32, np.float16)
                or w.dtype != weights[0].dtype
                or not w.size
                or w.shape[0] != weights[0].shape[0]
                for w in weights
            )
        ):
            raise self.error(
                "needs one input and at least two 2-D initializer weights (one with biases) of one dtype "
                "(float32 or float16) "
                "and row count "
                f"(one output each), got weights {[getattr(w, 'shape', None) for w in weights]}"
            )
        if biased and (
            len(biases) != n
            or len(node.input) != 1 + 2 * n
            or weights[0].dtype != np.float32
            or any(
                not isinstance(b, np.ndarray) or b.dtype != np.float32 or b.shape != (w.shape[1],)
                for b, w in zip(biases, weights)
            )
        ):
            raise self.error(
                "biased=1 needs float32 weights and one float32 initializer bias [N_i] per weight, got biases "
                f"{[getattr(b, 'shape', None) for b in biases]}"
            )
        ends = np.cumsum([w.shape[1] for w in weights]).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self.packed = pack_weight(np.concatenate(weights, axis=1))
        self.packed.flags.writeable = False
        self._n = ends[-1]
        #: Each output's own slice of the packed panels, when every output starts on a panel boundary.
        self.panels = (
            [self.packed[n0 // PANEL : -(-n1 // PANEL)] for n0, n1 in self.bounds]
            if all(n0 % PANEL == 0 for n0, _ in self.bounds)
            else None
        )
        #: The biases concatenated along N (float32 [N], read-only), each output's slice, or None.
        self.bias = np.ascontiguousarray(np.concatenate(biases)) if biased else None
        self.biases = [self.bias[n0:n1] for n0, n1 in self.bounds] if biased else [None] * n
        self.absorbed_inputs = tuple(range(1, len(node.input)))
        for w in weights:
            release_pages(w)

    def compilable(self, inputs: list) -> bool:
        """One C-contiguous float32 row (one kernel call whose outputs are views of its result), or up to
        ``STEP_M`` rows with panel-aligned outputs (one call per output)."""
        return MatMul.compilable(self, inputs) and (inputs[0].size == self.packed.shape[1] or self.panels is not None)

    def run(self, inputs: list, rt) -> tuple:
        a = inputs[0]
        k = self.packed.shape[1]
        if a.dtype != self.packed.dtype or a.ndim < 1 or a.shape[-1] != k:
            raise ValueError(
                f"SiblingMatMul node '{self.name}': A must be {self.packed.dtype} [..., {k}], got {a.dtype} {a.shape}"
            )
        x = np.ascontiguousarray(a).reshape(-1, k)
        rows, lead = x.shape[0], a.shape[:-1]
        if a.dtype == np.float16 and rows > 1 and self.panels is not None:  # per output: sums, rounding
            wx, outs = widened(x, rt), []
            for i, ((n0, n1), panels) in enumerate(zip(self.bounds, self.panels)):
                wide = rt.scratch((rows, n1 - n0), np.float32)
                matmul_packed(wx, panels, wide)
                outs.append(round_into(rt.empty(i, lead + (n1 - n0,), np.float16), wide.reshape(lead + (n1 - n0,))))
                rt.unscratch(wide)
            rt.unscratch(wx)
            return tuple(outs)
        if a.dtype == np.float16:  # one product of the widened rows, rounded once as a whole
            wx, wide = widened(x, rt), rt.scratch((rows, self._n), np.float32)
            matmul_packed(wx, self.packed, wide)
            full = round_into(np.empty(wide.shape, np.float16), wide)
            rt.unscratch(wx, wide)
        elif rows > 1 and self.panels is not None:
            outs = []
            for i, ((n0, n1), panels) in enumerate(zip(self.bounds, self.panels)):
                out = rt.empty(i, lead + (n1 - n0,), np.float32)
                matmul_packed(x, panels, out.reshape(rows, n1 - n0), self.biases[i])
                outs.append(out)
            return tuple(outs)
        else:
            full = np.empty((rows, self._n), np.float32)
            matmul_packed(x, self.packed, full, self.bias)
        if rows == 1:
            return tuple(full[:, n0:n1].reshape(lead + (n1 - n0,)) for n0, n1 in self.bounds)
        outs = []
        for i, (n0, n1) in enumerate(self.bounds):
            out = rt.empty(i, lead + (n1 - n0,), a.dtype)
            np.copyto(out.reshape(rows, n1 - n0), full[:, n0:n1])
            outs.append(out)
        return tuple(outs)
