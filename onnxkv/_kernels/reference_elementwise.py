"""NumPy reference twins of ``activation``'s kernels (``softcap``'s is in reference.py) and of ``masks.causal_mask``.

Re-exported by :mod:`onnxkv._kernels.reference`, where tests and benchmarks find every twin.
"""

import numpy as np


def _sigmoid(x):
    xd = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-xd))


def sigmoid(x, out):
    out[...] = _sigmoid(x).astype(out.dtype)


def silu(x, out):
    out[...] = (x.astype(np.float64) * _sigmoid(x)).astype(out.dtype)


def add(x, y, out):
    """NumPy twin of ``add``: out = x + y."""
    np.add(x, y, out=out)
    return out


def silu_mul(gate, up, out):
    out[...] = (gate.astype(np.float64) * _sigmoid(gate) * up).astype(out.dtype)


def gelu_tanh_mul(gate, up, out):
    """NumPy twin of ``gelu_tanh_mul``: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) * up, in float64."""
    g = gate.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        out[...] = (0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3))) * up).astype(out.dtype)


def causal_mask(mask, rows, nq, nk, q0, window, out, visible=0.0, hidden=0.0):
    """NumPy twin of ``masks.causal_mask``."""
    k = np.arange(nk)
    q = np.arange(q0, q0 + nq)[:, None]
    seen = (k <= q) & ((k > q - window) if window > 0 else True)
    seen = np.broadcast_to(seen, (rows, nq, nk))
    if mask is not None:
        seen = seen & (mask[:rows, None, :nk] != 0)
    if out.dtype == np.bool_:
        out[...] = seen[:, None]
    else:
        out[...] = np.where(seen, np.float32(visible), np.float32(hidden))[:, None]
    return out


def mul_scalar(x, c, out):
    """NumPy twin of ``mul_scalar``: out = x * c (c one value)."""
    np.multiply(x, c.reshape(()), out=out)
    return out


def div_scalar(x, c, out):
    """NumPy twin of ``div_scalar``: out = x / c (c one value)."""
    np.divide(x, c.reshape(()), out=out)
    return out


def erf(x, out):
    """erf in float64 (math.erf), rounded to out's dtype."""
    import math

    out[...] = np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(out.dtype)
