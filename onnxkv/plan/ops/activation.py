"""Softmax / LogSoftmax (kernel over the last axis), Gelu, and ONNX Runtime's Gelu family (Gelu, BiasGelu,
FastGelu, QuickGelu: what its transformer optimizer fuses GELUs into)."""

from __future__ import annotations

import numpy as np

from onnxkv import _kernels as K
from onnxkv.plan.ops._body import Body
from onnxkv.plan.ops._util import float16_pair, float32_pair, normalize_axis, round_into, widened
from onnxkv.plan.registry import BuildContext, Op, register


def _softmax_np(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax along ``axis`` as ONNX Runtime computes it, ``exp(x - max) / sum``: a slice that is entirely
    -inf, or holds +inf, gives NaN throughout (-inf - -inf, inf - inf); an empty axis gives the empty input."""
    if x.shape[axis] == 0:
        return x.copy()
    with np.errstate(invalid="ignore"):
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return e / np.sum(e, axis=axis, keepdims=True)


@register("Softmax", since=13)
class Softmax(Op):
    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        axis = normalize_axis(self.attrs.get("axis", -1), x.ndim, f"Softmax '{self.name}'")
        if axis == x.ndim - 1 and x.dtype == np.float32 and x.flags.c_contiguous and x.size:
            out = rt.empty(0, x.shape, x.dtype)
            n = x.shape[-1]
            K.softmax(x.reshape(-1, n), out.reshape(-1, n), empty_row=np.nan)  # all -inf: NaN, as ONNX
            return (out,)
        return (_softmax_np(x, axis).astype(x.dtype, copy=False),)


def _log_softmax_np(x: np.ndarray, axis: int) -> np.ndarray:
    """LogSoftmax along ``axis``; a slice that is entirely -inf gives NaN, as ONNX's; an empty axis gives
    the empty input."""
    if x.shape[axis] == 0:
        return x.copy()
    m = np.max(x, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore"):
        return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def _hardmax_np(x: np.ndarray, axis: int) -> np.ndarray:
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    y = np.zeros(x.shape, x.dtype)
    if x.size:
        np.put_along_axis(y, np.expand_dims(np.argmax(x, axis=axis), axis), 1, axis=axis)
    return y


@register("LogSoftmax", since=13)
class LogSoftmax(Op):
    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        axis = normalize_axis(self.attrs.get("axis", -1), x.ndim, f"LogSoftmax '{self.name}'")
        return (_log_softmax_np(x, axis).astype(x.dtype, copy=False),)


@register("Hardmax", since=13)
class Hardmax(Op):
    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        return (_hardmax_np(x, normalize_axis(self.attrs.get("axis", -1), x.ndim, f"Hardmax '{self.name}'")),)


class _Coerced2D(Op):
    """Softmax, LogSoftmax and Hardmax of opsets 1-12: the input coerced to 2-D at ``axis`` (default 1),
    [prod(shape[:axis]), prod(shape[axis:])], the operator along the second dimension (every element
    from ``axis`` on together), reshaped back.  Opset 13 made them act along one axis."""

    fn = staticmethod(_softmax_np)

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        axis = normalize_axis(self.attrs.get("axis", 1), x.ndim, f"{self.op_type} '{self.name}'")
        flat = x.reshape(int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:])))
        return (self.fn(flat, 1).astype(x.dtype, copy=False).reshape(x.shape),)


for _name, _fn in (("Softmax", _softmax_np), ("LogSoftmax", _log_softmax_np), ("Hardmax", _hardmax_np)):
    register(_name, since=1)(type(f"{_name}Opset1", (_Coerced2D,), {"fn": staticmethod(_fn)}))


@register("Gelu", since=20)
class Gelu(Op):
    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.approx = self.attrs.get("approximate", "none")

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        if self.approx == "tanh":
            y = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
        else:
            return (_gelu_erf(x),)
        return (y.astype(x.dtype, copy=False),)


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + erf(x / sqrt(2))) in x's type (float32 / float64; others through float64)."""
    xf = np.asarray(x, np.float64) if x.dtype not in (np.float32, np.float64) else x
    e = np.empty(xf.shape, xf.dtype)
    K.erf(np.require(xf / xf.dtype.type(np.sqrt(2)), requirements="C"), e)  # a 0-D x stays 0-D
    return (xf.dtype.type(0.5) * xf * (1 + e)).astype(x.dtype, copy=False)


def _plus_bias(op: Op, x: np.ndarray, bias) -> np.ndarray:
    """x + bias, bias broadcast along x's last axis (ONNX Runtime's BiasGelu / FastGelu contract)."""
    if bias is None:
        return x
    if bias.ndim != 1 or x.ndim == 0 or bias.shape[0] != x.shape[-1] or bias.dtype != x.dtype:
        raise ValueError(
            f"{op.op_type} node '{op.name}': bias must be 1-D of x's last dimension {x.shape[-1:]} and type "
            f"{x.dtype}, got {bias.dtype} {list(bias.shape)}"
        )
    return x + bias


@register("Gelu", domain="com.microsoft")
class MsGelu(Op):
    """com.microsoft::Gelu: 0.5 x (1 + erf(x / sqrt(2)))."""

    def run(self, inputs: list, rt) -> tuple:
        return (_gelu_erf(inputs[0]),)


@register("BiasGelu", domain="com.microsoft")
class BiasGelu(Op):
    """com.microsoft::BiasGelu: Gelu(A + B), B 1-D along A's last axis."""

    def run(self, inputs: list, rt) -> tuple:
        return (_gelu_erf(_plus_bias(self, inputs[0], inputs[1])),)


@register("FastGelu", domain="com.microsoft")
class FastGelu(Op):
    """com.microsoft::FastGelu: the tanh approximation 0.5 x (1 + tanh(x (a + g x^2))), a = sqrt(2 / pi),
    g = 0.044715 a, of x = X (+ bias along the last axis), in X's type (float16 through float32)."""

    def run(self, inputs: list, rt) -> tuple:
        x = _plus_bias(self, inputs[0], inputs[1] if len(inputs) > 1 else None)
        xf = x.astype(np.float32) if x.dtype not in (np.float32, np.float64) else x
        a = xf.dtype.type(0.7978845608028654)
        g = xf.dtype.type(0.035677408136300125)
        y = xf.dtype.type(0.5) * xf * (1 + np.tanh(xf * (a + g * xf * xf)))
        return (y.astype(x.dtype, copy=False),)


@register("QuickGelu", domain="com.microsoft")
class QuickGelu(Op):
    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        alpha = float(self.attrs.get("alpha", 1.702))
        if x.dtype not in (np.float32, np.float64):  # float16, bfloat16: in float32 (the kernel's types)
            xf = x.astype(np.float32)
            return ((xf / (1.0 + np.exp(-alpha * xf))).astype(x.dtype),)
        out = rt.empty(0, x.shape, x.dtype)
        K.sigmoid((alpha * x).reshape(-1), out.reshape(-1))
        np.multiply(out, x, out=out)
        return (out,)


@register("SiluMul", domain="ai.onnxkv", internal=True)
class SiluMul(Op):
    """Fused SwiGLU gate: ``gate * sigmoid(gate) * up`` (made by :mod:`onnxkv.plan.fusion`); float16 gate and
    up are computed in float32 and rounded once."""

    def compilable(self, inputs: list) -> bool:
        """float32 gate and up of one shape, C-contiguous: one ``silu_mul`` call (float16: with the widenings
        and the rounding)."""
        return float32_pair(*inputs) or float16_pair(*inputs)

    def run(self, inputs: list, rt) -> tuple:
        gate, up = inputs
        if (
            gate.shape == up.shape
            and gate.dtype == up.dtype
            and gate.dtype in (np.float32, np.float64)
            and gate.flags.c_contiguous
            and up.flags.c_contiguous
        ):
            out = rt.empty(0, gate.shape, gate.dtype)
            K.silu_mul(gate.reshape(-1), up.reshape(-1), out.reshape(-1))
            return (out,)
        if gate.shape == up.shape and gate.dtype == up.dtype == np.float16:  # in float32, rounded once
            wg, wu = widened(gate, rt), widened(up, rt)
            K.silu_mul(wg.reshape(-1), wu.reshape(-1), wg.reshape(-1))
            out = rt.empty(0, gate.shape, gate.dtype)
            round_into(out, wg)
            rt.unscratch(wg, wu)
            return (out,)
        return ((gate / (1 + np.exp(-gate)) * up).astype(gate.dtype, copy=False),)


@register("GeluTanhMul", domain="ai.onnxkv", internal=True)
class GeluTanhMul(Op):
    """Fused GeGLU gate: ``gelu_tanh(gate) * up`` (Gemma's MLP), made by
    :func:`onnxkv.plan.fusion_gelu.fuse_gelu_tanh_gate` from the ten nodes of its export (the ``body``).

    float32 gate and up of one shape, C-contiguous, take the ``gelu_tanh_mul`` kernel (a compiled step replays
    it), whose tanh form is ``g * sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3))``: the export's value up to
    float32 rounding; anything else evaluates the body literally.
    """

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self._body = Body.of(self, ctx, ("gate", "up"))

    def compilable(self, inputs: list) -> bool:
        return float32_pair(*inputs[:2])

    def run(self, inputs: list, rt) -> tuple:
        gate, up = inputs[0], inputs[1]
        if float32_pair(gate, up):
            out = rt.empty(0, gate.shape, np.float32)
            K.gelu_tanh_mul(gate.reshape(-1), up.reshape(-1), out.reshape(-1))
            return (out,)
        return tuple(self._body.evaluate(self.node.input, inputs, rt))


@register("Softcap", domain="ai.onnxkv", internal=True)
class Softcap(Op):
    """Fused tanh cap ``Mul(Tanh(Div(x, c)), c)`` (Gemma 2's final logits), made by
    :func:`onnxkv.plan.fusion_softcap.fuse_softcaps` from its three nodes (the ``body``); inputs ``x``,
    ``c_div``, ``c_mul``.

    When both caps are build-time constants holding one float32 value each, the same finite non-zero value,
    a float32 x (non-empty, of no lower rank than either cap; packed first when strided) takes the ``softcap``
    kernel (a compiled step replays it for a C-contiguous x): the export's value up to the kernel's tanh (a
    few float32 ulps); anything else evaluates the body literally.
    """

    uses_blas = False

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self._body = Body.of(self, ctx, ("x", "c_div", "c_mul"))
        caps = [ctx.constant(n) if n else None for n in list(node.input[1:3])]
        same = len(caps) == 2 and all(isinstance(c, np.ndarray) and c.dtype == np.float32 and c.size == 1 for c in caps)
        value = float(caps[0].reshape(())) if same else 0.0
        #: The cap as a one-element array the kernel reads (the step's constant), or None: the body runs.
        self._cap = (
            np.array([value], np.float32)
            if same and value == float(caps[1].reshape(())) and np.isfinite(value) and value != 0.0
            else None
        )
        self._rank = max(c.ndim for c in caps) if same else 0

    def _kernel(self, x) -> bool:
        """Whether ``x`` takes the kernel (whatever its layout: the arithmetic must not depend on it)."""
        return (
            self._cap is not None
            and isinstance(x, np.ndarray)
            and x.dtype == np.float32
            and x.size > 0
            and x.ndim >= self._rank
        )

    def compilable(self, inputs: list) -> bool:
        return self._kernel(inputs[0]) and inputs[0].flags.c_contiguous  # a packing copy would not be recorded

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        if self._kernel(x):
            out = rt.empty(0, x.shape, np.float32)
            K.softcap(np.ascontiguousarray(x).reshape(-1), self._cap, out.reshape(-1))
            return (out,)
        return tuple(self._body.evaluate(self.node.input, inputs, rt))
