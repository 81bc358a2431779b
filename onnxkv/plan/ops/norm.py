"""Normalisations: RMS norms (ORT's SimplifiedLayerNormalization and
SkipSimplifiedLayerNormalization, ONNX RMSNormalization-23) through the
compiled kernels, and LayerNormalization / SkipLayerNormalization in NumPy.

Kernels normalise over the last axis (``axis=-1``); other axes use NumPy.
Computation is in float32 for float16/bfloat16 inputs, then cast back.
"""

from __future__ import annotations

import numpy as np

from onnxkv import _kernels as K
from onnxkv.plan.registry import BuildContext, Op, register

_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _rms_reference(x: np.ndarray, gamma: np.ndarray, eps: float, axis: int) -> np.ndarray:
    axes = tuple(range(axis % x.ndim, x.ndim))
    xf = x.astype(np.float32, copy=False)
    inv = 1.0 / np.sqrt(np.mean(xf * xf, axis=axes, keepdims=True) + eps)
    return (xf * inv * gamma).astype(x.dtype, copy=False)


class _RMSBase(Op):
    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.eps = float(self.attrs.get("epsilon", 1e-5))
        self.axis = int(self.attrs.get("axis", -1))

    def rms(self, x: np.ndarray, gamma: np.ndarray, rt) -> np.ndarray:
        n = x.shape[-1] if x.ndim else 1
        if self.axis in (-1, x.ndim - 1) and x.dtype in _KERNEL_DTYPES and gamma.dtype == x.dtype \
                and gamma.shape == (n,) and x.flags.c_contiguous:
            out = rt.empty(0, x.shape, x.dtype)
            K.rms_norm(x.reshape(-1, n), gamma, self.eps, out.reshape(-1, n))
            return out
        return _rms_reference(x, gamma, self.eps, self.axis)


@register("SimplifiedLayerNormalization")
@register("SimplifiedLayerNormalization", domain="com.microsoft")
class SimplifiedLayerNormalization(_RMSBase):
    """Y = X / sqrt(mean(X², last axes) + eps) * scale; optional inv_std_var output unsupported."""

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        if len(node.output) > 1 and any(node.output[1:]):
            raise self.error("the optional inv_std_var output is not supported")

    def run(self, inputs: list, rt) -> tuple:
        return (self.rms(inputs[0], inputs[1], rt),)


@register("RMSNormalization", since=23)
class RMSNormalization(_RMSBase):
    def run(self, inputs: list, rt) -> tuple:
        return (self.rms(inputs[0], inputs[1], rt),)


@register("SkipSimplifiedLayerNormalization", domain="com.microsoft")
class SkipSimplifiedLayerNormalization(_RMSBase):
    """Inputs (input, skip, gamma[, bias]); outputs (output, mean, inv_std_var, input_skip_bias_sum).

    Output 3 is the sum input + skip (+ bias); outputs 1 and 2 are not supported.
    """

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        outs = list(node.output) + [""] * 4
        if outs[1] or outs[2]:
            raise self.error("the optional mean / inv_std_var outputs are not supported")
        self.want_sum = bool(outs[3])

    def run(self, inputs: list, rt) -> tuple:
        x, skip, gamma = inputs[0], inputs[1], inputs[2]
        bias = inputs[3] if len(inputs) > 3 else None
        n = x.shape[-1]
        if x.dtype in _KERNEL_DTYPES and skip.shape == x.shape and skip.dtype == x.dtype and gamma.dtype == x.dtype \
                and x.flags.c_contiguous and skip.flags.c_contiguous:
            out = rt.empty(0, x.shape, x.dtype)
            s = rt.empty(3, x.shape, x.dtype) if self.want_sum else None
            K.skip_rms_norm(x.reshape(-1, n), skip.reshape(-1, n), gamma, bias, self.eps,
                            out.reshape(-1, n), None if s is None else s.reshape(-1, n))
            return (out, None, None, s)
        s = x + skip if bias is None else x + skip + bias
        return (_rms_reference(s, gamma, self.eps, -1), None, None, s if self.want_sum else None)


def _layer_norm(x, gamma, beta, eps, axis):
    axes = tuple(range(axis % x.ndim, x.ndim))
    xf = x.astype(np.float32, copy=False)
    mu = xf.mean(axis=axes, keepdims=True)
    var = ((xf - mu) ** 2).mean(axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(var + eps)
    y = (xf - mu) * inv * gamma
    if beta is not None:
        y = y + beta
    return y.astype(x.dtype, copy=False), mu, inv


@register("LayerNormalization", since=17)
class LayerNormalization(Op):
    def run(self, inputs: list, rt) -> tuple:
        x, gamma = inputs[0], inputs[1]
        beta = inputs[2] if len(inputs) > 2 else None
        y, mu, inv = _layer_norm(x, gamma, beta, float(self.attrs.get("epsilon", 1e-5)), int(self.attrs.get("axis", -1)))
        return (y, mu, inv)


@register("SkipLayerNormalization", domain="com.microsoft")
class SkipLayerNormalization(Op):
    def run(self, inputs: list, rt) -> tuple:
        x, skip, gamma = inputs[0], inputs[1], inputs[2]
        beta = inputs[3] if len(inputs) > 3 else None
        bias = inputs[4] if len(inputs) > 4 else None
        s = x + skip if bias is None else x + skip + bias
        y, mu, inv = _layer_norm(s, gamma, beta, float(self.attrs.get("epsilon", 1e-12)), -1)
        return (y, mu, inv, s)
