"""Rotary position embedding: ``com.microsoft::RotaryEmbedding`` and ONNX ``RotaryEmbedding`` (23).

:func:`rotate` is the shared arithmetic, also used by ``GroupQueryAttention``
(``do_rotary=1``).  It works on a ``[B, S, H, D]`` float32 view and rotates the
first ``rot = 2 * cos.shape[-1]`` channels of every head; the remaining channels
are copied unchanged.

* non-interleaved (GPT-NeoX): pairs are ``(x[i], x[i + rot/2])``;
* interleaved (GPT-J): pairs are ``(x[2i], x[2i + 1])``;

and each pair becomes ``(x1*cos - x2*sin, x1*sin + x2*cos)`` with ``cos``/``sin``
gathered at the token's position.  The compiled kernel
``onnxkv._kernels.rotary_embedding`` does the work for float32 inputs with
2-D caches; NumPy does the rest (float16/bfloat16, per-token 3-D caches).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from onnxkv._kernels import rotary_embedding as _rotary_kernel
from onnxkv.errors import InputError
from onnxkv.plan.context import RunContext
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["RotaryEmbedding23", "RotaryEmbeddingMS", "rotate"]


def rotate(
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    positions: np.ndarray | None,
    interleaved: bool,
    out: np.ndarray,
) -> np.ndarray:
    """Rotate ``x`` [B, S, H, D] into ``out`` (same shape, may not alias ``x``).

    ``cos``/``sin`` are ``[max_pos, rot/2]`` gathered with ``positions`` [B, S]
    (int64, already range-checked), or ``[B, S, rot/2]`` when ``positions`` is
    None.  Returns ``out``.
    """
    half = cos.shape[-1]
    rot = 2 * half
    if positions is not None and x.dtype == np.float32 and cos.dtype == np.float32 and sin.dtype == np.float32:
        dst = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
        _rotary_kernel(
            np.ascontiguousarray(x),
            np.ascontiguousarray(cos),
            np.ascontiguousarray(sin),
            np.ascontiguousarray(positions, dtype=np.int64),
            bool(interleaved),
            dst,
        )
        if dst is not out:
            out[...] = dst
        return out
    if positions is not None:
        c = cos[positions][:, :, None, :]  # [B, S, 1, half]
        s = sin[positions][:, :, None, :]
    else:
        c = cos[:, :, None, :]
        s = sin[:, :, None, :]
    if interleaved:
        x1 = x[..., 0:rot:2]
        x2 = x[..., 1:rot:2]
        out[..., 0:rot:2] = x1 * c - x2 * s
        out[..., 1:rot:2] = x1 * s + x2 * c
    else:
        x1 = x[..., :half]
        x2 = x[..., half:rot]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:rot] = x1 * s + x2 * c
    out[..., rot:] = x[..., rot:]
    return out


def check_positions(op: Op, positions: np.ndarray, max_pos: int) -> None:
    """Raise InputError naming ``op`` if a position is outside ``[0, max_pos)``."""
    if positions.size and (positions.min() < 0 or positions.max() >= max_pos):
        raise InputError(
            f"{op.op_type} node '{op.name}': position ids must lie in [0, {max_pos}) "
            f"(cos_cache rows), got range [{positions.min()}, {positions.max()}]"
        )


class _RotaryBase(Op):
    """Shared attribute parsing and layout handling of both RotaryEmbedding ops.

    ``infer_heads``: a 3-D input without ``num_heads`` takes its head size
    from the cos cache (``com.microsoft``) instead of being rejected (ONNX).
    """

    infer_heads = False

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.interleaved = bool(self.attrs.get("interleaved", 0))
        self.rotary_dim = int(self.attrs.get("rotary_embedding_dim", 0))
        self.num_heads = int(self.attrs.get("num_heads", 0))
        if self.rotary_dim < 0 or self.rotary_dim % 2:
            raise self.error(f"rotary_embedding_dim must be a non-negative even number, got {self.rotary_dim}")
        if self.num_heads < 0:
            raise self.error(f"num_heads must be non-negative, got {self.num_heads}")

    def _input_error(self, message: str) -> InputError:
        return InputError(f"{self.op_type} node '{self.name}': {message}")

    def _to_bshd(self, x: np.ndarray, cos: np.ndarray) -> np.ndarray:
        """View of ``x`` as [B, S, H, D] (4-D inputs are [B, H, S, D]).

        A 3-D input is split into ``num_heads`` heads; without ``num_heads``
        (``com.microsoft`` only) the head size is ``2 * cos.shape[-1]``.
        """
        if x.ndim == 4:
            return x.transpose(0, 2, 1, 3)
        if x.ndim == 3:
            hidden = x.shape[2]
            if self.num_heads:
                heads = self.num_heads
            elif self.infer_heads and cos.shape[-1] and hidden % (2 * cos.shape[-1]) == 0:
                heads = hidden // (2 * cos.shape[-1])
            else:
                raise self._input_error(f"num_heads is required to split a 3-D input of shape {x.shape}")
            if hidden % heads:
                raise self._input_error(f"hidden size {hidden} of the 3-D input is not a multiple of num_heads={heads}")
            return x.reshape(x.shape[0], x.shape[1], heads, hidden // heads)
        raise self._input_error(f"input must be 3-D or 4-D, got shape {x.shape}")

    def _apply(
        self,
        x: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        positions: np.ndarray | None,
        rt: RunContext,
    ) -> np.ndarray:
        if x.dtype != cos.dtype or x.dtype != sin.dtype:
            raise self._input_error(
                f"input, cos_cache and sin_cache must share a dtype, got {x.dtype}, {cos.dtype}, {sin.dtype}"
            )
        xb = self._to_bshd(x, cos)
        head = xb.shape[3]
        rot = self.rotary_dim or head
        if rot > head or rot % 2:
            raise self._input_error(f"rotary dimension {rot} must be even and at most head_size={head}")
        if cos.shape != sin.shape or cos.shape[-1] != rot // 2:
            raise self._input_error(
                f"cos_cache/sin_cache must have equal shapes ending in rotary_dim/2={rot // 2}, "
                f"got {cos.shape} and {sin.shape}"
            )
        if positions is not None:
            if cos.ndim != 2:
                raise self._input_error(f"cos_cache must be 2-D with position_ids, got shape {cos.shape}")
            check_positions(self, positions, cos.shape[0])
        elif cos.shape[:2] != xb.shape[:2] or cos.ndim != 3:
            raise self._input_error(
                f"without position_ids cos_cache must be [batch, seq, rot/2]={xb.shape[:2]}+({rot // 2},), "
                f"got {cos.shape}"
            )
        out = rt.empty(0, x.shape, x.dtype)
        rotate(xb, cos, sin, positions, self.interleaved, self._to_bshd(out, cos))
        return out


@register("RotaryEmbedding", domain="com.microsoft")
class RotaryEmbeddingMS(_RotaryBase):
    """``com.microsoft::RotaryEmbedding`` with ONNX Runtime CPU semantics.

    Inputs: ``input`` [B, S, hidden] or [B, N, S, H]; ``position_ids`` int64,
    either shape [1] (positions ``position_ids[0] + s`` for every row) or
    [B, S]; ``cos_cache``/``sin_cache`` [max_pos, rot/2].  Output: same shape
    and dtype as the input.  ``is_packed_batching=1`` is rejected; ``scale`` is
    ignored as ONNX Runtime's CPU kernel does.
    """

    infer_heads = True

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        if int(self.attrs.get("is_packed_batching", 0)):
            raise self.error("is_packed_batching=1 (ragged batches) is not supported")
        if self.rotary_dim and not self.num_heads:
            raise self.error("num_heads must be given together with rotary_embedding_dim")

    def run(self, inputs: list, rt: RunContext) -> Sequence[np.ndarray]:
        x, pos, cos, sin = inputs[:4]
        xb_shape = self._to_bshd(x, cos).shape
        pos = np.asarray(pos, dtype=np.int64)
        if pos.size == 1 and pos.ndim <= 1:
            positions = pos.reshape(()) + np.broadcast_to(np.arange(xb_shape[1], dtype=np.int64), xb_shape[:2])
        elif pos.shape == xb_shape[:2]:
            positions = pos
        else:
            raise self._input_error(f"position_ids must have shape [1] or {xb_shape[:2]}, got {pos.shape}")
        return (self._apply(x, cos, sin, positions, rt),)


@register("RotaryEmbedding", since=23)
class RotaryEmbedding23(_RotaryBase):
    """ONNX ``RotaryEmbedding`` (opset 23).

    Inputs: ``X`` [B, N, S, H] or [B, S, hidden] (``num_heads`` required);
    ``cos_cache``/``sin_cache`` [max_pos, rot/2] with ``position_ids`` [B, S]
    int64, or [B, S, rot/2] without.  ``rotary_embedding_dim=0`` rotates the
    whole head.  Output: same shape and dtype as ``X``.
    """

    def run(self, inputs: list, rt: RunContext) -> Sequence[np.ndarray]:
        x, cos, sin = inputs[:3]
        pos = inputs[3] if len(inputs) > 3 else None
        if pos is not None:
            pos = np.asarray(pos, dtype=np.int64)
            if pos.shape != self._to_bshd(x, cos).shape[:2]:
                raise self._input_error(f"position_ids must have shape [batch, seq], got {pos.shape}")
        return (self._apply(x, cos, sin, pos, rt),)
