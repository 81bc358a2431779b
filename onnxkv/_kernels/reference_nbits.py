"""NumPy reference twins of the block-quantized products (``qmatmul``): the contracts of qmatmul.h.

Re-exported by :mod:`onnxkv._kernels.reference`, where tests and benchmarks find every twin.
"""

import numpy as np


def nbits_codes(B, K, N, bits, block_size):
    """The unsigned codes q [N, K] of a MatMulNBits weight B (uint8 [N, nblk, block_size * bits / 8],
    4-bit codes low nibble first)."""
    nblk = -(-K // block_size)
    b = B.reshape(N, nblk, block_size * bits // 8)
    if bits == 8:
        return b.reshape(N, -1)[:, :K]
    q = np.empty((N, nblk, block_size), np.uint8)
    q[:, :, 0::2] = b & 15
    q[:, :, 1::2] = b >> 4
    return q.reshape(N, -1)[:, :K]


def _packed_codes(w):
    """(q [N, nblk, bs] uint8 codes, zp [N, nblk], scale [N, nblk]) of a ``qmatmul.PackedNBits`` w,
    read back from its packed arrays (codes past K are the packing's padding)."""
    P, nblk, bs = w.P, w.nblk, w.block_size
    lines = np.asarray(w.qw).reshape(P, nblk, -1, 16, 4)
    if w.bits == 4:
        q = np.stack([lines & 15, lines >> 4], axis=3)  # [P, nblk, line, half, 16, 4]
        q = q.transpose(0, 4, 1, 2, 3, 5).reshape(P * 16, nblk, bs)
    else:
        q = lines.transpose(0, 3, 1, 2, 4).reshape(P * 16, nblk, bs)
    zp = np.full((P, nblk, 16), w.zconst, np.float32) if w.zp is None else np.asarray(w.zp)

    def panels(a):
        return a.transpose(0, 2, 1).reshape(P * 16, nblk)[: w.N]

    return q[: w.N], panels(zp), panels(np.asarray(w.sc))


def nbits_dequantize(w):
    """float32 [K, N] of a ``qmatmul.PackedNBits`` w: (q - zp) * scale, or lut[q] * scale for a codebook
    weight."""
    q, zp, sc = _packed_codes(w)
    v = q.astype(np.float32) if w.lut is None else np.asarray(w.lut)[q]
    deq = (v - zp[..., None]) * sc[..., None]
    return np.ascontiguousarray(deq.reshape(w.N, -1)[:, : w.K].T)


def _fma32(a, b, c):
    """float32 fma(a, b, c) of float32 arrays: the exact a * b + c of float64 (a is an integer below 2^24
    in the callers, so a * b is exact), rounded once more to float32."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def quantize_rows_int8(x, block_size):
    """The int8 blocks of x [M, K] (qmatmul.h): xq int8 [M, nblk * bs] (zero past K), xs and xsum
    float32 [M, nblk]."""
    M, K = x.shape
    nblk = -(-K // block_size)
    xp = np.zeros((M, nblk * block_size), np.float32)
    xp[:, :K] = x
    xb = xp.reshape(M, nblk, block_size)
    amax = np.abs(xb).max(axis=2)
    bad = ~np.isfinite(xb).all(axis=2)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = (np.float32(127) / amax).astype(np.float32)
    ok = np.isfinite(inv) & ~bad  # amax 0, or below 127 / FLT_MAX: a zero block
    inv = np.where(ok, inv, 0).astype(np.float32)
    safe = np.where(ok[..., None], xb, 0).astype(np.float32)  # NaN/inf blocks quantize to zeros
    xq = np.clip(np.rint((safe * inv[..., None]).astype(np.float32)), -127, 127).astype(np.int8)
    xs = np.where(bad, np.float32(np.nan), np.where(ok, amax / np.float32(127), 0)).astype(np.float32)
    xsum = xq.astype(np.int64).sum(axis=2).astype(np.float32)
    return xq.reshape(M, -1), xs, xsum


def matmul_nbits_int8(x, w, out, bias=None):
    """out = x @ w by the int8 contract of qmatmul.h (w a ``qmatmul.PackedNBits``): per block,
    t = fl(d - zp * xsum), acc = fma(t, fl(scale * xs), acc), blocks in order; out = acc + bias."""
    xq, xs, xsum = quantize_rows_int8(x, w.block_size)
    q, zp, sc = _packed_codes(w)
    d = np.einsum("mbk,nbk->mnb", xq.reshape(len(x), w.nblk, -1).astype(np.float64), q.astype(np.float64))
    acc = np.zeros((len(x), w.N), np.float32)
    for b in range(w.nblk):
        t = (d[:, :, b] - zp[None, :, b].astype(np.float64) * xsum[:, None, b]).astype(np.float32)
        acc = _fma32(t, (sc[None, :, b] * xs[:, None, b]).astype(np.float32), acc)
    out[...] = acc if bias is None else acc + bias


def matmul_nbits_f32(x, w, out, bias=None):
    """out = x @ dequantize(w) (+ bias), float64 accumulation (the float paths of qmatmul.h agree
    to float32 rounding)."""
    r = x.astype(np.float64) @ nbits_dequantize(w).astype(np.float64)
    out[...] = (r if bias is None else r + bias).astype(np.float32)


def bnb4_dequantize(B, absmax, K, N, block_size, lut):
    """float32 [K, N] of a MatMulBnb4 weight, as ONNX Runtime defines it: B (uint8, (N * K + 1) // 2 bytes)
    holds the codes of the flattened [N, K] weight, the even flat index in the high nibble; element i is
    lut[code] * absmax[i // block_size], one float32 product."""
    b = np.asarray(B, np.uint8).reshape(-1)
    codes = np.empty(2 * b.size, np.uint8)
    codes[0::2], codes[1::2] = b >> 4, b & 15
    i = np.arange(N * K)
    w = np.asarray(lut, np.float32)[codes[: N * K]] * np.asarray(absmax, np.float32).reshape(-1)[i // block_size]
    return np.ascontiguousarray(w.astype(np.float32).reshape(N, K).T)
