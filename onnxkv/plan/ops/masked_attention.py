"""``ai.onnxkv::MaskedAttention``: eager attention with an additive mask, on the streaming kernel.

Made by :func:`onnxkv.plan.fusion.fuse_masked_attention` from the attention
block of eager exports, ``Y = softmax(scale * Q·Kᵀ + mask) · V`` (with the
repeat_kv of grouped-query attention, the scale on K and/or on the scores and
an optional NaN guard after the softmax).  Inputs, by position
(:data:`~onnxkv.plan.fusion.MASKED_ATTENTION_INPUTS`; absent = empty name):

=====  ===========================  ===============================================
0      ``q``                        [B, Hq, S, D]
1, 2   ``k``, ``v``                 [B, Hkv, T, D] and [B, Hkv, T, Dv]; in a state,
                                    zero-copy views of the in-place caches
3      ``mask``                     additive, broadcastable to [B, Hq, S, T]
4-6    ``k_axes/expand/reshape``    the Unsqueeze/Expand/Reshape of K's repeat_kv
7-9    ``v_axes/expand/reshape``    the same for V
10     ``k_scale``                  multiplies Kᵀ
11     ``score_scale``              multiplies (``score_div=1``: divides) Q·Kᵀ
12     ``q_scale``                  multiplies Q (absorbed query scaling)
13, 14 ``softcap_div/mul``          Gemma 2's ``c * tanh(scores / c)`` (the kernel's softcap
                                    when both are the same positive constant)
15...  anything else the block reads (e.g. the NaN guard's fill value)
=====  ===========================  ===============================================

Output: Y [B, Hq, S, Dv], float32 on the kernel path (float16 for a float16 block).  The ``body`` attribute
holds the replaced nodes (a graph over the same input names).  Attribute
``reshape_from_x`` (:data:`~onnxkv.plan.fusion.RESHAPE_FROM_X`, set by shape
folding) lists the reshape inputs (6, 9) that are templates over K's / V's
shape: the exact targets are rebuilt from it before anything else runs.

The compiled streaming kernel (:func:`onnxkv._kernels.attention`: K/V read
once per KV head for its whole query group, never repeated, gathered or
copied) runs when, checked on every call:

* ``q`` is float32, K and V float32 or float16 of one shape with ``Dv == D``
  (or all three float16: a float16 export's block, whose ``q`` the kernel
  reads widened and whose Y it rounds once to float16, as ONNX Runtime's
  fused float16 attention computes it -- the literal chain rounds the
  scores, the probabilities and the products);
* both repeats describe the same head repeat ``n`` with ``Hq = n * Hkv`` (or
  neither is present and ``Hq == Hkv``); the scales are scalars;
* the Softmax is over the last axis, and every Cast of the probabilities
  (transformers' ``softmax(..., dtype=float32).to(query.dtype)``) is to ``q``'s
  type, an identity;
* the mask is float32, one value per (batch, query, key) for all heads, every
  entry is 0 (visible) or ``<= -1e30`` (masked: float32 min, ``-inf``) --
  a float16 mask: 0 or ``<= -65504`` (float16's lowest, as the converter
  writes float32 min, or ``-inf``), see below --, and
  each query row's visible keys form one range ``[lo_b, hi]`` whose start is
  shared by all rows of batch row ``b``: left padding plus a causal (or any
  per-row) end, i.e. the kernel's ``kv_start[b] = lo_b`` and ``q_pos[b, s] = hi``
  (see :func:`mask_ranges`).

A masked score is ``s + m`` with ``m <= -1e30``, whose exponential is exactly 0
next to any visible score, so the kernel's result equals the expression up to
float rounding.  A float16 mask's finite ``-65504`` hides a key only while the
scores are far smaller than that: the kernel runs only when
:func:`hidden_scores_vanish` bounds every hidden score (``|scale| * |q| *
|k|``) far enough below the visible ones, else the body runs literally.  Rows with no visible key (left-padding rows of a prefill) are
evaluated literally, which keeps the unfused operators' answer for them
(uniform weights under a finite mask; under ``-inf``, whatever the Softmax
and the NaN guard, if any, make of it).  When
any other condition fails, the whole body is evaluated literally, node by node
with the registered kernels.
"""

from __future__ import annotations

import threading

import numpy as np
import onnx

from onnxkv._kernels import attention as _attention_kernel
from onnxkv._kernels._record import current as _recorder
from onnxkv.errors import InputError
from onnxkv.plan.context import RunContext
from onnxkv.plan.fusion import MASKED_ATTENTION_INPUTS, REPEAT_KV_INPUTS, RESHAPE_FROM_X, reshape_from_x
from onnxkv.plan.ops._attention_math import paged_causal_attention
from onnxkv.plan.ops._body import Body
from onnxkv.plan.ops._export_record import bound_cache_name, note_masked_decode, replayable_mask
from onnxkv.plan.ops._page_readers import page_pasts, paged_state, read_pages
from onnxkv.plan.ops._paged_record import note_masked_paged
from onnxkv.plan.ops._util import LayoutMemo, int_list, round_into, widened
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = [
    "MaskedAttention",
    "mask_ranges",
    "visible_ranges",
    "cached_mask_ranges",
    "hidden_scores_vanish",
    "MASKED",
    "MASKED_F16",
]

#: Additive mask values at or below this hide a key (float32 min and -inf included).
MASKED = -1e30
#: float16 masks hide a key with float16's lowest finite value (an export's ``finfo(float16).min``) or
#: -inf.  A finite one hides a key only while the scores are far smaller (:func:`hidden_scores_vanish`).
MASKED_F16 = float(np.finfo(np.float16).min)
_FLOORS = {np.dtype(np.float32): MASKED, np.dtype(np.float16): MASKED_F16}
#: :func:`hidden_scores_vanish`'s bound on twice the largest score magnitude: a hidden score is then more
#: than 5504 below the row's largest, whose exponential is 0 in float32 and float16.
_F16_SCORE_SPAN = 60000.0

_Q, _K, _V, _MASK, _K_SCALE, _SCORE_SCALE, _Q_SCALE, _SOFTCAP_DIV, _SOFTCAP_MUL = (
    MASKED_ATTENTION_INPUTS.index(r)
    for r in ("q", "k", "v", "mask", "k_scale", "score_scale", "q_scale", "softcap_div", "softcap_mul")
)
_K_REPEAT = slice(MASKED_ATTENTION_INPUTS.index("k_axes"), MASKED_ATTENTION_INPUTS.index("k_reshape") + 1)
_V_REPEAT = slice(MASKED_ATTENTION_INPUTS.index("v_axes"), MASKED_ATTENTION_INPUTS.index("v_reshape") + 1)


def mask_ranges(mask: np.ndarray, b: int, s: int, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The kernel's description of an additive ``mask`` over scores [b, H, s, t], or None.

    Returns :func:`visible_ranges` of the mask's zeros.  None unless ``mask``
    is float32 (or float16), broadcasts to [b, 1, s, t] without growing the scores (its
    head axis is 1), every entry is 0 or ``<= MASKED`` (float16: ``<= MASKED_F16``), and the zeros pass
    :func:`visible_ranges`.  ``t >= 1``.
    """
    floor = _FLOORS.get(mask.dtype)
    if floor is None or mask.ndim > 4:
        return None
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    mb, mh, ms, mt = m.shape
    if mh != 1 or mb not in (1, b) or ms not in (1, s) or mt not in (1, t):
        return None
    m = m[:, 0]
    visible = m == 0
    if not (visible | (m <= floor)).all():
        return None
    return visible_ranges(np.broadcast_to(visible, (mb, ms, t)), b, s)


def visible_ranges(visible: np.ndarray, b: int, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The kernel's description of which keys each query sees, or None.

    ``visible``: bool [mb, ms, t] with ``mb`` 1 or ``b`` and ``ms`` 1 or
    ``s`` (broadcast over batch rows / queries), True where query ``(i, j)``
    sees key ``k``.  Returns ``(kv_start, q_pos, empty)``: int32 [b], int32
    [b, s] and bool [b, s] such that query ``(i, j)`` sees exactly the keys
    ``kv_start[i] <= key <= q_pos[i, j]`` (``empty[i, j]``: none; then
    ``q_pos = kv_start - 1``).  None unless each query's visible keys are
    contiguous and the non-empty queries of one batch row start at the same
    key.  O(mb * ms * t).
    """
    mb, ms, t = visible.shape
    count = np.count_nonzero(visible, axis=-1)
    first = visible.argmax(axis=-1)
    last = t - 1 - visible[..., ::-1].argmax(axis=-1)
    filled = count > 0
    if (filled & (count != last - first + 1)).any():
        return None  # a hole inside a row
    start = np.where(filled, first, t).min(axis=-1)
    if (filled & (first != start[:, None])).any():
        return None  # rows of one batch row starting at different keys
    start = np.where(start == t, 0, start)
    q_pos = np.where(filled, last, start[:, None] - 1)
    return (
        np.ascontiguousarray(np.broadcast_to(start, (b,)), dtype=np.int32),
        np.ascontiguousarray(np.broadcast_to(q_pos, (b, s)), dtype=np.int32),
        np.broadcast_to(~filled, (b, s)),
    )


#: Per thread: the last mask that mask_ranges described (key, copy of the mask, result).
_LAST_MASK = threading.local()


def cached_mask_ranges(mask: np.ndarray, b: int, s: int, t: int, describe=None):
    """``describe(mask, b, s, t)`` (default :func:`mask_ranges`), reusing the result of the previous call on
    this thread when ``mask`` holds the same values (same shape, dtype and elements; ``b``, ``s``, ``t`` and
    ``describe`` equal).

    Exports build one additive mask per run and every layer's attention reads
    it, so the layers after the first compare the mask (one pass over it)
    instead of describing it again (about twenty passes).  The cache keeps a
    copy of the mask it described, so a buffer the plan reuses for another
    value can never be mistaken for it.  The returned arrays are shared
    between calls and must not be written.
    """
    describe = describe or mask_ranges
    key = (describe, mask.shape, mask.dtype, b, s, t)
    last = getattr(_LAST_MASK, "entry", None)
    if last is not None and last[0] == key and np.array_equal(last[1], mask):
        return last[2]
    ranges = describe(mask, b, s, t)
    _LAST_MASK.entry = (key, mask.copy(), ranges)
    return ranges


def hidden_scores_vanish(q: np.ndarray, k: np.ndarray, scale: float, kv_start, q_pos, empty) -> bool:
    """Whether a float16 mask (:data:`MASKED_F16`) hides keys as the kernel does, with weight exactly 0.

    ``q`` float32 [b, Hq, s, D] (a float16 query widened), ``k`` [b, Hkv, t, D], and the
    :func:`mask_ranges` of the mask.  A hidden score is ``scale * q.k + m`` with ``m <= -65504``, not below
    -1e30, so it vanishes next to the row's visible scores only while the scores are small: with ``B`` =
    ``|scale| * max |q_r| * max |k_j|`` over the rows and the keys some row does not see (Cauchy-Schwarz),
    every hidden score is at most ``B - 65504`` and the row's largest visible one at least ``-B``; True
    when ``2 B < 60000`` (or no key is hidden).  False for a NaN or an infinity in those rows or keys.
    The keys some row does not see: before ``kv_start[i]``, and after the smallest ``q_pos`` of the
    rows of batch row ``i`` that see a key (rows that see none are evaluated literally).
    """
    t = k.shape[2]
    kmax = 0.0
    for i in range(k.shape[0]):
        seen = q_pos[i][~empty[i]]
        hi = int(seen.min()) + 1 if seen.size else t
        for lo_key, hi_key in ((0, int(kv_start[i])), (hi, t)):
            if lo_key < hi_key:
                part = widened(np.ascontiguousarray(k[i, :, lo_key:hi_key]))
                norm = float(np.einsum("hjd,hjd->hj", part, part).max())
                if not np.isfinite(norm):
                    return False
                kmax = max(kmax, norm)
    if kmax == 0.0:
        return True
    qmax = float(np.einsum("bhsd,bhsd->bhs", q, q).max())
    return bool(2.0 * abs(scale) * np.sqrt(qmax) * np.sqrt(kmax) < _F16_SCORE_SPAN)  # False for NaN


def _kv_rows(x: np.ndarray) -> np.ndarray:
    """``x`` [B, H, T, D] as a C-contiguous [B, H, Cap >= T, D] array whose first T positions are ``x``.

    ``x`` itself when it is C-contiguous; the whole buffer (a read-only view,
    no copy) when ``x`` is the prefix ``[:, :, :T]`` of a C-contiguous
    [B, H, Cap, D] array inside a C-contiguous base array (a state's cache
    view); a contiguous copy otherwise.
    """
    if x.flags.c_contiguous:
        return x
    b, h, t, d = x.shape
    item = x.itemsize
    s0, s1, s2, s3 = x.strides
    row = d * item
    if s3 == item and s2 == row and s1 > 0 and s1 % row == 0 and s1 // row >= t and (b == 1 or s0 == h * s1):
        cap = s1 // row
        root = x
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.flags.c_contiguous:
            lo = root.__array_interface__["data"][0]
            start = x.__array_interface__["data"][0]
            if lo <= start and start + b * h * cap * row <= lo + root.nbytes:
                whole = np.ndarray((b, h, cap, d), x.dtype, root, start - lo, (h * s1, s1, s2, s3))
                whole.flags.writeable = False
                return whole
    return np.ascontiguousarray(x)


def _leads(rows: np.ndarray, buffer: np.ndarray) -> bool:
    """Whether the kernel's K or V operand ``rows`` (:func:`_kv_rows`) is the cache ``buffer`` [B, H, Cap, D]
    or its leading positions: the whole buffer, or (one batch row and one head: a C-contiguous prefix, which
    ``_kv_rows`` keeps as it is) its first T positions at its own address."""
    if rows.shape == buffer.shape:
        return True
    return (
        rows.shape[0] * rows.shape[1] == 1
        and rows.shape[:2] == buffer.shape[:2]
        and rows.shape[3] == buffer.shape[3]
        and rows.shape[2] <= buffer.shape[2]
        and rows.__array_interface__["data"][0] == buffer.__array_interface__["data"][0]
    )


def _scalar(x: np.ndarray | None) -> float | None:
    """A one-element float tensor of rank <= 4 (it broadcasts without adding a dim) as a float (absent:
    1.0); None for anything else."""
    if x is None:
        return 1.0
    if x.size != 1 or x.ndim > 4 or x.dtype.kind != "f":
        return None
    return float(x.reshape(()))


def _cast_type(op: Op, node: onnx.NodeProto) -> np.dtype | None:
    """The NumPy type a body ``Cast`` node converts to; None for a type NumPy has not (the body then runs)."""
    to = next((a.i for a in node.attribute if a.name == "to"), 0)
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(to))
    except (KeyError, TypeError, ValueError):
        return None


@register("MaskedAttention", domain="ai.onnxkv", internal=True)
class MaskedAttention(Op):
    """See the module docstring.  Built with one kernel object per body node (the literal path)."""

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self._body = Body.of(self, ctx, MASKED_ATTENTION_INPUTS)
        if len(self._body.outputs) != 1:
            raise self.error(f"the 'body' graph must have one output, got {len(self._body.outputs)}")
        self.score_div = bool(self.attrs.get("score_div", 0))
        self._repeat = self._body.kernel("RepeatKvMatMul")
        axis = next((a.i for a in self._body.node("Softmax").attribute if a.name == "axis"), None)
        #: The types the probabilities are cast to (the kernel path needs each to be q's: identities).
        self._cast_types = tuple(
            _cast_type(self, n) for n, _ in self._body.steps if n.op_type == "Cast" and n.domain in ("", "ai.onnx")
        )
        self._last_axis_softmax = axis in (-1, 3) or (axis is None and ctx.opset("") >= 13)
        templates = self.attrs.get(RESHAPE_FROM_X, ())
        #: (reshape template position, position of the tensor it is over)
        self._templates = tuple((r, x) for x, _, _, r in REPEAT_KV_INPUTS["MaskedAttention"] if r in templates)
        names = node.input
        #: Repeat parameters and scales only known at run time: their values join the layout memo key (each
        #: is a tensor of a fixed dtype, so equal bytes mean equal values).
        self._keyed = tuple(
            i
            for i in range(_K_REPEAT.start, _Q_SCALE + 1)
            if i < len(names) and names[i] and ctx.constant(names[i]) is None
        )
        self._any_length = self._length_free(ctx, templates)
        self._memo = LayoutMemo()
        #: The softcap the kernel applies (0: none), or None when the block caps its scores with operands the
        #: kernel cannot take (not two equal positive constants: the body then always runs).
        self._softcap: float | None = self._capped(ctx)
        #: The pasts of the export's cache Concats whose presents are K and V, or None.
        self.page_pasts = page_pasts(node, ctx, "concat")
        #: Set by the plan (``_page_readers.share_pages``): in a paged state K and V are placeholders, and the
        #: node reads the pages of the caches ``page_pasts`` names.
        self.pages_given = False

    def page_input(self, index: int) -> str | None:
        """The past whose pages this node reads itself in a paged state instead of input ``index`` (K: 1, V:
        2, each the present of an export's cache Concat), or None."""
        if self.page_pasts is None or index not in (_K, _V) or self.node.input[_K] == self.node.input[_V]:
            return None
        return self.page_pasts[index - _K]

    def _capped(self, ctx: BuildContext) -> float | None:
        names = self.node.input
        div, mul = (names[i] if i < len(names) else "" for i in (_SOFTCAP_DIV, _SOFTCAP_MUL))
        if not div and not mul:
            return 0.0
        values = [ctx.constant(n) if n else None for n in (div, mul)]
        if any(v is None for v in values):
            return None
        c, c2 = (_scalar(v) for v in values)
        return c if c is not None and c == c2 and np.isfinite(c) and c > 0 else None

    def _length_free(self, ctx: BuildContext, templates) -> bool:
        """Whether :meth:`_scale` cannot depend on the key length T (for T >= 1): every repeat is absent or
        made of build-time constants whose expand shape keeps T by broadcasting (1 at its position) and whose
        reshape target leaves T to the tensor: a template with 0 at T's position and no -1, or a plain
        target with its one -1 there and no 0 copying T (position 3 of the expanded shape)."""
        names = self.node.input
        for _, axes, expand, reshape in REPEAT_KV_INPUTS["MaskedAttention"]:
            params = [names[i] if i < len(names) else "" for i in (axes, expand, reshape)]
            if not any(params):
                continue
            values = [ctx.constant(p) if p else None for p in params]
            if any(v is None for v in values):
                return False
            e, r = int_list(values[1]), int_list(values[2])
            if len(e) != 5 or e[3] != 1 or len(r) != 4:
                return False
            if not (
                r[2] == 0 and -1 not in r if reshape in templates else r[2] == -1 and r.count(-1) == 1 and r[3] != 0
            ):
                return False
        return True

    def _key(self, inputs: list) -> tuple:
        """The layout memo key of a call: what :meth:`_scale` depends on (T only through ``T > 0`` and
        ``T_k == T_v`` when ``_any_length``: decode steps then share one key)."""
        q, k, v = inputs[_Q], inputs[_K], inputs[_V]
        if self._any_length and k.ndim == 4 and v.ndim == 4:
            t = k.shape[2]
            kv = (k.shape[:2], k.shape[3], v.shape[:2], v.shape[3], t == v.shape[2], t > 0)
        else:
            kv = (k.shape, v.shape)
        return (q.shape, q.dtype, k.dtype, v.dtype, kv, *[inputs[i].tobytes() for i in self._keyed])

    #: Inputs a recorded decode call does not read (the present views: it reads the cache buffers directly).
    replay_unread = (_K, _V)
    #: Inputs a recorded decode call takes whole with their last dim read when replayed (the mask).
    ragged_inputs = (_MASK,)

    def compilable(self, inputs: list) -> bool:
        """Attention over a state's caches with a mask whose scale and repeats are fixed at build time: its
        kernel call is one a compiled step replays (``run`` notes it; any other run refuses the recording)."""
        return self._any_length and not self._keyed

    def run(self, inputs: list, rt: RunContext) -> tuple:
        q, k, v = inputs[_Q], inputs[_K], inputs[_V]
        if q.shape[0] < 1:
            raise InputError(
                f"{self.op_type} node '{self.name}': the batch is empty (query shape {q.shape}); "
                "expected at least one row"
            )
        if paged_state(rt, self):  # K and V are placeholders
            y, inputs = self._on_pages(inputs, rt)
            if y is not None:
                return (y,)
            q, k, v = inputs[_Q], inputs[_K], inputs[_V]
        scale = self._memo.get(self._key(inputs), self._scale, inputs)
        b, _, s, _ = q.shape
        ranges = None if scale is None else cached_mask_ranges(inputs[_MASK], b, s, k.shape[2])
        half = q.dtype == np.float16
        wq = widened(q, rt) if half and ranges is not None else None  # float16: in float32, Y rounded once
        mask = inputs[_MASK]
        if (
            ranges is not None
            and mask.dtype == np.float16
            and np.isfinite(mask[mask != 0]).any()  # -inf hides a key whatever the scores
            and not hidden_scores_vanish(q if wq is None else wq, k, scale, *ranges)
        ):
            ranges = None
        if ranges is None:
            if wq is not None:
                rt.unscratch(wq)
            rec = _recorder()
            if rec is not None:
                rec.refused.append(f"{self.op_type} node '{self.name}': evaluated literally")
            return (self._literal(self._templated(inputs), rt),)
        kv_start, q_pos, empty = ranges
        out = rt.empty(0, q.shape, q.dtype)
        wide = rt.scratch(q.shape, np.float32) if half else out
        kv_len = np.full(b, k.shape[2], np.int32)
        q = np.ascontiguousarray(q) if wq is None else wq
        k_rows, v_rows = _kv_rows(k), _kv_rows(v)
        _attention_kernel(
            q, k_rows, v_rows, kv_len, q_pos, scale, self._softcap, -1, wide, kv_start if kv_start.any() else None
        )
        if half:
            round_into(out, wide)
            rt.unscratch(wq, wide)
        rec = _recorder()
        if rec is not None:  # a float16 block's replay widens q and rounds Y itself
            self._note(rec, rt, inputs, inputs[_Q] if half else q, k_rows, v_rows, out, scale, empty)
        if empty.any():
            rows = np.flatnonzero(empty.any(axis=0))
            sub = list(self._templated(inputs))
            sub[_Q] = inputs[_Q][:, :, rows]
            # the mask and the other score-shaped values the block reads (a NaN guard's fill): those rows
            for i in (_MASK, *range(len(MASKED_ATTENTION_INPUTS), len(sub))):
                x = sub[i]
                if i == _MASK or (x is not None and x.ndim >= 2 and x.shape[-1] in (1, k.shape[2])):
                    if x.ndim >= 2 and x.shape[-2] != 1:
                        sub[i] = x[..., rows, :]
            out[:, :, rows] = self._literal(sub, rt)
        return (out,)

    def _on_pages(self, inputs: list, rt: RunContext) -> tuple[np.ndarray | None, list]:
        """``(Y, inputs)`` with Y read by the paged streaming kernel from the pages of the caches
        ``page_pasts`` names; ``(None, inputs with K and V gathered copies)`` when the kernel cannot take the
        call (the conditions of the module docstring; a query that sees no key, or a float16 mask's finite
        values, whose bound reads the keys), for the paths over arrays.  (Every row wrote every position the
        mask may show: the Concats refuse to write a row past what it has written.)"""
        q, k, mask = inputs[_Q], inputs[_K], inputs[_MASK]
        scale = self._memo.get(self._key(inputs), self._scale, inputs)
        b, _, s, _ = q.shape
        t = k.shape[2]
        ranges = None if scale is None else cached_mask_ranges(mask, b, s, t)
        if ranges is not None:  # a finite float16 bound that hides keys: bounded by the keys' values (arrays)
            hides = bool(ranges[0].any()) or int(ranges[1].min()) < t - 1
            finite = mask.dtype == np.float16 and hides and np.isfinite(mask[mask != 0]).any()
            ranges = None if finite or ranges[2].any() else ranges
        kv_len = np.full(b, t, np.int32)
        keys, values, paged = read_pages(rt, self.page_pasts, None if ranges is None else (*ranges[:2], -1), kv_len, t)
        if not paged:
            inputs = list(inputs)
            inputs[_K], inputs[_V] = keys, values
            return None, inputs
        kv_start, q_pos, _ = ranges
        out = rt.empty(0, q.shape, q.dtype)
        half = q.dtype == np.float16
        wq = widened(q, rt) if half else np.ascontiguousarray(q)
        wide = rt.scratch(q.shape, np.float32) if half else out
        stats = paged_causal_attention(
            wq, keys, values, kv_len, q_pos, scale, self._softcap, -1, wide, kv_start if kv_start.any() else None
        )
        rt.count(**stats)
        if half:
            round_into(out, wide)
            rt.unscratch(wq, wide)
        rec = _recorder()  # a replay reads the node's own query (a float16 one widened by the call)
        if rec is not None and not note_masked_paged(
            rec, rt, self.page_pasts, q, None, mask, out, scale, self._softcap, False
        ):
            rec.refused.append(f"{self.op_type} node '{self.name}': not a decode over a paged state's native pages")
        return out, inputs

    def _note(self, rec, rt: RunContext, inputs: list, q, k_rows, v_rows, out, scale: float, empty) -> None:
        """Note the kernel call just made (a recording thread), or refuse the recording when a replay could not
        make it: K or V not the leading positions of a state's contiguous caches (their committed length plus
        the step's tokens), q not the kernel's own operand (a float16 block's: not its C-contiguous query), a
        mask that is not a C-contiguous [mb, 1, ms, T] of q's type with one column per key, or a query that
        sees no key (evaluated literally).  A float16 mask whose replay meets a finite masked value refuses that
        run (``attention.masked_ranges``: the bound of :func:`hidden_scores_vanish` is Python's)."""
        k, v, mask = inputs[_K], inputs[_V], inputs[_MASK]
        names = bound_cache_name(rt, k), bound_cache_name(rt, v)
        b, _, s, _ = q.shape
        t = k.shape[2]
        if (
            None in names
            or names[0] == names[1]
            or q is not inputs[_Q]
            or not q.flags.c_contiguous
            or t != rt.caches[names[0]].length + s
            or empty.any()
            or not replayable_mask(mask, (q.dtype,), b, s, t)
        ):
            rec.refused.append(f"{self.op_type} node '{self.name}': not a decode over a state's contiguous caches")
            return
        k_buffer, v_buffer = (rt.caches[n].buffer for n in names)
        if not (_leads(k_rows, k_buffer) and _leads(v_rows, v_buffer)):
            rec.refused.append(f"{self.op_type} node '{self.name}': K or V not a whole cache")
            return
        note_masked_decode(rec, names, q, k_buffer, v_buffer, mask, out, scale, self._softcap)

    def _scale(self, inputs: list) -> float | None:
        """The kernel's score scale when the shapes and dtypes of q/k/v, the repeats and the scales fit the
        kernel (the conditions of the module docstring but the mask's), else None.  Depends only on what
        :meth:`_key` holds."""
        inputs = self._templated(inputs)
        q, k, v = inputs[_Q], inputs[_K], inputs[_V]
        if (
            self._softcap is None
            or not self._last_axis_softmax
            or q.dtype not in (np.float32, np.float16)
            or any(t != q.dtype for t in self._cast_types)
            or (q.dtype == np.float16 and k.dtype != np.float16)
            or q.ndim != 4
            or k.ndim != 4
            or v.shape != k.shape
            or k.dtype != v.dtype
            or k.dtype not in (np.float32, np.float16)
            or k.shape[0] != q.shape[0]
            or k.shape[3] != q.shape[3]
            or 0 in q.shape
            or 0 in k.shape
        ):
            return None
        group = self._group(k, inputs[_K_REPEAT])
        if not group or group != self._group(v, inputs[_V_REPEAT]) or q.shape[1] != k.shape[1] * group:
            return None
        k_scale, score_scale, q_scale = (_scalar(inputs[i]) for i in (_K_SCALE, _SCORE_SCALE, _Q_SCALE))
        if k_scale is None or score_scale is None or q_scale is None or (self.score_div and score_scale == 0):
            return None
        scale = q_scale * (k_scale / score_scale if self.score_div else k_scale * score_scale)
        return scale if np.isfinite(scale) else None

    def _templated(self, inputs: list) -> list:
        """``inputs`` with the reshape templates (``reshape_from_x``) replaced by the targets they stand for."""
        if not self._templates:
            return inputs
        inputs = list(inputs)
        for r, x in self._templates:
            inputs[r] = reshape_from_x(inputs[r], inputs[x])
        return inputs

    def _group(self, x: np.ndarray, repeat: list) -> int:
        """Query heads per KV head that (axes, expand, reshape) describe for ``x``; 1 without a repeat; 0: none."""
        if all(r is None for r in repeat):
            return 1
        if self._repeat is None or any(r is None for r in repeat):
            return 0
        return self._repeat._is_repeat(x, *repeat)

    def _literal(self, inputs: list, rt: RunContext) -> np.ndarray:
        """The body evaluated node by node on ``inputs`` with their templates rebuilt (temporaries from NumPy,
        not the plan's buffers)."""
        return self._body.evaluate(self.node.input, inputs, rt)[0]
