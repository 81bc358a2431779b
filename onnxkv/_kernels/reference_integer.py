"""NumPy reference twins of the integer products (``imatmul``): the contracts of imatmul.h.

Re-exported by :mod:`onnxkv._kernels.reference`, where tests and benchmarks find every twin.
"""

import numpy as np


def matmul_integer(a, b, a_zero_point=None, b_zero_point=None):
    """ONNX MatMulInteger of a (uint8 or int8 [M, K]) and b (uint8 or int8 [K, N]): int32 [M, N] =
    (a - a_zero_point) @ (b - b_zero_point), exact in int64 and wrapped to int32 as int32 accumulation
    wraps.  Zero points: None, one value, or one per row of a / column of b."""
    a64 = a.astype(np.int64)
    b64 = b.astype(np.int64)
    if a_zero_point is not None:
        a64 = a64 - np.asarray(a_zero_point, np.int64).reshape(-1, 1)
    if b_zero_point is not None:
        b64 = b64 - np.asarray(b_zero_point, np.int64).reshape(1, -1)
    return (a64 @ b64).astype(np.int32)


def dynamic_quantize_linear(x):
    """ONNX DynamicQuantizeLinear as ONNX Runtime computes it (imatmul.h): (y uint8 of x's shape,
    scale float32, zero point uint8)."""
    x = np.asarray(x, np.float32)
    finite = x[~np.isnan(x)]
    lo = np.float32(min(0.0, finite.min())) if finite.size else np.float32(0)
    hi = np.float32(max(0.0, finite.max())) if finite.size else np.float32(0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.float32(1) if hi == lo else np.float32(hi - lo) / np.float32(255)
        z = np.float32(0) - lo / scale
        z = z if z < 255 else np.float32(255)  # a NaN to 255
        z = z if z > 0 else np.float32(0)
        zp = np.rint(z)
        v = np.rint(x / scale) + zp
    v = np.where(np.isnan(v), np.float32(0), v)  # a NaN to 0
    y = np.clip(v, 0, 255).astype(np.uint8)
    return y, np.float32(scale), np.uint8(zp)


def matmul_dynamic(x, b, b_zero_point, ws):
    """The chain DynamicQuantizeLinear(x) -> MatMulInteger(., b) -> Cast(float32) -> Mul(., x_scale * ws):
    float32 [M, N] for x float32 [M, K], b uint8 or int8 [K, N], ws float32 [N] (or one value)."""
    y, scale, zp = dynamic_quantize_linear(x)
    products = matmul_integer(y, b, zp, b_zero_point)
    return products.astype(np.float32) * (np.float32(scale) * np.asarray(ws, np.float32))
