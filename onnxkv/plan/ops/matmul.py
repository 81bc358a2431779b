"""MatMul and Gemm.

Decode-sized products (at most ``SMALL_M`` rows against a 2-D float32 weight)
run in the compiled ``matmul_rows`` kernel, inside onnxkv's own OpenMP pool;
larger ones go to NumPy's BLAS.  Both use the session's thread setting.
"""

from __future__ import annotations

import numpy as np

from onnxkv import _kernels as K
from onnxkv.plan.ops._util import broadcast_shape

#: Up to this many rows a MatMul with a 2-D float32 weight uses the compiled kernel.
SMALL_M = 16
from onnxkv.plan.registry import Op, register


@register("MatMul")
class MatMul(Op):
    """ONNX MatMul (numpy.matmul semantics); 2-D weights use one GEMM over all rows."""

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs
        if a.ndim >= 2 and b.ndim == 2 and a.flags.c_contiguous:
            if a.shape[-1] != b.shape[0]:
                raise ValueError(f"MatMul node '{self.name}': shapes {a.shape} and {b.shape} do not align")
            out = rt.empty(0, a.shape[:-1] + (b.shape[1],), np.result_type(a, b))
            rows = a.size // a.shape[-1] if a.shape[-1] else 0
            if rows <= SMALL_M and a.dtype == b.dtype == np.float32 and b.flags.c_contiguous:
                K.matmul_rows(a.reshape(-1, a.shape[-1]), b, out.reshape(-1, b.shape[1]))
            else:
                np.matmul(a.reshape(-1, a.shape[-1]), b, out=out.reshape(-1, b.shape[1]))
            return (out,)
        if a.ndim >= 2 and b.ndim >= 2:
            batch = broadcast_shape(np.empty(a.shape[:-2], np.int8), np.empty(b.shape[:-2], np.int8))
            if a.shape[-1] != b.shape[-2]:
                raise ValueError(f"MatMul node '{self.name}': shapes {a.shape} and {b.shape} do not align")
            out = rt.empty(0, tuple(batch) + (a.shape[-2], b.shape[-1]), np.result_type(a, b))
            np.matmul(a, b, out=out)
            return (out,)
        return (np.matmul(a, b),)


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
            y *= alpha
        if c is not None:
            y += beta * c
        return (y.astype(a.dtype, copy=False),)
