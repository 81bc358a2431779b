"""Shape and data-movement operators: Shape, Reshape, Transpose, (Un)Squeeze,
Flatten, Concat, Split, Slice, Gather, GatherND, GatherElements, Expand, Tile,
Range, Identity, Constant, ConstantOfShape, Size, Trilu, and
``ai.onnxkv::ShapeOf`` (a folded chain of shape operators).

Operators that can return a view of their data input declare
``view_inputs = (0,)``.  Axes given as inputs (opset ≥ 13) or attributes
(older opsets) are both accepted.  A Concat whose output is a KV-cache graph
output (``present.*``) counts its copies: the bytes of the past input as
``prefix_copied_bytes`` and the new tokens as ``append_copied_bytes``.
When a state binds that past to a persistent cache, the Concat becomes an
in-place append and its output a zero-copy view of the valid cache; in a
paged state a gathered copy, or a placeholder when every reader reads the
pages itself (:mod:`onnxkv.plan.ops._page_readers`).

Operators whose output size comes from input *values* (ConstantOfShape,
Expand, Tile, Range) check the size they are asked for before allocating:
a negative dim, a non-finite Range bound, or an output larger than
:data:`MAX_TENSOR_BYTES` is an :class:`~onnxkv.errors.InputError` naming the
node.  Gather, GatherElements and GatherND check every index against the
axis it indexes (``[-s, s - 1]``) and raise
:class:`~onnxkv.errors.OperatorError` naming the node otherwise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from math import prod

import numpy as np

from onnxkv._kernels._record import current as _recorder
from onnxkv._kernels.convert import concat_pair, copy_rows
from onnxkv._kernels.gather import gather_rows
from onnxkv.errors import InputError, OperatorError
from onnxkv.plan.ops._export_record import note_cache_rows, rows_appendable
from onnxkv.plan.ops._paged_record import note_page_rows
from onnxkv.plan.ops._util import int_list, normalize_axes, normalize_axis
from onnxkv.plan.registry import BuildContext, Op, register


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - no sysconf
        return 1 << 48


#: No tensor a shape operator is asked to make may be larger than this: the machine's physical memory.
MAX_TENSOR_BYTES = _physical_memory()


def _checked_shape(op: Op, shape: Sequence[int], itemsize: int, what: str) -> tuple[int, ...]:
    """``shape`` (Python ints) when it has no negative dim and fits :data:`MAX_TENSOR_BYTES`; InputError otherwise."""
    if any(d < 0 for d in shape):
        raise InputError(f"{op.op_type} node '{op.name}': {what} {list(shape)} has a negative dim")
    nbytes = prod(shape) * itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise InputError(
            f"{op.op_type} node '{op.name}': {what} {list(shape)} of {itemsize}-byte elements needs "
            f"{nbytes} bytes, more than this machine's memory ({MAX_TENSOR_BYTES} bytes)"
        )
    return tuple(shape)


def _check_indices(op: Op, idx: np.ndarray, dim: int, axis: int) -> None:
    """Every entry of ``idx`` in ``[-dim, dim - 1]`` (ONNX's range for an axis of size ``dim``), else OperatorError."""
    if idx.size and (idx.min() < -dim or idx.max() >= dim):
        raise OperatorError(
            f"{op.op_type} node '{op.name}': indices (input '{op.node.input[1]}') must be in "
            f"[{-dim}, {dim - 1}] for axis {axis} of size {dim}, got min {idx.min()}, max {idx.max()}"
        )


@register("Shape")
class Shape(Op):
    shape_only = True
    uses_blas = False

    def run(self, inputs: list, rt) -> tuple:
        shape = inputs[0].shape
        start = self.attrs.get("start", 0)
        end = self.attrs.get("end", None)
        return (np.array(shape[start:end] if end is not None else shape[start:], dtype=np.int64),)


@register("ShapeOf", domain="ai.onnxkv", internal=True)
class ShapeOf(Op):
    """An int64 value made of its inputs' dims and constants: what a chain of shape operators computed.

    Written by :meth:`onnxkv.plan.shape_fold.ShapeFolder.rewrite`.  Attributes
    ``sources`` and ``values`` (ints, one per element in row-major order):
    element ``i`` is ``inputs[sources[i]].shape[values[i]]``, or ``values[i]``
    itself when ``sources[i] == -1``; ``rank``: 1 (default) for a 1-D output,
    0 for a scalar (one element).  Only the inputs' shapes are read.
    """

    shape_only = True
    uses_blas = False

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        sources, values = list(self.attrs.get("sources", [])), list(self.attrs.get("values", []))
        rank = self.attrs.get("rank", 1)
        self._shape = (len(values),) if rank == 1 else ()
        if (
            len(sources) != len(values)
            or rank not in (0, 1)
            or (rank == 0 and len(values) != 1)
            or any(not -1 <= i < len(node.input) for i in sources)
        ):
            raise self.error(
                f"attributes sources {sources} / values {values} / rank {rank} "
                f"do not describe a value over {len(node.input)} input(s)"
            )
        self._recipe = tuple(zip(sources, values))

    def run(self, inputs: list, rt) -> tuple:
        return (
            np.array([inputs[i].shape[v] if i >= 0 else v for i, v in self._recipe], dtype=np.int64).reshape(
                self._shape
            ),
        )


@register("Size")
class Size(Op):
    def run(self, inputs: list, rt) -> tuple:
        return (np.array(inputs[0].size, dtype=np.int64),)


@register("Identity")
class Identity(Op):
    view_inputs = (0,)

    def run(self, inputs: list, rt) -> tuple:
        return (inputs[0],)


@register("Reshape")
class Reshape(Op):
    view_inputs = (0,)

    def run(self, inputs: list, rt) -> tuple:
        x, shape = inputs
        dims = int_list(shape)
        if not self.attrs.get("allowzero", 0):
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        try:
            return (x.reshape(dims),)
        except ValueError as e:
            raise ValueError(f"Reshape node '{self.name}': cannot reshape {x.shape} to {dims}") from e


@register("Flatten")
class Flatten(Op):
    view_inputs = (0,)

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        axis, rank = int(self.attrs.get("axis", 1)), x.ndim
        if not -rank <= axis <= rank:  # axis may be the rank itself (one row); a negative axis counts from the end
            raise OperatorError(
                f"Flatten node '{self.name}': axis {axis} must be in [{-rank}, {rank}] for an input of shape {x.shape}"
            )
        axis += rank if axis < 0 else 0
        lead = prod(x.shape[:axis])
        return (x.reshape(lead, -1) if x.size else x.reshape(lead, prod(x.shape[axis:])),)


@register("Transpose")
class Transpose(Op):
    """Transpose materialised contiguously (kernels downstream want C order): a view when the transposed
    array is C-contiguous already (only axes of extent 1 move, as a decode step's heads and tokens), else a
    copy."""

    view_inputs = (0,)

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        perm = self.attrs.get("perm") or list(range(x.ndim))[::-1]
        src = x.transpose(perm)
        if src.flags.c_contiguous:
            return (src,)
        out = rt.empty(0, src.shape, x.dtype)
        np.copyto(out, src)
        return (out,)


class _AxesOp(Op):
    """Base for ops taking axes as attribute (old opsets) or optional input 1."""

    def axes(self, inputs: list) -> list[int] | None:
        if len(inputs) > 1 and inputs[1] is not None:
            return int_list(inputs[1])
        return self.attrs.get("axes")


@register("Squeeze")
class Squeeze(_AxesOp):
    view_inputs = (0,)

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        axes = self.axes(inputs)
        if axes is None:
            return (x.reshape([d for d in x.shape if d != 1]),)
        axes = normalize_axes(axes, x.ndim, f"Squeeze '{self.name}'")
        for a in axes:
            if x.shape[a] != 1:
                raise ValueError(f"Squeeze node '{self.name}': dim {a} of shape {x.shape} is not 1")
        return (x.reshape([d for i, d in enumerate(x.shape) if i not in axes]),)


@register("Unsqueeze")
class Unsqueeze(_AxesOp):
    view_inputs = (0,)

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        axes = self.axes(inputs)
        rank = x.ndim + len(axes)
        axes = sorted(normalize_axes(axes, rank, f"Unsqueeze '{self.name}'"))
        shape = list(x.shape)
        for a in axes:
            shape.insert(a, 1)
        return (x.reshape(shape),)


@register("Concat")
class Concat(Op):
    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.axis = int(self.attrs["axis"])
        self.is_cache = node.output[0] in ctx.present_outputs
        self.bound_past = node.input[0] if ctx.bindings_for(node) else None
        #: Inputs a recorded call does not read: a cache append's past view (it writes the cache buffer
        #: directly); a ``concat_pair`` call reads both.
        self.replay_unread = (0,) if self.bound_past is not None else ()
        #: Every reader of the present reads the pages of a paged state's cache itself (an export's
        #: MaskedAttention; ``_page_readers.share_pages``): in a paged state the node then returns a placeholder
        #: instead of a gathered copy of the past.
        self.pages_read = False

    def compilable(self, inputs: list) -> bool:
        """A cache Concat bound to a state's past: its in-place append to a contiguous float32 cache is a
        call a compiled step replays (``run`` notes it; any other run refuses the recording); any other
        Concat that is not a cache's, of two C-contiguous arrays (:meth:`_pair_axis`): one ``concat_pair``
        call."""
        if self.bound_past is not None:
            return True
        return not self.is_cache and self._pair_axis(inputs) is not None

    def _pair_axis(self, inputs: list) -> int | None:
        """The axis (made non-negative) when ``inputs`` are two C-contiguous arrays of numbers of one dtype and
        rank, whose shapes differ at most there, with a non-empty result; else None."""
        if len(inputs) != 2 or not all(isinstance(x, np.ndarray) and x.flags.c_contiguous for x in inputs):
            return None
        a, b = inputs
        if a.dtype != b.dtype or a.dtype.kind not in "biuf" or a.ndim != b.ndim or not -a.ndim <= self.axis < a.ndim:
            return None
        axis = self.axis % a.ndim
        same = all(d == e for i, (d, e) in enumerate(zip(a.shape, b.shape)) if i != axis)
        return axis if same and a.size + b.size > 0 else None

    def run(self, inputs: list, rt) -> tuple:
        if self.bound_past is not None and rt.in_place(self.bound_past):
            # In place: append the new positions to the state's cache; readers get a view.
            past, new = inputs
            length = past.shape[2]
            present = rt.cache_write(
                self.bound_past, new, length, length + new.shape[2], materialize=not self.pages_read
            )
            rec = _recorder()
            if rec is not None:
                self._note(rec, rt, past, new)
            return (present,)
        if self.bound_past is not None:
            rec = _recorder()
            if rec is not None:
                rec.refused.append(f"Concat node '{self.name}': not bound to a state's cache in this run")
        pair = None if self.is_cache else self._pair_axis(inputs)
        if pair is not None:
            a, b = inputs
            shape = list(a.shape)
            shape[pair] += b.shape[pair]
            out = rt.empty(0, shape, a.dtype)
            concat_pair(a, b, out, pair)
            return (out,)
        xs = [x for x in inputs if x is not None]
        axis = normalize_axis(self.axis, xs[0].ndim, f"Concat '{self.name}'")
        shape = list(xs[0].shape)
        shape[axis] = sum(x.shape[axis] for x in xs)
        out = rt.empty(0, shape, xs[0].dtype)
        np.concatenate(xs, axis=axis, out=out)
        if self.is_cache and rt.recording:
            rt.count(prefix_copied_bytes=xs[0].nbytes, append_copied_bytes=sum(x.nbytes for x in xs[1:]))
        return (out,)

    def _note(self, rec, rt, past: np.ndarray, new: np.ndarray) -> None:
        """Note the append just made (a recording thread), or refuse the recording when a replay could not
        make it: a copy other than :func:`rows_appendable`'s, or an append at other than the committed length
        (into a paged cache whose readers read the pages: :func:`note_page_rows`'s conditions)."""
        cache = rt.caches[self.bound_past]
        if getattr(cache, "paged", False) and self.pages_read:
            note_page_rows(self, rec, rt, self.bound_past, new, past.shape[2])
            return
        if not rows_appendable(cache, new) or past.shape[2] != cache.length:
            rec.refused.append(f"Concat node '{self.name}': not a plain append to a contiguous cache")
            return
        note_cache_rows(rec, self.bound_past, new, cache)


@register("Split")
class Split(Op):
    view_inputs = (0,)

    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        axis = normalize_axis(self.attrs.get("axis", 0), x.ndim, f"Split '{self.name}'")
        if len(inputs) > 1 and inputs[1] is not None:
            sizes = int_list(inputs[1])
        elif "split" in self.attrs:
            sizes = list(self.attrs["split"])
        else:
            n = self.attrs.get("num_outputs", len(self.node.output))
            chunk = -(-x.shape[axis] // n)
            sizes = [min(chunk, x.shape[axis] - i * chunk) for i in range(n)]
        if sum(sizes) != x.shape[axis]:
            raise ValueError(f"Split node '{self.name}': sizes {sizes} do not sum to dim {x.shape[axis]}")
        bounds = np.cumsum([0] + sizes)
        index = [slice(None)] * x.ndim
        outs = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            index[axis] = slice(int(lo), int(hi))
            outs.append(x[tuple(index)])
        return outs


@register("Slice", since=10)
class Slice(Op):
    """``Slice`` as a view of its input.  In a compiled step's recording, when the recording allows it
    (``Recorder.pack_views``: every reader computes the same values from either layout), a view that is not
    C-contiguous and that :func:`~onnxkv._kernels.convert.row_layout` describes (rows of the input at one
    stride: a rotation's part of each head) is packed by ``copy_rows`` instead, a call the step replays."""

    view_inputs = (0,)

    def run(self, inputs: list, rt) -> tuple:
        x, starts, ends = inputs[0], int_list(inputs[1]), int_list(inputs[2])
        axes = int_list(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else list(range(len(starts)))
        steps = int_list(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
        index = [slice(None)] * x.ndim
        for s, e, a, st in zip(starts, ends, axes, steps):
            a = normalize_axis(a, x.ndim, f"Slice '{self.name}'")
            dim = x.shape[a]
            if st == 0:
                raise ValueError(f"Slice node '{self.name}': step 0 on axis {a}")
            # As ONNX defines it: negatives count from the end, then clamp to [0, dim] (step > 0) or
            # start to [0, dim - 1] and end to [-1, dim - 1] (step < 0, -1: past the first element).
            s, e = s + dim if s < 0 else s, e + dim if e < 0 else e
            if st > 0:
                index[a] = slice(min(max(s, 0), dim), min(max(e, 0), dim), st)
            elif dim == 0:
                index[a] = slice(0, 0)
            else:
                e = min(max(e, -1), dim - 1)
                index[a] = slice(min(max(s, 0), dim - 1), None if e < 0 else e, st)
        y = x[tuple(index)]
        rec = None if y.flags.c_contiguous else _recorder()
        if rec is not None and rec.pack_views:
            # a recording: a strided view of step memory would not be one at a fixed address, a packed copy is
            out = rt.empty(0, y.shape, y.dtype)
            if copy_rows(y, out):
                return (out,)
        return (y,)


@register("Gather")
class Gather(Op):
    """ONNX Gather.  Rows of a 2-D float32 table by int64 indices (an embedding lookup) go through the
    ``gather_rows`` kernel, which compiled steps replay (a float16 table's rows of an even width as the same
    bytes, two elements per float32 the kernel copies); everything else through NumPy."""

    def _rows(self, x, idx) -> bool:
        """True for the kernel's case: axis 0 of a C-contiguous float32 [N, D > 0] table (or float16 with an
        even D), C-contiguous int64 indices of rank <= 2, at least one."""
        return (
            isinstance(x, np.ndarray)
            and isinstance(idx, np.ndarray)
            and x.ndim == 2
            and self.attrs.get("axis", 0) in (0, -2)
            and (x.dtype == np.float32 or (x.dtype == np.float16 and x.shape[1] % 2 == 0))
            and x.shape[1] > 0
            and x.flags.c_contiguous
            and idx.dtype == np.int64
            and 0 < idx.size
            and idx.ndim <= 2
            and idx.flags.c_contiguous
        )

    def compilable(self, inputs: list) -> bool:
        return self._rows(*inputs)

    def run(self, inputs: list, rt) -> tuple:
        x, idx = inputs
        axis = normalize_axis(self.attrs.get("axis", 0), x.ndim, f"Gather '{self.name}'")
        _check_indices(self, idx, x.shape[axis], axis)
        if axis == 0 and idx.ndim <= 2 and x.ndim == 2:
            out = rt.empty(0, idx.shape + x.shape[1:], x.dtype)
            if self._rows(x, idx):
                rows = out.reshape(-1, x.shape[1])
                if x.dtype == np.float16:  # whole rows of bytes: the same copies on a float32 view
                    x, rows = x.view(np.float32), rows.view(np.float32)
                gather_rows(x, idx.reshape(-1), rows)
            else:
                np.take(x, idx, axis=0, out=out, mode="wrap")
            return (out,)
        return (np.take(x, idx, axis=axis),)


@register("GatherElements")
class GatherElements(Op):
    def run(self, inputs: list, rt) -> tuple:
        x, idx = inputs
        axis = normalize_axis(self.attrs.get("axis", 0), x.ndim, f"GatherElements '{self.name}'")
        if idx.ndim != x.ndim or any(i > d for a, (i, d) in enumerate(zip(idx.shape, x.shape)) if a != axis):
            raise OperatorError(
                f"GatherElements node '{self.name}': indices of shape {idx.shape} do not fit data "
                f"of shape {x.shape} (same rank, no larger on every axis but {axis})"
            )
        _check_indices(self, idx, x.shape[axis], axis)
        idx = np.where(idx < 0, idx + x.shape[axis], idx)
        # ONNX reads data[..., idx, ...] at the indices' own positions: no broadcast over the other axes.
        x = x[tuple(slice(None) if a == axis else slice(0, n) for a, n in enumerate(idx.shape))]
        return (np.take_along_axis(x, idx, axis=axis),)


@register("GatherND")
class GatherND(Op):
    def run(self, inputs: list, rt) -> tuple:
        x, idx = inputs
        b = self.attrs.get("batch_dims", 0)
        k = idx.shape[-1]
        if not 0 <= b < idx.ndim or b + k > x.ndim:
            raise OperatorError(
                f"GatherND node '{self.name}': indices of shape {idx.shape} with batch_dims {b} do "
                f"not index data of shape {x.shape}"
            )
        for j in range(k):
            _check_indices(self, idx[..., j], x.shape[b + j], b + j)
        idx = np.where(idx < 0, idx + np.array(x.shape[b : b + k]), idx)
        if b == 0:
            return (x[tuple(np.moveaxis(idx, -1, 0))],)
        batch_shape = x.shape[:b]
        nb = int(np.prod(batch_shape, dtype=np.int64))
        xb = x.reshape((nb,) + x.shape[b:])
        ib = idx.reshape((nb,) + idx.shape[b:])
        shape = idx.shape[:-1] + x.shape[b + k :]
        if nb == 0:  # an empty batch: nothing to stack
            return (np.empty(shape, x.dtype),)
        outs = [xb[i][tuple(np.moveaxis(ib[i], -1, 0))] for i in range(nb)]
        return (np.stack(outs).reshape(shape),)


@register("Expand")
class Expand(Op):
    def run(self, inputs: list, rt) -> tuple:
        x, shape = inputs
        wanted = _checked_shape(self, int_list(shape), x.dtype.itemsize, "shape")
        target = _checked_shape(self, np.broadcast_shapes(x.shape, wanted), x.dtype.itemsize, "output shape")
        out = rt.empty(0, target, x.dtype)
        np.copyto(out, x)
        return (out,)


@register("Tile")
class Tile(Op):
    def run(self, inputs: list, rt) -> tuple:
        x, repeats = inputs[0], int_list(inputs[1])
        if len(repeats) != x.ndim:
            raise InputError(
                f"Tile node '{self.name}': repeats {repeats} must have one entry per dim of the input "
                f"of shape {x.shape}"
            )
        if any(r < 0 for r in repeats):
            raise InputError(f"Tile node '{self.name}': repeats {repeats} has a negative entry")
        _checked_shape(self, [d * r for d, r in zip(x.shape, repeats)], x.dtype.itemsize, "output shape")
        return (np.tile(x, repeats),)


@register("Range")
class Range(Op):
    def run(self, inputs: list, rt) -> tuple:
        start, limit, delta = (np.asarray(v).reshape(()) for v in inputs)
        a, b, d = (v.item() for v in (start, limit, delta))
        if not all(math.isfinite(v) for v in (a, b, d)) or d == 0:
            raise InputError(
                f"Range node '{self.name}': start {a}, limit {b}, delta {d} must be finite with a non-zero delta"
            )
        count = -((a - b) // d) if all(isinstance(v, int) for v in (a, b, d)) else math.ceil((b - a) / d)
        _checked_shape(self, [max(count, 0)], start.dtype.itemsize, "output shape")
        if start.dtype.kind in "iu":  # start + delta * i wraps where np.arange overflows near the dtype's limits
            steps = np.arange(max(count, 0), dtype=start.dtype)
            with np.errstate(over="ignore"):
                return ((start + delta * steps).astype(start.dtype, copy=False),)
        # the spec's start + i * delta, each element in the input type (np.arange's fill accumulates its error)
        return ((start + np.arange(max(count, 0), dtype=start.dtype) * delta).astype(start.dtype, copy=False),)


@register("Constant")
class Constant(Op):
    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        a = self.attrs
        if "value" in a:
            v = a["value"]
        elif "value_float" in a:
            v = np.array(a["value_float"], dtype=np.float32)
        elif "value_floats" in a:
            v = np.array(a["value_floats"], dtype=np.float32)
        elif "value_int" in a:
            v = np.array(a["value_int"], dtype=np.int64)
        elif "value_ints" in a:
            v = np.array(a["value_ints"], dtype=np.int64)
        elif "value_string" in a or "value_strings" in a:
            v = np.array(a.get("value_string", a.get("value_strings")), dtype=object)
        else:
            raise self.error(f"unsupported Constant attributes {sorted(a)}")
        self.value = np.asarray(v)

    def run(self, inputs: list, rt) -> tuple:
        return (self.value,)


@register("ConstantOfShape")
class ConstantOfShape(Op):
    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        v = self.attrs.get("value")
        self.value = np.zeros(1, np.float32) if v is None else np.asarray(v).reshape(-1)

    def run(self, inputs: list, rt) -> tuple:
        shape = _checked_shape(self, int_list(inputs[0]), self.value.dtype.itemsize, "shape")
        out = rt.empty(0, shape, self.value.dtype)
        out.fill(self.value[0])
        return (out,)


@register("Trilu")
class Trilu(Op):
    def run(self, inputs: list, rt) -> tuple:
        x = inputs[0]
        k = int(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else 0
        return ((np.triu if self.attrs.get("upper", 1) else np.tril)(x, k),)
