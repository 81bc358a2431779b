"""``com.microsoft::GatherBlockQuantized``: a Gather over a block-quantized table, dequantized row by row.

``GatherBlockQuantized(data, indices, scales, zero_points?) -> output``, as
ONNX Runtime's contrib operator defines it (the GenAI model builder emits it
for int4 embeddings, and for tied int4 embeddings over the LM head's
``MatMulNBits`` weight reshaped to ``[vocab, hidden_padded * bits / 8]``):

* ``data``: ``uint8`` holding ``bits`` (attribute, 4 or 8) per element, packed
  along the last axis low nibble first, with ``gather_axis`` 0 and
  ``quantize_axis`` the last axis (its logical length is ``8 / bits`` times
  the stored one); or ``int4`` / ``uint4`` (``bits`` 4) with any two axes.
* ``indices`` int32/int64 of any shape: values in ``[-s, s - 1]`` along the
  gather axis of size ``s``, negative ones counting from the end.  ONNX
  Runtime writes zeros for an index outside that range; onnxkv refuses it
  (:class:`~onnxkv.errors.InputError` naming the node, the value and the
  range), checked in the indices' own width before any is used.
* ``scales`` float32/float16, same rank as ``data``: the logical dims, except
  ``ceil(dim / block_size)`` along ``quantize_axis``.  The output has the
  scales' type and shape ``data[:gather_axis] + indices + data[gather_axis+1:]``
  (logical dims).
* ``zero_points`` (optional): ``data``'s type and the scales' shape, except
  for packed ``uint8`` (bits 4), two per byte along the last axis
  (``ceil(blocks / 2)``).  Absent: 0 for int4/uint4, ``2^(bits-1)`` for uint8.
* ``output = float(q - zero_point) * scale`` per element, computed in float32
  and cast to the scales' type (ONNX Runtime's arithmetic).
* Attributes ``gather_axis`` (default 0), ``quantize_axis`` (default 1),
  ``block_size`` (default 128, a power of two >= 16), ``bits`` (default 4).
  Anything else (2-bit or float8/float4 data, bfloat16 scales) is a
  :class:`~onnxkv.errors.ModelError` naming the node.

Memory: when ``data``, ``scales`` and ``zero_points`` are constants they are
checked once, when the kernel is built, and held packed (int4/uint4 tables
are repacked two per byte; the plan's own copies are dropped).  A call
unpacks and dequantizes only the gathered slices, whose bytes it counts as
``dequantized_bytes`` in the event log.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxkv.errors import InputError, ModelError
from onnxkv.plan.ops._util import normalize_axis
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["GatherBlockQuantized"]

_INT4 = np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.INT4))
_UINT4 = np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.UINT4))
_SCALE_TYPES = (np.dtype(np.float32), np.dtype(np.float16))
_INDEX_TYPES = (np.dtype(np.int32), np.dtype(np.int64))


@dataclass(frozen=True)
class _Packed:
    """Quantized integers of a logical tensor, stored so that slices along one axis are whole bytes.

    ``array`` is uint8 ``[M, G, ..., L]`` with ``G`` the gathered axis and
    ``M`` the product of the axes before it.  ``per_byte`` 2: two ``bits``-4
    elements per byte of the last axis, low nibble first, ``count`` of them
    per slice (the rest is padding); ``per_byte`` 1: one element per byte (a
    4-bit one in the low nibble).  ``signed`` 4-bit values are
    sign-extended.  ``shape`` is the logical shape.
    """

    array: np.ndarray
    per_byte: int
    count: int
    bits: int
    signed: bool
    shape: tuple[int, ...]

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The logical slices ``rows`` (int64, normalised) of the gathered axis: int16 ``[M, len(rows), ...]``."""
        b = np.take(self.array, rows, axis=1)
        if self.per_byte == 2:
            b = np.stack((b & 15, b >> 4), axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))[..., : self.count]
        elif self.bits == 4:
            b &= 15
        v = b.astype(np.int16)
        if self.signed:
            v ^= 8
            v -= 8
        return v


def _int4(values: np.ndarray, axis: int, pack: bool) -> _Packed:
    """int4/uint4 ``values`` (ml_dtypes: one per byte, the nibble in the low bits) for slicing along ``axis``.

    ``pack``: two per byte along each slice (a copy of half the size, for
    constants); otherwise the values' own bytes (no copy).
    """
    shape, signed = values.shape, values.dtype == _INT4
    m, g, rest = prod(shape[:axis]), shape[axis], prod(shape[axis + 1 :])
    if not pack:
        return _Packed(values.view(np.uint8).reshape(m, g, rest), 1, rest, 4, signed, shape)
    nib = values.view(np.uint8).reshape(m, g, rest) & 15
    if rest % 2:
        nib = np.concatenate([nib, np.zeros((m, g, 1), np.uint8)], axis=2)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    packed.flags.writeable = False
    return _Packed(packed, 2, rest, 4, signed, shape)


def _uint8(stored: np.ndarray, bits: int, count: int, shape: tuple[int, ...]) -> _Packed:
    """uint8 ``stored`` (gathered along axis 0, ``8 // bits`` elements per byte along the last axis)."""
    return _Packed(stored.reshape((1,) + stored.shape), 8 // bits, count, bits, False, shape)


@dataclass(frozen=True)
class _Table:
    """A checked (data, scales, zero_points) triple, ready to gather from along ``axes`` (gather, quantize)."""

    data: _Packed
    scales: np.ndarray
    zero_points: _Packed | None
    default_zero_point: int
    axes: tuple[int, int]


@register("GatherBlockQuantized", domain="com.microsoft")
class GatherBlockQuantized(Op):
    """See the module docstring.

    Attributes:
        table: the checked, packed constant inputs (None when ``data``,
            ``scales`` or ``zero_points`` is computed while running; they are
            then checked at every call).
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        a = self.attrs
        self.block_size = a.get("block_size", 128)
        self.bits = a.get("bits", 4)
        self._gather_axis = a.get("gather_axis", 0)
        self._quantize_axis = a.get("quantize_axis", 1)
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise self.error(f"attribute block_size is {self.block_size}; expected a power of two >= 16")
        if self.bits not in (4, 8):
            raise self.error(f"attribute bits is {self.bits}; onnxkv supports 4 and 8")
        if len(node.input) not in (3, 4) or not all(node.input[:3]):
            raise self.error(f"has inputs {list(node.input)}; expected data, indices, scales and optional zero_points")
        positions = [p for p in (0, 2, 3) if p < len(node.input) and node.input[p]]
        consts = [ctx.constant(node.input[p]) for p in positions]
        self.table: _Table | None = None
        if all(c is not None for c in consts):
            self.table = self._prepare(consts[0], consts[1], consts[2] if len(consts) > 2 else None, pack=True)
            self.absorbed_inputs = tuple(positions)

    # -- checks ---------------------------------------------------------
    def _axes(self, rank: int) -> tuple[int, int]:
        what = f"{self.op_type} node '{self.name}'"
        try:
            return (
                normalize_axis(self._gather_axis, rank, f"{what}: gather_axis"),
                normalize_axis(self._quantize_axis, rank, f"{what}: quantize_axis"),
            )
        except ValueError as e:
            raise ModelError(str(e)) from None

    def _prepare(self, data: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, pack: bool) -> _Table:
        """Check ``data``, ``scales`` and ``zero_points`` against each other and the attributes.

        ``pack``: repack int4/uint4 tensors two per byte (constants, done
        once); otherwise their own bytes are read.
        """
        bits, bs = self.bits, self.block_size
        g, q = self._axes(data.ndim)
        if data.dtype == np.uint8:
            if g != 0 or q != data.ndim - 1 or g == q:
                raise self.error(
                    f"uint8 data of shape {list(data.shape)} needs gather_axis 0 and quantize_axis "
                    f"the last axis, different axes; got {g} and {q}"
                )
            shape = data.shape[:-1] + (data.shape[-1] * (8 // bits),)
            values = _uint8(data, bits, shape[-1], shape)
            default_zp = 1 << (bits - 1)
        elif data.dtype in (_INT4, _UINT4):
            if bits != 4:
                raise self.error(f"{data.dtype} data needs bits 4, got {bits}")
            shape = data.shape
            values = _int4(data, g, pack)
            default_zp = 0
        else:
            raise self.error(f"data has element type {data.dtype}; expected uint8, int4 or uint4")
        if scales.dtype not in _SCALE_TYPES:
            raise self.error(f"scales have element type {scales.dtype}; expected float32 or float16")
        want = shape[:q] + (-(-shape[q] // bs),) + shape[q + 1 :]
        if scales.shape != want:
            raise self.error(
                f"scales have shape {list(scales.shape)}; data of logical shape {list(shape)} with "
                f"block_size {bs} along axis {q} needs {list(want)}"
            )
        if zp is None:
            return _Table(values, scales, None, default_zp, (g, q))
        if zp.dtype != data.dtype:
            raise self.error(f"zero_points have element type {zp.dtype}; expected {data.dtype}, the data's")
        if data.dtype == np.uint8:
            stored = want[:-1] + (-(-want[-1] // (8 // bits)),)
            if zp.shape != stored:
                raise self.error(
                    f"zero_points have shape {list(zp.shape)}; scales of shape {list(want)} need "
                    f"{list(stored)} ({8 // bits} per byte along the last axis)"
                )
            return _Table(values, scales, _uint8(zp, bits, want[-1], want), default_zp, (g, q))
        if zp.shape != want:
            raise self.error(f"zero_points have shape {list(zp.shape)}; expected {list(want)}, the scales'")
        return _Table(values, scales, _int4(zp, g, pack), default_zp, (g, q))

    def _indices(self, idx: np.ndarray, size: int, axis: int) -> np.ndarray:
        """``idx`` checked against ``[-size, size - 1]`` in its own width, as normalised int64 (flattened)."""
        if idx.dtype not in _INDEX_TYPES:
            raise InputError(
                f"{self.op_type} node '{self.name}': indices (input '{self.node.input[1]}') have "
                f"element type {idx.dtype}; expected int32 or int64"
            )
        if idx.size:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < -size or hi >= size:
                raise InputError(
                    f"{self.op_type} node '{self.name}': index {lo if lo < -size else hi} (input "
                    f"'{self.node.input[1]}') is out of range: gather_axis {axis} has size {size}, "
                    f"indices must lie in [{-size}, {size - 1}]"
                )
        flat = idx.reshape(-1).astype(np.int64)
        if idx.size and lo < 0:
            flat[flat < 0] += size
        return flat

    # -- run --------------------------------------------------------------
    def run(self, inputs: list, rt) -> tuple:
        t = self.table
        if t is None:
            t = self._prepare(inputs[0], inputs[2], inputs[3] if len(inputs) > 3 else None, pack=False)
        idx = inputs[1]
        shape = t.data.shape
        g, q = t.axes
        rows = self._indices(idx, shape[g], g)
        out_shape = shape[:g] + idx.shape + shape[g + 1 :]
        # Scale and zero-point rows: the gathered rows, or their blocks when both axes are the same one.
        srows = rows // self.block_size if q == g else rows
        gathered = t.scales.shape[:g] + idx.shape + t.scales.shape[g + 1 :]
        scale = self._expand(np.take(t.scales, srows, axis=g).reshape(gathered), q, g, idx.ndim, shape[q])
        values = t.data.take(rows).reshape(out_shape)
        if t.zero_points is None:
            values -= t.default_zero_point
        else:
            values -= self._expand(t.zero_points.take(srows).reshape(gathered), q, g, idx.ndim, shape[q])
        out = rt.empty(0, out_shape, t.scales.dtype)
        np.multiply(values, scale, out=out, dtype=np.float32, casting="unsafe")
        rt.count(dequantized_bytes=out.nbytes)
        return (out,)

    def _expand(self, per_block: np.ndarray, q: int, g: int, idx_rank: int, length: int) -> np.ndarray:
        """``per_block`` (gathered, one entry per block along the quantize axis) repeated to one per element."""
        if q == g:
            return per_block
        axis = q if q < g else q + idx_rank - 1
        full = np.repeat(per_block, self.block_size, axis=axis)
        return full[(slice(None),) * axis + (slice(0, length),)]
