"""``DequantizeLinear``: y = (x - x_zero_point) * x_scale, per tensor or per axis.

Dynamically quantized models (:mod:`onnxkv.plan.ops.matmul_integer`) dequantize the rows their
quantized embedding and rotary tables gather, every run.  This kernel takes x int8, uint8, int16,
uint16 or int32 with float32 scales, one per tensor or one per slice of ``axis``, and no blocks
(``block_size`` 0): x - x_zero_point is formed exactly (int32 x: wrapping in int32) and rounded to
float32 once before the scale multiplies it, as ONNX Runtime computes it (for 8- and 16-bit x every such difference is exact in
float32, so this is also ``onnx.reference``'s result).  Other forms (float8 and 4-bit x, float16 or
bfloat16 scales, blocked scales) run through the ``onnx.reference`` implementation of the model's opset
where it has one, else fail naming the node and what it was given.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv.plan.fallback import FallbackOp, has_fallback
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["DequantizeLinear"]

_INTS = tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32))


@register("DequantizeLinear", since=10)
class DequantizeLinear(Op):
    """Kernel object of one DequantizeLinear node (see the module docstring)."""

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.axis = self.attrs.get("axis", 1)
        self.block_size = self.attrs.get("block_size", 0)
        self.output_dtype = self.attrs.get("output_dtype", 0)
        version = ctx.opset("")
        self._fallback = FallbackOp(node, ctx) if has_fallback("", "DequantizeLinear", version) else None

    def _native(self, x, scale, zp) -> bool:
        return (
            x.dtype in _INTS
            and scale.dtype == np.float32
            and (zp is None or zp.dtype == x.dtype)
            and self.block_size == 0
            and self.output_dtype in (0, onnx.TensorProto.FLOAT)
        )

    def _axis(self, x) -> int:
        return self.axis + x.ndim if self.axis < 0 else self.axis

    def run(self, inputs: list, rt) -> tuple:
        x, scale, zp = (inputs + [None] * 3)[:3]
        if not self._native(x, scale, zp):
            if self._fallback is None:
                raise ValueError(
                    f"DequantizeLinear node '{self.name}': x {x.dtype} with {scale.dtype} scales, zero point "
                    f"{None if zp is None else zp.dtype}, block_size={self.block_size}: onnxkv runs int8/uint8/"
                    f"int16/uint16/int32 x with float32 scales of one per tensor or per axis, and onnx.reference "
                    f"has no DequantizeLinear at this model's opset"
                )
            return tuple(self._fallback.run(inputs, rt))
        if scale.size == 1 and scale.ndim <= 1:
            scale = scale.reshape(())  # one scale for the tensor (whatever the axis says, as ONNX Runtime)
        else:
            axis = self._axis(x)
            if scale.ndim != 1 or not 0 <= axis < x.ndim or x.shape[axis] != scale.size:
                raise ValueError(
                    f"DequantizeLinear node '{self.name}': axis={self.axis} with x {list(x.shape)}: expected one "
                    f"x_scale or a 1-D x_scale of x's size along that axis, got x_scale {list(scale.shape)}"
                )
            shape = [1] * x.ndim
            shape[axis] = scale.size
            scale = scale.reshape(shape)
        if zp is not None:
            if zp.size != scale.size:
                raise ValueError(
                    f"DequantizeLinear node '{self.name}': x_zero_point {list(zp.shape)} must match x_scale "
                    f"{list(scale.shape)}"
                )
            zp = zp.reshape(scale.shape)
        diff = x.astype(np.int64)
        if zp is not None:
            diff = diff - zp.astype(np.int64)
            if x.dtype == np.int32:  # ONNX Runtime subtracts in int32, which wraps
                diff = diff.astype(np.int32)
        out = rt.empty(0, x.shape, np.float32)
        np.multiply(diff.astype(np.float32), scale, out=out)
        return (out,)
