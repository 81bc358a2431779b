"""Random MatMulNBits weights in ONNX Runtime's layout, shared by the kernel, operator and fusion tests."""

import numpy as np


def make_weight(rng, K_, N, bits, bs, zp_kind):
    """Random ORT-layout MatMulNBits inputs: (B, scales, zero_points)."""
    nblk = -(-K_ // bs)
    q = rng.integers(0, 1 << bits, (N, nblk * bs), dtype=np.uint8)
    B = q if bits == 8 else (q[:, 0::2] | (q[:, 1::2] << 4))
    B = np.ascontiguousarray(B.reshape(N, nblk, bs * bits // 8))
    scales = (rng.random((N, nblk), dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    if zp_kind == "none":
        zp = None
    elif zp_kind == "float":
        zp = (rng.random((N, nblk)) * ((1 << bits) - 1)).astype(np.float32)
    else:
        z = rng.integers(0, 1 << bits, (N, nblk + (nblk & 1 if bits == 4 else 0)), dtype=np.uint8)
        zp = z.reshape(-1) if bits == 8 else (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1)
    return B, scales.reshape(-1), zp
