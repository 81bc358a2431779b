"""ONNX ``Attention`` (opsets 23, 24 and 25), following ``onnx.reference`` (onnx 1.23 with its errata).

Inputs: ``Q`` [B, Hq, Sq, D] or [B, Sq, Hq*D]; ``K`` [B, Hkv, Skv, D] or
[B, Skv, Hkv*D]; ``V`` [B, Hkv, Skv, Dv] or [B, Skv, Hkv*Dv] (3-D inputs need
``q_num_heads``/``kv_num_heads``); ``attn_mask`` (bool: True = attend, or
additive float) broadcastable to [B, Hq, Sq, T] whose last dimension may be
shorter than ``T`` (the missing columns are masked); ``past_key``/``past_value``
[B, Hkv, P, D|Dv] (both or neither); opset 24: ``nonpad_kv_seqlen`` [B] int64
(valid key count per row, not combinable with a past).  ``T = P + Skv``.

Outputs: ``Y`` (layout of ``Q``, head size Dv); ``present_key``/``present_value``
= concat(past, new) along the sequence axis, [B, Hkv, T, D|Dv];
``qk_matmul_output`` [B, Hq, Sq, T] per ``qk_matmul_output_mode``: 0 = scaled
Q·K, 1 = after softcap, 2 = after softcap and mask (``-inf`` where masked),
3 = softmax probabilities.  Mode 0 follows the operator spec and ONNX Runtime
(Q·K before softcap); ``onnx.reference`` 1.23 returns the softcapped scores
there.

Scores are ``scale * Q·K`` (default ``1/sqrt(D)``), then softcap, then the
bias from the mask, causal rule and padding, then softmax (in
``softmax_precision`` when given).  Query head ``h`` reads KV head
``h // (Hq // Hkv)``.  ``is_causal=1``: query ``i`` sees key ``j`` iff
``j <= i + offset`` with ``offset = P`` with a past, ``nonpad_kv_seqlen[b] - Sq``
with ``nonpad_kv_seqlen`` alone, else 0.  Opset 25: ``left_window_size`` /
``right_window_size`` (-1 = unbounded, the default) restrict query ``i`` at
absolute position ``p = offset + i`` (the same offset, whether or not
``is_causal``) to keys ``p - left_window_size <= j <= p + right_window_size``,
on top of the causal rule and the mask.  A row with no visible key gives zeros.

Q, K and V are float16, float32, float64 or bfloat16 (one dtype).  float16
and bfloat16 are computed in float32 (the softmax too, unless
``softmax_precision`` names another type) and Y, like ``qk_matmul_output``,
is rounded to the input type once; the presents are the inputs' own values.

Float32, float16 and bfloat16 without a score output run through the
streaming kernel when the visible keys of each query -- causal rule, window
and mask -- form one range the kernel can express (always without a mask
and a left window; see :meth:`Attention23._kernel_ranges`); a mask must then
be a set of row ranges (:func:`attn_mask_ranges`:
bool, or float with 0 for visible keys and ``-inf``/``<= -1e30`` for masked
ones, one range of keys per query whose start is shared by its batch row,
the same for every head -- padding plus a causal band, as the builder model
``onnxkv.zoo.attention23`` makes); everything else through NumPy.  In a
paged state the kernel reads the pages directly, with the mask's ranges as
``kv_start`` and ``q_pos``; only a mask that is not a set of row ranges
gets a gathered copy of the past (counted as ``prefix_copied_bytes`` of the
node's ``cache_write`` events).  In a state, every row attends over the
positions it wrote.  Rows that wrote different numbers of positions (a batch
of requests, or a loaded cache) run when the mask hides from each row the
positions between its own length and the past (:func:`ragged_mask`; what
``FeedBuilder.ragged`` feeds): the row's new keys are stored right after its
own and it attends over its own keys, as the row alone.  A mask that shows a
row a position it never wrote raises :class:`~onnxkv.errors.InputError`
before anything is written, unless the run says the feeds padded them
(``State.run(gaps_padding=True)``): they are then dropped whatever the mask
holds there (a graph that hides with a finite bias).  In a run of segments (rows of different
lengths and token counts on one token axis) the node takes the mask of
causal attention over that axis as each row's own (:mod:`._attention_segments`).  Storage
counters per present output: one allocation of its size,
``prefix_copied_bytes`` = bytes of the past, ``append_copied_bytes`` = bytes
of the new K (or V).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto

from onnxkv._kernels import _validate as V
from onnxkv._kernels._record import current as _recorder
from onnxkv.errors import InputError
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops import _attention_segments as segment_run
from onnxkv.plan.ops._attention_math import causal_attention, check_written, dense_attention, paged_causal_attention
from onnxkv.plan.ops._export_record import note_attention_decode
from onnxkv.plan.ops._page_readers import page_pasts, paged_state, read_pages
from onnxkv.plan.ops._paged_record import note_attention_paged
from onnxkv.plan.ops._segments import cache_segments
from onnxkv.plan.ops._static_record import note_nonpad_decode
from onnxkv.plan.ops._util import BF16 as _BF16
from onnxkv.plan.ops.masked_attention import MASKED, cached_mask_ranges, visible_ranges
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["Attention23", "Attention24", "Attention25", "attn_mask_ranges"]

_ATTRIBUTES = frozenset({
    "is_causal", "kv_num_heads", "q_num_heads", "qk_matmul_output_mode", "scale", "softcap", "softmax_precision",
})  # fmt: skip
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), _BF16)
#: Input types computed in float32 (Y is rounded to them once).
_NARROW = (np.dtype(np.float16), _BF16)
_SOFTMAX_DTYPES = {
    TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.FLOAT: np.dtype(np.float32),
    TensorProto.DOUBLE: np.dtype(np.float64),
}


def attn_mask_ranges(mask: np.ndarray, b: int, s: int, t: int) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """The visible keys of an Attention ``attn_mask`` over scores [b, H, s, t] as row ranges, or None.

    Returns ``(kv_start, q_pos, exact)``: the first two as
    :func:`~onnxkv.plan.ops.masked_attention.visible_ranges` gives them, and
    whether every masked entry is ``-inf`` (or False): then a query that
    sees no key gets zeros, as the kernel gives; the dense softmax of a
    query whose masked scores are finite is uniform over them instead.  The
    mask is bool (True = visible) or float (0 visible, ``-inf`` or
    ``<= MASKED`` masked; any other value is a bias the kernel cannot take),
    its head axis 1, broadcastable over batch rows and queries; a last
    dimension shorter than ``t`` masks the missing keys (as the operator
    does).  O(mask).
    """
    if mask.ndim < 1 or mask.ndim > 4 or mask.shape[-1] > t or mask.dtype.kind not in "bf" or min(b, s, t) < 1:
        return None
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    mb, mh, ms, mt = m.shape
    if mh != 1 or mb not in (1, b) or ms not in (1, s):
        return None
    m = m[:, 0]
    if m.dtype == np.bool_:
        visible, exact = m, True
    else:
        visible = m == 0
        masked = m[~visible]
        if not (masked <= MASKED).all():
            return None
        exact = bool(np.isneginf(masked).all())
    if mt < t:
        visible = np.concatenate([visible, np.zeros((mb, ms, t - mt), bool)], axis=-1)
    ranges = visible_ranges(np.broadcast_to(visible, (mb, ms, t)), b, s)
    return None if ranges is None else (ranges[0], ranges[1], exact)


def ragged_mask(mask, written: np.ndarray, past: int, s: int, padding: bool = False) -> tuple[np.ndarray, int] | None:
    """The mask of a state whose rows wrote different numbers of positions, over each row's own keys.

    Row ``r`` of the state wrote ``written[r] <= past`` positions (int [B]); the graph's keys are the
    ``past`` positions of the longest row and then the ``s`` new ones.  When ``mask`` (bool, or float
    with hidden keys at or below ``MASKED``; broadcastable to ``[B, H, s, past + s]``, a shorter last
    dimension hiding the keys it lacks) hides the positions ``[written[r], past)`` from every query of
    row ``r``, the row's new keys are stored right after its own (at ``written[r]``, as a
    GroupQueryAttention row's at its ``seqlens_k``) and its queries attend over its ``written[r] + s``
    keys: returns ``(m, written.max() + s)`` with ``m[r, ..., j]`` the mask of row ``r``'s own key
    ``j`` (its written keys, then its new ones; hidden beyond).  None when the mask does not hide them
    or has another form: the caller's check of the written positions then raises.  ``padding``: the caller
    fed those positions as padding (``State.run(gaps_padding=True)``), so they are dropped whatever the
    mask holds there (a graph that hides with a finite bias).  O(mask).
    """
    if not isinstance(mask, np.ndarray) or mask.ndim < 1 or mask.ndim > 4 or mask.dtype.kind not in "bf":
        return None
    b, total = written.size, past + s
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if m.shape[0] not in (1, b) or m.shape[3] > total:
        return None
    boolean = m.dtype == np.bool_
    hidden = False if boolean else -np.inf
    if m.shape[3] < total:
        m = np.concatenate([m, np.full(m.shape[:3] + (total - m.shape[3],), hidden, m.dtype)], axis=3)
    m = np.broadcast_to(m, (b,) + m.shape[1:])
    cols = np.arange(total)
    gap = (cols[None, :] >= written[:, None]) & (cols[None, :] < past)  # [B, total]: never written
    shown = m if boolean else m > MASKED
    if not padding and (shown & gap[:, None, None, :]).any():
        return None
    width = int(written.max()) + s
    j = np.arange(width)[None, :]
    own = j < written[:, None] + s  # [B, width]: the row's written keys, then its new ones
    src = np.where(j < written[:, None], j, past + j - written[:, None])
    out = np.take_along_axis(m, np.where(own, src, 0)[:, None, None, :], axis=3)
    out = np.where(own[:, None, None, :], out, hidden)
    return out, width


@register("Attention", since=23)
class Attention23(Op):
    """Kernel object of one ONNX Attention node (see the module docstring)."""

    has_nonpad = False
    since = 23
    #: The attributes of this opset's Attention.
    attributes = _ATTRIBUTES

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        a = self.attrs
        unknown = sorted(set(a) - self.attributes)
        if unknown:
            raise self.error(
                f"unsupported attribute(s) {unknown} for opset {ctx.opset('')} "
                f"(Attention-{self.since} has {sorted(self.attributes)})"
            )
        #: Window bounds of Attention-25 (-1: unbounded).
        self.left, self.right = (int(a.get(w, -1)) for w in ("left_window_size", "right_window_size"))
        for w, value in (("left_window_size", self.left), ("right_window_size", self.right)):
            if value < -1:
                raise self.error(f"attribute {w} must be -1 (unbounded) or >= 0, got {value}")
        self.is_causal = bool(a.get("is_causal", 0))
        self.q_heads = int(a.get("q_num_heads", 0))
        self.kv_heads = int(a.get("kv_num_heads", 0))
        if self.q_heads < 0 or self.kv_heads < 0:
            raise self.error(f"q_num_heads/kv_num_heads must be positive, got {self.q_heads}/{self.kv_heads}")
        if self.q_heads and self.kv_heads and self.q_heads % self.kv_heads:
            raise self.error(f"q_num_heads={self.q_heads} must be a multiple of kv_num_heads={self.kv_heads}")
        self.mode = int(a.get("qk_matmul_output_mode", 0))
        if self.mode not in (0, 1, 2, 3):
            raise self.error(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {self.mode}")
        self.scale = a.get("scale")
        self.softcap = float(a.get("softcap", 0.0))
        if self.softcap < 0:
            raise self.error(f"softcap must be >= 0, got {self.softcap}")
        precision = a.get("softmax_precision")
        if precision is not None and precision not in _SOFTMAX_DTYPES:
            raise self.error(
                f"softmax_precision {TensorProto.DataType.Name(precision) if precision in TensorProto.DataType.values() else precision} "
                "is not supported (FLOAT16, FLOAT or DOUBLE)"
            )
        self.softmax_dtype = _SOFTMAX_DTYPES.get(precision) if precision is not None else None
        outs = list(node.output) + [""] * (4 - len(node.output))
        self.want = tuple(bool(o) for o in outs[:4])
        if self.want[1] != self.want[2]:
            raise self.error("present_key and present_value must be requested together")
        self.bound = bool(ctx.bindings_for(node))
        if not self.bound and self.has_nonpad:  # K and V may be static caches, which a recorded call takes by name
            self.replay_unread = (1, 2)
        #: The pasts of the static caches whose TensorScatter presents are K and V, or None.
        self.page_pasts = page_pasts(node, ctx, "tensor_scatter") if self.has_nonpad and not self.bound else None
        #: Set by the plan (_page_readers.share_pages): in a paged state K and V are placeholders, and the node
        #: reads the pages of the caches ``page_pasts`` names.
        self.pages_given = False

    def _input_error(self, message: str) -> InputError:
        return InputError(f"{self.op_type} node '{self.name}': {message}")

    # -- run --------------------------------------------------------------------------------

    #: Inputs a recorded decode call does not read (the past views: it writes the cache buffers directly).
    replay_unread = (4, 5)
    #: Inputs a recorded decode call takes whole with their last dim read when replayed (the mask).
    ragged_inputs = (3,)

    def page_input(self, index: int) -> str | None:
        """The past whose pages this node reads itself in a paged state instead of input ``index`` (K: 1, V:
        2, each a static cache's TensorScatter present), or None."""
        if self.page_pasts is None or index not in (1, 2) or self.node.input[1] == self.node.input[2]:
            return None
        return self.page_pasts[index - 1]

    def compilable(self, inputs: list) -> bool:
        """Bound to a state's caches, or reading ``nonpad_kv_seqlen`` (a static cache form's), with no window
        and no score output: its decode call over contiguous float32 caches (or over two whole static ones) is one
        a compiled step replays (``run`` notes it; any other run refuses the recording)."""
        return (self.bound or self.has_nonpad) and self.left < 0 and self.right < 0 and not self.want[3]

    @property
    def takes_segments(self) -> bool:
        """Whether runs of segments may reach this node (:mod:`._attention_segments`)."""
        return segment_run.takes_segments(self)

    def run(self, inputs: list, rt: RunContext) -> Sequence[np.ndarray | None]:
        inputs = list(inputs) + [None] * (7 - len(inputs))
        counts = cache_segments(rt, self.node.input[4], self.bound) if len(self.node.input) > 4 else None
        if counts is not None:
            return segment_run.run_segments(self, inputs, rt, counts)  # a compiled step never runs segments
        q_in, k_in, v_in, mask, past_k, past_v = inputs[:6]
        nonpad = inputs[6] if self.has_nonpad else None
        q, k, v = self._to_bnsh(q_in, k_in, v_in)
        if q.dtype in _NARROW:  # computed in float32; the presents keep the inputs' own values
            q = q.astype(np.float32)
            mask = mask.astype(np.float32) if mask is not None and mask.dtype in _NARROW else mask
        b, hq, sq, d = q.shape
        in_place = self.bound and rt.in_place(self.node.input[4])
        if in_place and k.dtype == _BF16:  # a state holds bfloat16 as its uint16 bit patterns
            past_k, past_v = past_k.view(_BF16), past_v.view(_BF16)
        past_len = self._check_past(past_k, past_v, k, v)
        if nonpad is not None:
            if past_k is not None:
                raise self._input_error("nonpad_kv_seqlen cannot be combined with past_key/past_value")
            nonpad = np.asarray(nonpad)
            if nonpad.dtype.kind not in "iu" or nonpad.shape != (b,):
                raise self._input_error(f"nonpad_kv_seqlen must be [{b}] integers, got {nonpad.dtype} {nonpad.shape}")
            bad = V.outside(nonpad, 0, k.shape[2])
            if bad.any():
                row = int(np.argmax(bad))
                raise self._input_error(
                    f"nonpad_kv_seqlen[{row}] = {int(nonpad[row])} is outside [0, {k.shape[2]}] (the keys of the row)"
                )
            nonpad = nonpad.astype(np.int64)

        total = past_len + k.shape[2]
        offsets = self._causal_offsets(b, sq, past_len, nonpad)
        kv_len = nonpad if nonpad is not None else np.full(b, total, np.int64)
        starts: np.ndarray | int = past_len  # where each row's new keys are stored
        if in_place and past_len:
            cache = rt.caches[self.node.input[4]]
            written = cache.lengths
            if int(written.min()) < past_len and not self.want[3]:  # rows of different lengths (a batch of requests)
                compact = ragged_mask(mask, written, past_len, sq, getattr(cache, "gaps_padding", False))
                if compact is not None:
                    mask, total = compact
                    starts = offsets = written.astype(np.int64)
                    kv_len = offsets + sq
        seen = None  # (kv_start or None, q_pos, window) of the streaming kernel, or None: the dense path
        if not self.want[3] and q.dtype == np.float32 and self.softmax_dtype in (None, np.dtype(np.float32)):
            seen = self._kernel_ranges(mask, b, sq, total, offsets, kv_len)
        fast = seen is not None

        keys = values = None
        paged = False
        if in_place:
            # In place: append after the past in the state's caches; present is a view (contiguous),
            # or the kernel reads the pages (paged; gathered only for the dense path).
            ck, cv = rt.caches[self.node.input[4]], rt.caches[self.node.input[5]]
            check_written(
                self,
                ck,
                starts,
                lambda row: (
                    f"past_key: the state's past of {past_len} positions, its longest row, and an "
                    f"attn_mask that does not hide the positions row {row} never wrote"
                ),
            )
            paged = getattr(ck, "paged", False)
            gather = paged and not fast
            present_k = rt.cache_write(self.node.input[4], k, starts, total, materialize=gather)
            present_v = rt.cache_write(self.node.input[5], v, starts, total, materialize=gather)
            if not paged:
                keys, values = ck.buffer, cv.buffer
            elif fast:
                keys, values = ck, cv
            if k.dtype == _BF16:
                present_k, present_v = present_k.view(_BF16), present_v.view(_BF16)
                if not paged:
                    keys, values = keys.view(_BF16), values.view(_BF16)
        elif past_k is not None or self.want[1]:
            present_k = self._present(rt, 1, past_k, k)
            present_v = self._present(rt, 2, past_v, v)
        else:
            present_k, present_v = k, v
        if keys is None:
            keys, values = present_k, present_v
        if paged_state(rt, self):  # K and V are placeholders: read the pages
            keys, values, paged = read_pages(rt, self.page_pasts, seen, kv_len, total)
            fast = fast and paged
        if k.dtype in _NARROW and isinstance(keys, np.ndarray) and not (fast and k.dtype == np.float16):
            # float32 copies, but for the kernel: it converts float16 arrays and narrow pages in its load step
            keys, values = keys[:, :, :total].astype(np.float32), values[:, :, :total].astype(np.float32)
        scale = float(self.scale) if self.scale is not None else 1.0 / np.sqrt(d)

        qk = None
        rec = _recorder()
        y_out = None
        if fast:
            y, y_out = self._kernel_output(rt, b, hq, sq, v.shape[3], q_in)
            kv_start, q_pos, window = seen
            if paged:
                rt.count(
                    **paged_causal_attention(q, keys, values, kv_len, q_pos, scale, self.softcap, window, y, kv_start)
                )
            else:
                causal_attention(q, keys, values, kv_len, q_pos, scale, self.softcap, window, y, kv_start=kv_start)
            if rec is not None and nonpad is not None and not in_place and window < 0:
                note_nonpad_decode(self, rec, rt, q, keys, values, mask, inputs[6], y, y_out, scale)
            elif rec is not None and paged and in_place and window < 0 and nonpad is None and self.page_pasts is None:
                note_attention_paged(self, rec, rt, (q, k, v, inputs[3], y, y_out), starts, past_len, scale)
            elif rec is not None:
                decode = (q, k, v, mask, y, y_out) if in_place and not paged and window < 0 and nonpad is None else None
                note_attention_decode(self, rec, rt, decode, starts, past_len, scale)
        else:
            if rec is not None:
                rec.refused.append(f"{self.op_type} node '{self.name}': not the streaming kernel")
            bias = self._bias(mask, b, hq, sq, total, offsets, nonpad, q.dtype)
            y, scores = dense_attention(
                q, keys[:, :, :total], values[:, :, :total], bias, scale, self.softcap,
                softmax_dtype=self.softmax_dtype, keep_scores=self.want[3],
            )  # fmt: skip
            if scores is not None:
                qk = (scores.raw, scores.capped, scores.biased, scores.probs)[self.mode]

        if y_out is None:
            y_out = self._output(rt, y, q_in.ndim, q_in.dtype)
        outs: list[np.ndarray | None] = [y_out, None, None, None]
        if self.want[1]:
            outs[1], outs[2] = present_k, present_v
        if self.want[3]:
            outs[3] = rt.empty(3, qk.shape, q_in.dtype)
            outs[3][...] = qk
        return outs[: len(self.node.output)]

    def _kernel_ranges(
        self, mask, b: int, sq: int, total: int, offsets: np.ndarray, kv_len: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray, int] | None:
        """``(kv_start, q_pos, window)`` of the streaming kernel (``kv_start`` None: 0) for the causal rule,
        the window and the mask, or None when the kernel cannot express them: the dense path then takes the
        call (and raises its errors).

        Query ``i`` of row ``r`` sees the keys ``lo <= j <= hi`` with ``lo`` the largest of the mask's first
        key and ``p - left_window_size``, ``hi`` the smallest of the causal bound ``p``, the mask's last key,
        ``p + right_window_size`` and ``kv_len[r] - 1`` (``p = offsets[r] + i``).  The kernel sees
        ``max(kv_start[r], q_pos - window) <= j <= min(q_pos, kv_len[r] - 1)``: one ``window`` for every query.
        None when the mask is not a set of row ranges (:func:`attn_mask_ranges`; the result of the previous
        call is reused when the mask holds the same values: every layer reads one mask), when a query would
        see no key under a mask with finite masked values, or when no single ``window`` gives every ``lo``.
        """
        p = offsets[:, None] + np.arange(sq)[None, :]
        if self.is_causal:  # a right window adds nothing to it
            q_pos = p
        elif self.right >= 0:  # capped where it passes the last key for every query (the kernel stops there)
            q_pos = p + min(self.right, max(total - 1 - int(p.min()), 0))
        else:
            q_pos = np.broadcast_to(np.int64(total), (b, sq))
        kv_start, exact = None, True
        if mask is not None:
            if not isinstance(mask, np.ndarray):
                return None
            ranges = cached_mask_ranges(mask, b, sq, total, attn_mask_ranges)
            if ranges is None:
                return None
            kv_start, mask_pos, exact = ranges
            q_pos = np.minimum(q_pos, mask_pos)
        start = np.zeros((b, 1), np.int64) if kv_start is None else kv_start.astype(np.int64)[:, None]
        lo = start if self.left < 0 else np.maximum(start, p - self.left)
        empty = np.minimum(q_pos, kv_len[:, None] - 1) < lo
        if empty.any():
            if not exact:
                return None
            q_pos = np.where(empty, start - 1, q_pos)
        window = -1
        if self.left >= 0:
            bounded = ~empty & (lo > start)  # the queries whose first key is the window's
            widths = (q_pos - lo)[bounded]
            if widths.size:
                window = int(widths[0])
                if (widths != window).any() or (~empty & ~bounded & (q_pos - window > start)).any():
                    return None
        return kv_start, q_pos, window

    def _to_bnsh(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q/K/V as [B, H, S, D] views, shapes and head counts validated."""
        if q.ndim != k.ndim or q.ndim != v.ndim or q.ndim not in (3, 4):
            raise self._input_error(
                f"Q, K and V must all be 3-D or all 4-D, got shapes {q.shape}, {k.shape}, {v.shape}"
            )
        for name, t in (("Q", q), ("K", k), ("V", v)):
            if t.dtype not in _FLOATS:
                raise self._input_error(f"{name} must be float16/float32/float64, got {t.dtype}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise self._input_error(f"Q, K and V must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.ndim == 3:
            hq, hkv = self.q_heads, self.kv_heads
            if not hq or not hkv:
                raise self._input_error("3-D inputs need the q_num_heads and kv_num_heads attributes")
            for name, t, h in (("Q", q, hq), ("K", k, hkv), ("V", v, hkv)):
                if t.shape[2] % h:
                    raise self._input_error(f"{name} hidden size {t.shape[2]} is not a multiple of {h} heads")
            q = q.reshape(q.shape[0], q.shape[1], hq, q.shape[2] // hq).transpose(0, 2, 1, 3)
            k = k.reshape(k.shape[0], k.shape[1], hkv, k.shape[2] // hkv).transpose(0, 2, 1, 3)
            v = v.reshape(v.shape[0], v.shape[1], hkv, v.shape[2] // hkv).transpose(0, 2, 1, 3)
        b, hq, _, d = q.shape
        if b < 1:
            raise self._input_error(f"the batch is empty (Q shape {q.shape}); expected at least one row")
        if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
            raise self._input_error(f"K {k.shape} and V {v.shape} do not match Q {q.shape} (as [B, H, S, D])")
        if k.shape[3] != d:
            raise self._input_error(f"K head size {k.shape[3]} differs from Q head size {d}")
        if hq % k.shape[1]:
            raise self._input_error(f"query heads {hq} must be a multiple of key/value heads {k.shape[1]}")
        return q, k, v

    def _check_past(self, past_k: np.ndarray | None, past_v: np.ndarray | None, k: np.ndarray, v: np.ndarray) -> int:
        if (past_k is None) != (past_v is None):
            raise self._input_error("past_key and past_value must be both present or both absent")
        if past_k is None:
            return 0
        b, h = k.shape[:2]
        for name, past, new in (("past_key", past_k, k), ("past_value", past_v, v)):
            if past.ndim != 4 or past.shape[:2] != (b, h) or past.shape[3] != new.shape[3]:
                raise self._input_error(f"{name} must be [{b}, {h}, past_len, {new.shape[3]}], got {past.shape}")
            if past.dtype != new.dtype:
                raise self._input_error(f"{name} dtype {past.dtype} differs from {new.dtype}")
        if past_k.shape[2] != past_v.shape[2]:
            raise self._input_error(f"past_key {past_k.shape} and past_value {past_v.shape} lengths differ")
        return past_k.shape[2]

    def _present(self, rt: RunContext, index: int, past: np.ndarray | None, new: np.ndarray) -> np.ndarray:
        """concat(past, new) on axis 2; as output ``index`` (storage counted) when requested."""
        b, h, s, d = new.shape
        p = 0 if past is None else past.shape[2]
        shape = (b, h, p + s, d)
        if not self.want[index]:
            return np.concatenate([past, new], axis=2)
        present = rt.empty(index, shape, new.dtype)
        if p:
            present[:, :, :p] = past
        present[:, :, p:] = new
        rt.count(
            allocations=1,
            allocated_bytes=present.nbytes,
            prefix_copied_bytes=0 if past is None else past.nbytes,
            append_copied_bytes=new.nbytes,
        )
        return present

    def _causal_offsets(self, b: int, sq: int, past_len: int, nonpad: np.ndarray | None) -> np.ndarray:
        """Per-row causal offset (int64 [B]); see the module docstring."""
        if nonpad is not None and past_len == 0:
            return nonpad - sq
        return np.full(b, past_len, np.int64)

    def _bias(
        self,
        mask: np.ndarray | None,
        b: int,
        hq: int,
        sq: int,
        total: int,
        offsets: np.ndarray,
        nonpad: np.ndarray | None,
        dtype: np.dtype,
    ) -> np.ndarray:
        """Additive bias broadcastable to [B, Hq, Sq, T] (``-inf`` = masked)."""
        neg = dtype.type(-np.inf)
        bias = np.zeros((1, 1, 1, total), dtype)
        if mask is not None:
            m = np.asarray(mask)
            if m.ndim < 1 or m.shape[-1] > total:
                raise self._input_error(f"attn_mask last dimension must be at most {total}, got shape {m.shape}")
            pad = total - m.shape[-1]
            if m.dtype == np.bool_:
                m = np.where(m, dtype.type(0), neg)
            elif m.dtype.kind == "f":
                m = m.astype(dtype, copy=False)
            else:
                raise self._input_error(f"attn_mask must be bool or float, got {m.dtype}")
            if pad:
                m = np.concatenate([m, np.full(m.shape[:-1] + (pad,), neg, dtype)], axis=-1)
            try:
                np.broadcast_shapes(m.shape, (b, hq, sq, total))
            except ValueError:
                raise self._input_error(
                    f"attn_mask shape {np.shape(mask)} does not broadcast to {(b, hq, sq, total)}"
                ) from None
            bias = bias + m
        j = np.arange(total)[None, None, None, :]
        p = np.arange(sq)[None, None, :, None] + offsets[:, None, None, None]  # absolute query positions
        if self.is_causal:
            bias = bias + np.where(j <= p, dtype.type(0), neg)
        if self.left >= 0:
            bias = bias + np.where(j >= p - self.left, dtype.type(0), neg)
        if self.right >= 0:
            bias = bias + np.where(j <= p + self.right, dtype.type(0), neg)
        if nonpad is not None:
            bias = bias + np.where(j < nonpad[:, None, None, None], dtype.type(0), neg)
        return bias

    def _kernel_output(self, rt: RunContext, b: int, h: int, s: int, dv: int, q_in: np.ndarray) -> tuple:
        """``(y, out)``: the kernel's float32 [B, H, S, Dv] operand and, when it is the node's output Y in its
        input layout (float32 [B, H, S, Dv], or [B, S, H*Dv] of one token: the same memory), that output;
        else a fresh operand and None (``_output`` converts it)."""
        if q_in.dtype == np.float32 and (q_in.ndim == 4 or s == 1):
            out = rt.empty(0, (b, h, s, dv) if q_in.ndim == 4 else (b, s, h * dv), np.float32)
            return out.reshape(b, h, s, dv), out
        return np.empty((b, h, s, dv), np.float32), None

    def _output(self, rt: RunContext, y: np.ndarray, ndim: int, dtype: np.dtype) -> np.ndarray:
        """Y in the input layout ([B, H, S, Dv] or [B, S, H*Dv]) as ``dtype``."""
        b, h, s, dv = y.shape
        if ndim == 4:
            out = rt.empty(0, y.shape, dtype)
            out[...] = y
        else:
            out = rt.empty(0, (b, s, h * dv), dtype)
            out.reshape(b, s, h, dv)[...] = y.transpose(0, 2, 1, 3)
        return out


@register("Attention", since=24)
class Attention24(Attention23):
    """ONNX Attention-24: Attention-23 plus the ``nonpad_kv_seqlen`` input."""

    has_nonpad = True
    since = 24


@register("Attention", since=25)
class Attention25(Attention24):
    """ONNX Attention-25: Attention-24 plus the ``left_window_size``/``right_window_size`` attributes."""

    since = 25
    attributes = _ATTRIBUTES | {"left_window_size", "right_window_size"}
