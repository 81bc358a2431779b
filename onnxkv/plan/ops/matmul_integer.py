"""``MatMulInteger`` and ``DynamicQuantizeLinear``: the integer products of dynamically quantized models.

ONNX Runtime's ``quantize_dynamic`` (the ``model_quantized.onnx`` / ``model_int8.onnx`` files of
many model repositories) turns each float MatMul with a constant weight into
``DynamicQuantizeLinear(x) -> MatMulInteger(x_q, W_q, x_zp, W_zp) -> Cast -> Mul(x_scale * W_scale)``.
Both operators run here in compiled kernels (:mod:`onnxkv._kernels.imatmul`) with the results ONNX
Runtime gives, bit for bit: the product is integer arithmetic (int32, wrapping), and the quantization
follows ONNX Runtime's CPU kernel, including where it departs from ``onnx.reference``: an input whose
range is empty (all zeros) gets scale 1.  NaNs are left out of the range and quantize to 0 (whether
ONNX Runtime's range takes a NaN in depends on its position in x, so such inputs can differ).

MatMulInteger (numpy.matmul semantics): A uint8 or int8 [..., K]; B uint8 or int8; a_zero_point of
A's type, one value or one per row of A's matrices ([M] for A [..., M, K]); b_zero_point of B's type,
one value or one per column of B.  A 2-D initializer B with an initializer (or absent) b_zero_point is
packed once at load (the op absorbs both, so the plan drops its copies); every product then runs in
``matmul_integer``.  Other forms (B computed at run time, batched B) run exactly in NumPy int64 and
wrap to int32.  Neither operator is compilable: a compiled step runs them as Python nodes, but the
plan fuses each whole chain of a constant weight into ``ai.onnxkv::DynamicQuantMatMul``
(:mod:`onnxkv.plan.fusion_integer`), one compiled call with the chain's bits, which a compiled step
records.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv._kernels.imatmul import dynamic_quantize_linear, matmul_dynamic, matmul_integer, pack_int8_weight
from onnxkv.plan.constant_data import release_pages
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantMatMul", "STEP_M"]

#: Up to this many rows a DynamicQuantMatMul is compilable (recorded in compiled steps).
STEP_M = 512

_INT8 = (np.dtype(np.int8), np.dtype(np.uint8))


@register("DynamicQuantizeLinear", since=11)
class DynamicQuantizeLinear(Op):
    """x float32 -> (y uint8 of x's shape, y_scale float32 scalar, y_zero_point uint8 scalar)."""

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        if x.dtype != np.float32:
            raise ValueError(f"DynamicQuantizeLinear node '{self.name}': x must be float32, got {x.dtype}")
        x = np.require(x, requirements="C")  # a 0-D x stays 0-D
        y = rt.empty(0, x.shape, np.uint8)
        scale, zp = dynamic_quantize_linear(x, y)
        return y, np.array(scale, np.float32), np.array(zp, np.uint8)


@register("MatMulInteger", since=10)
class MatMulInteger(Op):
    """Kernel object of one MatMulInteger node (see the module docstring).

    Attributes:
        weight: the packed B (:class:`onnxkv._kernels.imatmul.PackedInt8Weight`) when B and its zero
            point are initializers of a form the kernel takes, else None.
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        inputs = list(node.input) + [""] * (4 - len(node.input))
        self.weight = None
        b = ctx.constant(inputs[1]) if inputs[1] else None
        bz = ctx.constant(inputs[3]) if inputs[3] else None
        if b is None or (inputs[3] and bz is None):
            return
        if b.dtype not in _INT8:
            raise self.error(f"B must be int8 or uint8, got {b.dtype}")
        if bz is not None and bz.ndim == 2 and bz.shape[0] == 1:  # [1, N]: one per column, as [N]
            bz = bz.reshape(-1)
        if bz is not None and (bz.dtype != b.dtype or bz.ndim > 1):
            raise self.error(
                f"b_zero_point must be a scalar or 1-D array of B's type {b.dtype}, got {bz.dtype} {list(bz.shape)}"
            )
        if b.ndim != 2 or 0 in b.shape or b.shape[0] >= 2**31:
            return  # batched or empty: the NumPy path
        if bz is not None and bz.size not in (1, b.shape[1]):
            raise self.error(f"b_zero_point has {bz.size} values; expected 1 or N={b.shape[1]} (B is {list(b.shape)})")
        self.weight = pack_int8_weight(np.ascontiguousarray(b), None if bz is None else np.ascontiguousarray(bz))
        self.absorbed_inputs = (1, 3) if inputs[3] else (1,)
        release_pages(b)

    def _fail(self, message: str) -> ValueError:
        return ValueError(f"MatMulInteger node '{self.name}': {message}")

    def _zero_point(self, z, dtype, count: int, role: str, what: str):
        """A zero-point input checked against its operand: None, or a flat array of 1 or ``count`` values."""
        if z is None:
            return None
        if z.ndim == 2 and z.shape[0] == 1:  # [1, count] (the N-D form of one per column)
            z = z.reshape(-1)
        if z.dtype != dtype or z.ndim > 1 or z.size not in (1, count):
            raise self._fail(
                f"{role} must be one value or {count} ({what}) of type {dtype}, got {z.dtype} {list(z.shape)}"
            )
        return z.reshape(-1)

    def run(self, inputs: list, rt) -> tuple:
        a, b, az, bz = (inputs + [None] * 4)[:4]
        if a.dtype not in _INT8:
            raise self._fail(f"A must be int8 or uint8, got {a.dtype}")
        if a.ndim == 0:
            raise self._fail("A must have at least one dimension")
        w = self.weight
        if w is not None:
            if a.shape[-1] != w.K:
                raise self._fail(f"A must be [..., {w.K}] (B is [{w.K}, {w.N}]), got {list(a.shape)}")
            rows = a.shape[-2] if a.ndim >= 2 else 1
            az = self._zero_point(az, a.dtype, rows, "a_zero_point", "one per row of A")
            lead = a.shape[:-1]
            x = np.ascontiguousarray(a).reshape(-1, w.K)
            if az is not None and az.size > 1 and x.shape[0] != rows:  # per-row zero points, batched A
                az = np.tile(az, x.shape[0] // rows)
            out = rt.empty(0, lead + (w.N,), np.int32)
            matmul_integer(x, w, az, out.reshape(-1, w.N))
            return (out,)
        return (self._numpy(a, b, az, bz),)

    def _numpy(self, a, b, az, bz) -> np.ndarray:
        """The exact product in int64, wrapped to int32 (B computed at run time, or batched)."""
        if b.dtype not in _INT8 or b.ndim == 0:
            raise self._fail(f"B must be int8 or uint8 with at least one dimension, got {b.dtype} {list(b.shape)}")
        rows = a.shape[-2] if a.ndim >= 2 else 1
        az = self._zero_point(az, a.dtype, rows, "a_zero_point", "one per row of A")
        bz = self._zero_point(bz, b.dtype, b.shape[-1], "b_zero_point", "one per column of B")
        a64 = a.astype(np.int64)
        b64 = b.astype(np.int64)
        if az is not None:
            a64 = a64 - (az.astype(np.int64) if az.size == 1 or a.ndim < 2 else az.astype(np.int64)[:, None])
        if bz is not None:
            b64 = b64 - bz.astype(np.int64)
        try:
            return np.matmul(a64, b64).astype(np.int32)
        except ValueError as e:
            raise self._fail(f"A {list(a.shape)} and B {list(b.shape)} do not multiply: {e}") from None


@register("DynamicQuantMatMul", domain="ai.onnxkv", internal=True)
class DynamicQuantMatMul(Op):
    """``ai.onnxkv::DynamicQuantMatMul(x, W, wz, ws) -> y`` (made by
    :func:`onnxkv.plan.fusion_integer.fuse_dynamic_quant_matmuls`): y = DynamicQuantizeLinear(x),
    MatMulInteger against W with zero points wz, Cast to float32 and times x_scale * ws, in one
    ``matmul_dynamic`` call.  W, wz and ws are constants, packed and absorbed at build; x float32
    [..., K] gives y float32 [..., N].

    Attributes: weight (the packed W), ws (float32 [N], the weight scales per column).
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        w, wz, ws = (ctx.constant(node.input[i]) if node.input[i] else None for i in (1, 2, 3))
        wz = None if wz is None else np.ascontiguousarray(wz).reshape(-1)
        self.weight = pack_int8_weight(np.ascontiguousarray(w), wz)
        self.ws = np.ascontiguousarray(np.broadcast_to(ws.reshape(-1), (self.weight.N,)), dtype=np.float32)
        self.ws.flags.writeable = False
        self.absorbed_inputs = tuple(i for i in (1, 2, 3) if node.input[i])
        release_pages(w)

    def compilable(self, inputs: list) -> bool:
        """One kernel call on x as it is: C-contiguous float32 [..., K] of at most ``STEP_M`` rows."""
        x = inputs[0]
        return (
            isinstance(x, np.ndarray)
            and x.dtype == np.float32
            and x.ndim >= 1
            and x.size > 0
            and x.shape[-1] == self.weight.K
            and x.flags.c_contiguous
            and x.size // self.weight.K <= STEP_M
        )

    def run(self, inputs: list, rt) -> tuple:
        x, w = inputs[0], self.weight
        if x.dtype != np.float32 or x.ndim == 0 or x.shape[-1] != w.K:
            raise ValueError(
                f"DynamicQuantMatMul node '{self.name}': x must be float32 [..., {w.K}], got {x.dtype} {list(x.shape)}"
            )
        out = rt.empty(0, x.shape[:-1] + (w.N,), np.float32)
        matmul_dynamic(np.ascontiguousarray(x).reshape(-1, w.K), w, self.ws, out.reshape(-1, w.N))
        return (out,)
