"""Normalisations: RMS norms (ORT's SimplifiedLayerNormalization and
SkipSimplifiedLayerNormalization, ONNX RMSNormalization-23,
``ai.onnxkv::RMSNormChain``, the fused RMSNorm of torch exports, and
``ai.onnxkv::SkipRMSNormChain``, that norm with the residual add before it)
through the compiled kernels, and LayerNormalization / SkipLayerNormalization
in NumPy.

Kernels normalise over the last axis (``axis=-1``); other axes use NumPy.
Computation is in float32 for float16/bfloat16 inputs, then cast back.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from onnxkv import _kernels as K
from onnxkv._kernels._record import current as _recorder
from onnxkv.plan.fusion_export import RMS_NORM_INPUTS, SKIP_RMS_NORM_INPUTS
from onnxkv.plan.ops._body import Body
from onnxkv.plan.ops._util import add_float16, float16_pair, int_list, round_into, widened
from onnxkv.plan.registry import BuildContext, Op, register

_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: Dtypes of x an RMSNormChain runs on the rms_norm kernel (float16 widened, see RMSNormChain).
_CHAIN_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


def _rms_reference(x: np.ndarray, gamma: np.ndarray, eps: float, axis: int) -> np.ndarray:
    axes = tuple(range(axis % x.ndim, x.ndim))
    xf = x.astype(np.float32, copy=False)
    inv = 1.0 / np.sqrt(np.mean(xf * xf, axis=axes, keepdims=True) + eps)
    return (xf * inv * gamma).astype(x.dtype, copy=False)


def _skip_sum(x: np.ndarray, skip: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(the sum x + skip (+ bias) the norm reads, the sum output in x's type): a float16 / bfloat16 sum is
    normalised in float32, before its rounding to the output type, as ONNX Runtime does."""
    if x.dtype.kind == "f" and x.dtype.itemsize >= 4:
        s = x + skip if bias is None else x + skip + bias
        return s, s
    wide = x.astype(np.float32) + skip.astype(np.float32)
    if bias is not None:
        wide += bias.astype(np.float32)
    return wide, wide.astype(x.dtype)


def _float16_rows(x: np.ndarray, gamma: np.ndarray, axis: int) -> bool:
    """Whether a norm of float16 ``x`` (C-contiguous, non-empty) over its last axis with float16 or float32
    ``gamma`` [n] runs the float32 kernel on x's widening, rounded once."""
    return (
        x.dtype == np.float16
        and x.ndim >= 1
        and x.size > 0
        and axis in (-1, x.ndim - 1)
        and x.flags.c_contiguous
        and gamma.shape == (x.shape[-1],)
        and gamma.dtype in (np.float16, np.float32)
    )


class _RMSBase(Op):
    #: ``epsilon`` when the node has none (the operator schema's default).
    default_epsilon = 1e-5

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.eps = float(self.attrs.get("epsilon", self.default_epsilon))
        self.axis = int(self.attrs.get("axis", -1))

    def compilable(self, inputs: list) -> bool:
        """float32 x (C-contiguous, normalised over its last axis) and gamma: one ``rms_norm`` call; float16
        rows (:func:`_float16_rows`): the widening, the call and the rounding."""
        x, gamma = inputs[0], inputs[1]
        if isinstance(x, np.ndarray) and isinstance(gamma, np.ndarray) and _float16_rows(x, gamma, self.axis):
            return True
        return (
            isinstance(x, np.ndarray)
            and x.dtype == np.float32
            and x.ndim >= 1
            and x.size > 0
            and self.axis in (-1, x.ndim - 1)
            and x.flags.c_contiguous
            and isinstance(gamma, np.ndarray)
            and gamma.dtype == np.float32
            and gamma.shape == (x.shape[-1],)
        )

    def rms(self, x: np.ndarray, gamma: np.ndarray, rt) -> np.ndarray:
        n = x.shape[-1] if x.ndim else 1
        if (
            self.axis in (-1, x.ndim - 1)
            and x.dtype in _KERNEL_DTYPES
            and gamma.dtype == x.dtype
            and gamma.shape == (n,)
            and x.flags.c_contiguous
        ):
            out = rt.empty(0, x.shape, x.dtype)
            K.rms_norm(x.reshape(-1, n), gamma, self.eps, out.reshape(-1, n))
            return out
        if _float16_rows(x, gamma, self.axis):  # the float32 kernel on the widening, rounded once
            out = rt.empty(0, x.shape, x.dtype)
            RMSNormChain.normalise(x, gamma, self.eps, out, rt)
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

    Output 3 is the sum input + skip (+ bias); outputs 1 and 2 are not supported.  ``epsilon`` defaults
    to 1e-12, as ONNX Runtime's contrib schema (SimplifiedLayerNormalization's is 1e-5).
    """

    default_epsilon = 1e-12

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        outs = list(node.output) + [""] * 4
        if outs[1] or outs[2]:
            raise self.error("the optional mean / inv_std_var outputs are not supported")
        self.want_sum = bool(outs[3])

    def compilable(self, inputs: list) -> bool:
        """float32 input and skip of one shape (C-contiguous), gamma (and a bias) [n]: one ``skip_rms_norm``;
        float16 ones without a bias: the kernel calls of ``run``'s float16 path."""
        x, skip = inputs[0], inputs[1]
        bias = inputs[3] if len(inputs) > 3 else None
        if bias is None and float16_pair(x, skip) and _float16_rows(x, inputs[2], -1):
            return True
        return (
            super().compilable([x, inputs[2]])
            and isinstance(skip, np.ndarray)
            and skip.dtype == np.float32
            and skip.shape == x.shape
            and skip.flags.c_contiguous
            and (bias is None or (bias.dtype == np.float32 and bias.shape == (x.shape[-1],)))
        )

    def run(self, inputs: list, rt) -> tuple:
        x, skip, gamma = inputs[0], inputs[1], inputs[2]
        bias = inputs[3] if len(inputs) > 3 else None
        n = x.shape[-1]
        if (
            x.dtype in _KERNEL_DTYPES
            and skip.shape == x.shape
            and skip.dtype == x.dtype
            and gamma.dtype == x.dtype
            and x.flags.c_contiguous
            and skip.flags.c_contiguous
        ):
            out = rt.empty(0, x.shape, x.dtype)
            s = rt.empty(3, x.shape, x.dtype) if self.want_sum else None
            K.skip_rms_norm(
                x.reshape(-1, n),
                skip.reshape(-1, n),
                gamma,
                bias,
                self.eps,
                out.reshape(-1, n),
                None if s is None else s.reshape(-1, n),
            )
            return (out, None, None, s)
        if (
            float16_pair(x, skip)
            and _float16_rows(x, gamma, -1)
            and (bias is None or (bias.shape == (n,) and bias.dtype in (np.float16, np.float32)))
        ):  # _skip_sum and the norm below on the F16C and float32 kernels, bit for bit
            wide, normed = widened(x, rt), widened(skip, rt)
            K.add(wide.reshape(-1), normed.reshape(-1), wide.reshape(-1))
            if bias is not None:
                wide += bias.astype(np.float32)
            s = round_into(rt.empty(3, x.shape, x.dtype), wide) if self.want_sum else None
            y = rt.empty(0, x.shape, x.dtype)
            K.rms_norm(wide.reshape(-1, n), gamma.astype(np.float32, copy=False), self.eps, normed.reshape(-1, n))
            round_into(y, normed)
            rt.unscratch(wide, normed)
            return (y, None, None, s)
        wide, s = _skip_sum(x, skip, bias)
        if wide.dtype == np.float32 and gamma.shape == (n,) and gamma.dtype in (np.float16, np.float32):
            y = rt.empty(0, x.shape, x.dtype)  # float16 / bfloat16 x: the sum normalised by the float32 kernel
            normed = np.empty(wide.shape, np.float32)
            K.rms_norm(wide.reshape(-1, n), gamma.astype(np.float32, copy=False), self.eps, normed.reshape(-1, n))
            round_into(y, normed)
        else:
            y = _rms_reference(wide, gamma, self.eps, -1).astype(x.dtype, copy=False)
        return (y, None, None, s if self.want_sum else None)


_EXPONENT, _AXES, _EPS, _ONE = (RMS_NORM_INPUTS.index(r) for r in ("exponent", "axes", "eps", "one"))


def _scalar_equal(x: np.ndarray | None, value: float) -> bool:
    return x is not None and x.size == 1 and x.dtype.kind in "fiu" and float(x.reshape(())) == value


@register("RMSNormChain", domain="ai.onnxkv", internal=True)
class RMSNormChain(Op):
    """The exported RMSNorm chain fused by :func:`onnxkv.plan.fusion_export.fuse_rms_norm`.

    Inputs by position (:data:`~onnxkv.plan.fusion_export.RMS_NORM_INPUTS`):
    ``x`` (any shape), ``weight``, the Pow ``exponent``, the ReduceMean
    ``axes`` (empty name: the ReduceMean's ``axes`` attribute), ``eps`` and the
    Div numerator ``one`` (empty name: a Reciprocal); attribute ``body``: the
    replaced nodes.  Output: ``y`` of x's shape.

    The compiled ``rms_norm`` kernel computes ``y = x / sqrt(mean(x², -1) +
    eps) * weight`` (equal to the chain up to float32 rounding) when the
    exponent is 2, the numerator 1, ``eps`` a finite scalar >= 0, the mean is
    over the last axis only with ``keepdims=1``, ``x`` is float32 and
    ``weight`` float32 of shape ``[x.shape[-1]]``.  float16 ``x`` and
    ``weight`` (a float16 export) run the same kernel on their float32
    widening, ``y`` rounded once to float16, as ONNX Runtime's fused
    float16 norm computes it: the literal chain rounds after each operator,
    and its float16 ``x²`` overflows above 255.9, where the fused result stays
    finite.  Constant parameters are checked once when the plan is built, the
    rest on every call; any call failing a check evaluates the body literally.
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self._body = Body.of(self, ctx, RMS_NORM_INPUTS)
        reduce = BuildContext.attributes(self._body.node("ReduceMean"))
        self._keepdims = int(reduce.get("keepdims", 1)) == 1
        self._axes_attr = reduce.get("axes")
        params = [ctx.constant(x) if x else None for x in node.input[: len(RMS_NORM_INPUTS)]]
        static = all(p is not None or not node.input[i] for i, p in enumerate(params) if i > 1)
        #: (eps, axis) checked at build time, or None to check on every call.
        self._static = self._params(params) if static else None
        self._dynamic = not static

    def _params(self, inputs: list) -> tuple[float, int] | None:
        """(eps, reduced axis: -1 or a non-negative axis) when the parameters are the kernel's, else None."""
        one = inputs[_ONE]
        if (
            not self._keepdims
            or not _scalar_equal(inputs[_EXPONENT], 2.0)
            or (one is not None and not _scalar_equal(one, 1.0))
        ):
            return None
        eps = inputs[_EPS]
        if eps is None or eps.size != 1 or eps.dtype.kind != "f":
            return None
        eps = float(eps.reshape(()))
        axes = int_list(inputs[_AXES]) if inputs[_AXES] is not None else self._axes_attr
        if not (eps >= 0.0 and math.isfinite(eps)) or axes is None or len(axes) != 1:
            return None
        return eps, int(axes[0])

    def kernel_params(self, inputs: list, x: np.ndarray) -> float | None:
        """``eps`` when the kernel computes this chain for ``x`` and the ``inputs`` (by
        :data:`~onnxkv.plan.fusion_export.RMS_NORM_INPUTS` position; ``x`` itself
        is not read from them), else None."""
        params = self._params(inputs) if self._dynamic else self._static
        w = inputs[1]
        if (
            params is not None
            and x.dtype in _CHAIN_DTYPES
            and x.ndim
            # a one-element parameter of higher rank than x broadcasts y to its rank: the body's result
            and all(inputs[i] is None or inputs[i].ndim <= x.ndim for i in (_EXPONENT, _EPS, _ONE))
            and x.shape[-1]
            and params[1] in (-1, x.ndim - 1)
            and w is not None
            and w.dtype == x.dtype
            and w.shape == (x.shape[-1],)
        ):
            return params[0]
        return None

    @staticmethod
    def normalise(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray, rt=None) -> None:
        """``out`` (x's shape and dtype) = the kernel's norm of ``x`` (float32, or float16 widened and the
        result rounded once) with ``w`` of x's dtype and ``eps`` from :meth:`kernel_params`; ``rt``: the
        running node's context (its scratch holds a float16 x's widening)."""
        n = x.shape[-1]
        if x.dtype == np.float32:
            K.rms_norm(np.ascontiguousarray(x).reshape(-1, n), w, eps, out.reshape(-1, n))
            return
        wide = widened(x, rt)
        K.rms_norm(wide.reshape(-1, n), w.astype(np.float32), eps, wide.reshape(-1, n))
        round_into(out, wide)
        if rt is not None:
            rt.unscratch(wide)

    def compilable(self, inputs: list) -> bool:
        """Constant parameters and a C-contiguous float32 x: one recorded ``rms_norm`` call (``run`` refuses
        the recording when it evaluates the body literally); a float16 x: the widening, the call and the
        rounding."""
        x = inputs[0]
        return (
            not self._dynamic
            and isinstance(x, np.ndarray)
            and x.dtype in _CHAIN_DTYPES
            and x.size > 0
            and x.flags.c_contiguous
        )

    def run(self, inputs: list, rt) -> tuple:
        x, w = inputs[0], inputs[1]
        eps = self.kernel_params(inputs, x)
        if eps is not None:
            out = rt.empty(0, x.shape, x.dtype)
            self.normalise(x, w, eps, out, rt)
            return (out,)
        _refuse_literal(self)
        return tuple(self._body.evaluate(self.node.input, inputs, rt))


_SKIP_NORM_PARAMS = slice(SKIP_RMS_NORM_INPUTS.index("weight"), len(SKIP_RMS_NORM_INPUTS))


@register("SkipRMSNormChain", domain="ai.onnxkv", internal=True)
class SkipRMSNormChain(Op):
    """A residual add and the RMSNormChain reading it, fused by :func:`onnxkv.plan.fusion_export.fuse_skip_rms_norm`.

    Inputs by position (:data:`~onnxkv.plan.fusion_export.SKIP_RMS_NORM_INPUTS`):
    the addends ``a`` and ``b``, then the RMSNormChain's inputs after ``x``;
    attribute ``body``: the replaced ``Add``, optional ``Cast`` to float and
    ``RMSNormChain``.  Outputs: ``y`` (the norm) and ``s``, the sum as the
    norm read it (empty name: not produced; else a fresh array of a's shape).

    The compiled ``skip_rms_norm`` kernel writes ``s = a + b`` (exactly the
    float32 ``Add``; the ``Cast`` is then the identity) and ``y`` in one pass
    when ``a`` and ``b`` are non-empty float32 arrays of one shape and the
    body's RMSNormChain would run its kernel on ``s`` (see
    :meth:`RMSNormChain.kernel_params`); otherwise the body is evaluated literally.
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self._body = Body.of(self, ctx, SKIP_RMS_NORM_INPUTS)
        norm = self._body.kernel("RMSNormChain")
        if (
            not isinstance(norm, RMSNormChain)
            or len(node.output) != 2
            or len(self._body.outputs) != 1 + bool(node.output[1])
        ):
            raise self.error("needs a 'body' ending in an RMSNormChain and outputs (y, sum or empty)")
        self._norm = norm
        self._want_sum = bool(node.output[1])

    def compilable(self, inputs: list) -> bool:
        """Constant norm parameters and C-contiguous float32 addends: one recorded ``skip_rms_norm`` call
        (``run`` refuses the recording when it evaluates the body literally)."""
        a, b = inputs[0], inputs[1]
        return not self._norm._dynamic and (
            float16_pair(a, b)
            or all(isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous for x in (a, b))
        )

    def run(self, inputs: list, rt) -> tuple:
        a, b = inputs[0], inputs[1]
        if a.dtype == np.float32 and b.dtype == np.float32 and a.shape == b.shape and a.size:
            eps = self._norm.kernel_params([None, *inputs[_SKIP_NORM_PARAMS]], a)
            if eps is not None:
                n = a.shape[-1]
                out = rt.empty(0, a.shape, np.float32)
                s = rt.empty(1, a.shape, np.float32) if self._want_sum else None
                K.skip_rms_norm(
                    np.ascontiguousarray(a).reshape(-1, n),
                    np.ascontiguousarray(b).reshape(-1, n),
                    inputs[_SKIP_NORM_PARAMS.start],
                    None,
                    eps,
                    out.reshape(-1, n),
                    None if s is None else s.reshape(-1, n),
                )
                return (out, s)
        if float16_pair(a, b):
            eps = self._norm.kernel_params([None, *inputs[_SKIP_NORM_PARAMS]], a)  # the sum: a's shape and dtype
            if eps is not None and len(self._body.steps) == 2:  # Add, RMSNormChain: no Cast between them
                s = rt.empty(1, a.shape, a.dtype) if self._want_sum else rt.scratch(a.shape, a.dtype)
                add_float16(a, b, s, rt)  # the float16 Add
                out = rt.empty(0, a.shape, a.dtype)
                self._norm.normalise(s, inputs[_SKIP_NORM_PARAMS.start], eps, out, rt)
                if not self._want_sum:
                    rt.unscratch(s)
                return (out, s if self._want_sum else None)
        _refuse_literal(self)
        values = self._body.evaluate(self.node.input, inputs, rt)
        return (values[0], values[1] if self._want_sum else None)


def _refuse_literal(op: Op) -> None:
    """A fused norm evaluates its body literally: refuse a recording thread's recording of it."""
    rec = _recorder()
    if rec is not None:
        rec.refused.append(f"{op.op_type} node '{op.name}': evaluated literally")


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
        y, mu, inv = _layer_norm(
            x, gamma, beta, float(self.attrs.get("epsilon", 1e-5)), int(self.attrs.get("axis", -1))
        )
        return (y, mu, inv)


@register("SkipLayerNormalization", domain="com.microsoft")
class SkipLayerNormalization(Op):
    def run(self, inputs: list, rt) -> tuple:
        x, skip, gamma = inputs[0], inputs[1], inputs[2]
        beta = inputs[3] if len(inputs) > 3 else None
        bias = inputs[4] if len(inputs) > 4 else None
        wide, s = _skip_sum(x, skip, bias)
        y, mu, inv = _layer_norm(wide, gamma, beta, float(self.attrs.get("epsilon", 1e-12)), -1)
        return (y.astype(x.dtype, copy=False), mu, inv, s)
