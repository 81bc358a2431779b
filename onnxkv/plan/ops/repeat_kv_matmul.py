"""``ai.onnxkv::RepeatKvMatMul``: grouped-query attention products without repeat_kv.

Made by :func:`onnxkv.plan.fusion.fuse_repeat_kv_matmul` from

* ``transpose_b=1``: ``MatMul(A, [s *] Transpose(R(K), perm=[0, 1, 3, 2]))``
* ``transpose_b=0``: ``MatMul(A, R(K))``

where ``R(X) = Reshape(Expand(Unsqueeze(X, axes), expand_shape), reshape_shape)``
repeats each of the ``H`` KV heads ``n`` times.  Inputs: ``A`` [B, H*n, S, *],
``X`` [B, H, T, D] (typically a zero-copy view of the cache), ``axes``,
``expand_shape``, ``reshape_shape``, optional scalar ``s``, optional
``post`` (a ``Mul`` that followed the product, applied to the result).
Attribute ``reshape_from_x`` (:data:`~onnxkv.plan.fusion.RESHAPE_FROM_X`, set
by shape folding) = ``[4]``: ``reshape_shape`` is a template whose 0 entries
are X's dims at the same positions.
Output: the MatMul result (times ``post``).  When the shape tensors describe exactly that repeat, the
product is computed group by group (``A`` viewed as [B, H, n*S, *]) against
``X`` itself: the cache is read once, never copied per query head or
transposed.  Otherwise the original expression is evaluated literally.
"""

from __future__ import annotations

import numpy as np

from onnxkv.plan.fusion import REPEAT_KV_INPUTS, RESHAPE_FROM_X, reshape_from_x
from onnxkv.plan.ops._util import int_list, matmul
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["RepeatKvMatMul", "RepeatKvShape", "repeated_shape"]


def _reshape_dims(dims: list[int], source: tuple[int, ...]) -> list[int]:
    """ONNX Reshape target (allowzero=0): 0 copies the source dim; -1 is left to NumPy."""
    return [source[i] if d == 0 else d for i, d in enumerate(dims)]


def repeated_shape(x_shape: tuple[int, ...], axes, eshape, rshape) -> tuple[int, ...]:
    """Shape of ``Reshape(Expand(Unsqueeze(x, axes), eshape), rshape)`` without building it."""
    unsq = list(x_shape)
    for a in sorted(int(v) % (len(x_shape) + len(int_list(axes))) for v in int_list(axes)):
        unsq.insert(a, 1)
    expanded = np.broadcast_shapes(tuple(unsq), tuple(int_list(eshape)))
    dims = _reshape_dims(int_list(rshape), expanded)
    if -1 in dims:
        known = int(np.prod([v for v in dims if v != -1]))
        dims[dims.index(-1)] = int(np.prod(expanded)) // known if known else 0
    if int(np.prod(dims)) != int(np.prod(expanded)):
        raise ValueError(f"cannot reshape {expanded} to {int_list(rshape)}")
    return tuple(dims)


@register("RepeatKvShape", domain="ai.onnxkv", internal=True)
class RepeatKvShape(Op):
    """``Shape`` (with start/end) of a repeat_kv result, from the shapes alone."""

    def run(self, inputs: list, rt) -> tuple:
        x, axes, eshape, rshape = inputs
        shape = repeated_shape(x.shape, axes, eshape, rshape)
        start, end = self.attrs.get("start", 0), self.attrs.get("end")
        return (np.array(shape[start:end] if end is not None else shape[start:], dtype=np.int64),)


@register("RepeatKvMatMul", domain="ai.onnxkv", internal=True)
class RepeatKvMatMul(Op):
    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.transpose_b = bool(self.attrs.get("transpose_b", 0))
        self._template = REPEAT_KV_INPUTS["RepeatKvMatMul"][0][3] in self.attrs.get(RESHAPE_FROM_X, ())

    def _is_repeat(self, x: np.ndarray, axes, eshape, rshape) -> int:
        """Repeat count n if (axes, eshape, rshape) repeat x's heads n times, else 0."""
        if x.ndim != 4 or int_list(axes) not in ([2], [-3]):
            return 0
        b, h, t, d = x.shape
        try:
            expanded = np.broadcast_shapes((b, h, 1, t, d), tuple(int_list(eshape)))
        except ValueError:
            return 0
        if len(expanded) != 5 or (expanded[0], expanded[1], expanded[3], expanded[4]) != (b, h, t, d):
            return 0
        n = expanded[2]
        dims = _reshape_dims(int_list(rshape), expanded)
        if dims.count(-1) > 1 or len(dims) != 4:
            return 0
        want = [b, h * n, t, d]
        if -1 in dims:
            known = int(np.prod([v for v in dims if v != -1]))
            if known == 0 or (b * h * n * t * d) % known:
                return 0
            dims[dims.index(-1)] = (b * h * n * t * d) // known
        return n if dims == want else 0

    def run(self, inputs: list, rt) -> tuple:
        a, x, axes, eshape, rshape = inputs[:5]
        scale = inputs[5] if len(inputs) > 5 else None
        post = inputs[6] if len(inputs) > 6 else None
        if self._template:
            rshape = reshape_from_x(rshape, x)
        (y,) = self._product(a, x, axes, eshape, rshape, scale, rt)
        if post is None:
            return (y,)
        if post.size == 1 and post.ndim <= y.ndim and post.dtype == y.dtype and y.flags.writeable:  # y: its own result
            y *= post.reshape(())
            return (y,)
        return (np.multiply(y, post),)

    def _product(self, a, x, axes, eshape, rshape, scale, rt) -> tuple:
        n = self._is_repeat(x, axes, eshape, rshape)
        # Only a scalar K scale moves from K to the product (one per row of Kᵀ does not).
        scalar = scale is None or (scale.size == 1 and scale.ndim <= 4)
        if (
            n
            and scalar
            and a.ndim == 4
            and a.shape[0] == x.shape[0]
            and a.shape[1] == x.shape[1] * n
            and a.dtype == x.dtype
        ):
            b, h = x.shape[0], x.shape[1]
            s = a.shape[2]
            grouped = np.ascontiguousarray(a).reshape(b, h, n * s, a.shape[3])
            rhs = x.swapaxes(-1, -2) if self.transpose_b else x
            if grouped.shape[-1] != rhs.shape[-2]:
                raise ValueError(f"RepeatKvMatMul node '{self.name}': shapes {a.shape} and {x.shape} do not align")
            out = rt.empty(0, (b, h * n, s, rhs.shape[-1]), a.dtype)
            matmul(grouped, rhs, out=out.reshape(b, h, n * s, rhs.shape[-1]))
            if scale is not None:
                out *= scale.astype(out.dtype, copy=False)
            return (out,)
        # Literal evaluation of the original expression.
        rep = np.broadcast_to(
            np.expand_dims(x, tuple(int_list(axes))),
            np.broadcast_shapes(np.expand_dims(x, tuple(int_list(axes))).shape, tuple(int_list(eshape))),
        )
        rep = rep.reshape(_reshape_dims(int_list(rshape), rep.shape))
        if self.transpose_b:
            rep = rep.transpose(0, 1, 3, 2)
            if scale is not None:
                rep = rep * scale
        return (matmul(a, rep),)
