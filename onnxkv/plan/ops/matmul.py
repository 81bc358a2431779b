"""MatMul and Gemm.

A MatMul whose weight (input 1) is a 2-D float32 or float16 initializer packs
it once, when the kernel object is built, into the panel layout of
``onnxkv._kernels.matmul.pack_weight`` (in the weight's own dtype: float16
panels are widened in registers, so a float16 model's products read half the
bytes of a float32 one's) and keeps only that copy: the plan's
own reference to the initializer stays, but for a weight mapped from external
data (``np.memmap``) the pages read while packing are released again, so the
weights are resident once.  Every product against the packed weight runs in
the compiled ``matmul_packed`` kernel (onnxkv's OpenMP pool), prompt chunks
included: its register tiles reach NumPy's BLAS on prompt-sized products,
read the one packed copy (no unpacked copy for BLAS), and leave no BLAS
thread spinning on a core after the call (OpenBLAS's workers busy-wait for
tens of milliseconds, which halved the speed of the attention kernel that
followed each projection).  Up to ``STEP_M`` rows a product is compilable: a
compiled step records it.  A float16 product (float16 A and weight, as every
MatMul of a float16 model) widens A to float32 (into the run's scratch), sums
in float32 and rounds Y to float16 once: ONNX Runtime's CPU result, whose
float16 MatMul runs as a float32 one between casts; a compiled step records the
widening, the product and the rounding.

Other 2-D float32 weights (computed at run time) use the ``matmul_rows``
kernel for at most ``SMALL_M`` rows and BLAS above.  All paths use the
session's thread setting.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv import _kernels as K
from onnxkv._kernels.matmul import matmul_packed, pack_weight
from onnxkv.plan.constant_data import release_pages
from onnxkv.plan.ops._util import broadcast_shape, matmul, round_into, widened
from onnxkv.plan.registry import BuildContext, Op, register

#: Weight dtypes packed at build time.
_PACKED = (np.dtype(np.float32), np.dtype(np.float16))
#: Up to this many rows a MatMul with a run-time 2-D float32 weight uses ``matmul_rows``.
SMALL_M = 16
#: Up to this many rows a product with a packed (initializer) weight is compilable (recorded in compiled
#: steps); longer prompt chunks run through the plan's Python loop, where one call's dispatch is negligible.
STEP_M = 256


@register("MatMul")
class MatMul(Op):
    """ONNX MatMul (numpy.matmul semantics); 2-D weights use one GEMM over all rows.

    Attributes:
        packed: the packed weight ([ceil(N/16), K, 16] of the weight's dtype,
            owned by this object, read-only) when input 1 is a non-empty 2-D
            float32 or float16 initializer, else None.
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        w = ctx.constant(node.input[1]) if len(node.input) > 1 else None
        self.packed: np.ndarray | None = None
        self._n = 0
        if isinstance(w, np.ndarray) and w.ndim == 2 and w.dtype in _PACKED and w.size:
            self.packed = pack_weight(np.ascontiguousarray(w))
            self.packed.flags.writeable = False
            self._n = w.shape[1]
            self.absorbed_inputs = (1,)  # the plan may drop its own copy of the weight
            release_pages(w)

    def compilable(self, inputs: list) -> bool:
        """A packed weight and a C-contiguous A [..., K] of its dtype of at most ``STEP_M`` rows (float16: the
        widening of A, the product and the rounding)."""
        a = inputs[0]
        packed = self.packed
        return (
            packed is not None
            and isinstance(a, np.ndarray)
            and a.dtype == packed.dtype
            and a.ndim >= 1
            and a.shape[-1] == packed.shape[1]
            and a.size > 0
            and a.flags.c_contiguous
            and a.size // packed.shape[1] <= STEP_M
        )

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        packed = self.packed
        if packed is not None:
            k = packed.shape[1]
            if a.dtype != packed.dtype or a.ndim < 1 or a.shape[-1] != k:
                raise ValueError(
                    f"MatMul node '{self.name}': shapes {a.shape} and ({k}, {self._n}) "
                    f"do not align (A must be {packed.dtype} [..., {k}], got {a.dtype})"
                )
            out = rt.empty(0, a.shape[:-1] + (self._n,), a.dtype)
            if a.dtype == np.float32:
                matmul_packed(np.ascontiguousarray(a).reshape(-1, k), packed, out.reshape(-1, self._n))
            else:  # float16: float32 sums, Y rounded once
                wa, y = widened(a, rt), rt.scratch(out.shape, np.float32)
                matmul_packed(wa.reshape(-1, k), packed, y.reshape(-1, self._n))
                round_into(out, y)
                rt.unscratch(wa, y)
            return (out,)
        if a.ndim >= 2 and b.ndim == 2 and a.flags.c_contiguous:
            if a.shape[-1] != b.shape[0]:
                raise ValueError(f"MatMul node '{self.name}': shapes {a.shape} and {b.shape} do not align")
            out = rt.empty(0, a.shape[:-1] + (b.shape[1],), np.result_type(a, b))
            if out.size == 0 or a.shape[-1] == 0:  # no output, or sums of nothing (K = 0): zeros
                out[...] = 0
                return (out,)
            rows = a.size // a.shape[-1]
            if rows <= SMALL_M and a.dtype == b.dtype == np.float32 and b.flags.c_contiguous:
                K.matmul_rows(a.reshape(-1, a.shape[-1]), b, out.reshape(-1, b.shape[1]))
            else:
                matmul(a.reshape(-1, a.shape[-1]), b, out=out.reshape(-1, b.shape[1]))
            return (out,)
        if a.ndim >= 2 and b.ndim >= 2:
            batch = broadcast_shape(np.empty(a.shape[:-2], np.int8), np.empty(b.shape[:-2], np.int8))
            if a.shape[-1] != b.shape[-2]:
                raise ValueError(f"MatMul node '{self.name}': shapes {a.shape} and {b.shape} do not align")
            out = rt.empty(0, tuple(batch) + (a.shape[-2], b.shape[-1]), np.result_type(a, b))
            matmul(a, b, out=out)
            return (out,)
        return (matmul(a, b),)


@register("Gemm")
class Gemm(Op):
    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs[0], inputs[1]
        c = inputs[2] if len(inputs) > 2 else None
        if self.attrs.get("transA", 0):
            a = a.T
        if self.attrs.get("transB", 0):
            b = b.T
        y = np.matmul(a, b)
        alpha, beta = self.attrs.get("alpha", 1.0), self.attrs.get("beta", 1.0)
        if alpha != 1.0:
            y = y * alpha  # float attributes: integer products are cast back below
        if c is not None:
            y = y + (c if beta == 1.0 else beta * c)
        return (y.astype(a.dtype, copy=False),)
