"""``com.microsoft::GroupQueryAttention`` with ONNX Runtime CPU semantics (ORT 1.32).

Inputs (position: name, shape, dtype T = float32/float16, M = int32):

0. ``query`` [B, S, Hq*D], or packed QKV [B, S, (Hq + 2*Hkv)*D] when ``key`` and
   ``value`` are omitted;
1. ``key``, 2. ``value`` [B, S, Hkv*D] (both or neither);
3. ``past_key``, 4. ``past_value`` [B, Hkv, P, D] (BNSH, both or neither;
   ``P`` may be 0);
5. ``seqlens_k`` [B] M: valid total length of each batch row minus one;
6. ``total_sequence_length`` scalar M: the batch maximum of the total length,
   in ``[1, P + S]`` (it sizes the present outputs);
7. ``cos_cache``, 8. ``sin_cache`` [max_pos, rot/2] (``do_rotary=1``);
9. ``position_ids`` [B, S] int64 (optional, rotary positions);
10. ``attention_bias`` [B|1, Hq|1, S, total_sequence_length] (optional, added
    after softcap);
11. ``head_sink`` [Hq] (optional, attention sink per query head).

Inputs 12-16 (quantized caches, Q/K RMS norm, ``query_seqlens``) are rejected.
Integer inputs of any integer dtype are accepted and checked in their own width
before anything converts or adds to them: ``seqlens_k`` and
``total_sequence_length`` must hold int32 values, ``position_ids`` rows of the
cos cache.

Outputs: ``output`` [B, S, Hq*D]; ``present_key``/``present_value``
[B, Hkv, L, D].

Semantics:

* **Prompt vs token generation.** The call is a *first prompt* when
  ``S == total_sequence_length``; then every row's past length is 0.  Else,
  ``S == 1`` is token generation and ``S > 1`` a *subsequent prompt* (chunked
  prefill, ``B == 1`` only).  In both, row ``b`` has
  ``total_b = seqlens_k[b] + 1`` tokens after the step and
  ``past_b = total_b - S`` tokens before it.
* **Present length** (past buffer not shared with present, the only mode of
  this tensor path): ``L = max(total_sequence_length, P)``.  ``present`` is
  zero-filled, rows ``[0, past_b)`` are copied from ``past``, and the ``S`` new
  rows are written at ``[past_b, past_b + S)``.  On the first prompt all ``S``
  rows are written, right padding included (as ORT does).
  *Shared-buffer mode* (when a state binds the past to its persistent cache,
  as GenAI binds past and present to one buffer): nothing is zero-filled or
  copied; only the ``S`` new rows are written in place at ``past_b`` and the
  present is a zero-copy view ``[:, :, :L]`` of the cache.
* **Right padding.** Batch rows shorter than the longest are right padded;
  ``seqlens_k`` gives each row's valid length.  Key ``j`` is visible to row
  ``b`` only if ``j < total_b``.  In a state, a row's past is bounded by what
  that row has written (not by the longest row): ``past_b`` beyond the row's
  written length raises :class:`~onnxkv.errors.InputError` naming the row,
  ``seqlens_k`` and the written length, before anything is written.  Padding
  query rows of a first prompt (``s >= total_b``) are computed by the same
  rule as every other row (they see all valid keys inside the window); their
  values are not defined (ORT 1.32's own float16 and float32 CPU kernels give
  different ones under a ``local_window_size``), and callers ignore them.
* **Masking.** Query ``s`` of row ``b`` has absolute position
  ``p = past_b + s`` and sees keys ``j <= p``, ``j < total_b`` and, when
  ``local_window_size = W > 0``, ``j > p - W`` (the ``W`` most recent
  positions, the query's own included; ORT 1.32 CPU).  Scores are
  ``scale * q·k`` (``scale = 0`` means ``1/sqrt(D)``), then
  ``softcap * tanh(score / softcap)`` when ``softcap > 0``, then
  ``attention_bias``, then softmax (with ``exp(head_sink[h])`` added to the
  denominator when a sink is given; ``smooth_softmax=1`` without
  ``head_sink`` is a sink of 0).
* **Rotary** (``do_rotary=1``) is applied to Q and K (not V) before the cache
  append, on ``rot = 2 * cos_cache.shape[1]`` leading channels, at position
  ``p`` above — i.e. ``s`` on a first prompt and ``seqlens_k[b] + 1 - S + s``
  otherwise.  With ``position_ids``: the first prompt uses
  ``position_ids[0, 0] + s`` for every row, other calls use ``position_ids``.
* **Window-sized caches** (``sliding_window_cache=1``, with a window
  ``local_window_size >= 1``): past and present are buffers of a fixed
  capacity ``C >= local_window_size`` (the past's dim 2) holding only the most
  recent positions, while ``seqlens_k`` and rotary positions stay absolute;
  the layout (ONNX Runtime 1.32 CPU) is in :mod:`._gqa_window`.
  ``attention_bias`` is rejected with it.  In a state the node's caches are
  the state's whole caches (absolute positions, as without the attribute):
  the window masks them, and the outputs are the same.
* Without ``present_key``/``present_value`` outputs the result is the same
  (past + new keys are attended; nothing is counted).  ORT's CPU kernel
  then reads only the new keys, which is not meaningful with a past.
* Storage counters per present output: one allocation of its size,
  ``prefix_copied_bytes = sum_b past_b * Hkv * D * itemsize`` and
  ``append_copied_bytes = B * S * Hkv * D * itemsize``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from onnxkv._kernels._record import current as _recorder
from onnxkv.errors import InputError
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._attention_math import (
    causal_attention,
    check_written,
    dense_attention,
    paged_causal_attention,
    position_bias,
)
from onnxkv.plan.ops._gqa_decode import fused_decode
from onnxkv.plan.ops._gqa_inputs import check_int32, check_past, row_lengths, scalar_total, split_qkv
from onnxkv.plan.ops._gqa_paged_decode import paged_decode
from onnxkv.plan.ops._gqa_segments import run_segments, segments_of
from onnxkv.plan.ops._gqa_window import keep, stage, window_end
from onnxkv.plan.ops.rotary import check_positions, rotate
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["GroupQueryAttention"]

_INPUTS = (
    "query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
    "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink",
    "k_scale", "v_scale", "q_norm_weight", "k_norm_weight", "query_seqlens",
)  # fmt: skip
_SUPPORTED_INPUTS = 12
_INT32_MAX = 2**31 - 1


@register("GroupQueryAttention", domain="com.microsoft")
class GroupQueryAttention(Op):
    """Kernel object of one GroupQueryAttention node (see the module docstring)."""

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        a = self.attrs
        self.num_heads = int(a.get("num_heads", 0))
        self.kv_num_heads = int(a.get("kv_num_heads", 0))
        if self.num_heads <= 0 or self.kv_num_heads <= 0:
            raise self.error(
                f"num_heads and kv_num_heads must be positive, got {self.num_heads} and {self.kv_num_heads}"
            )
        if self.num_heads % self.kv_num_heads:
            raise self.error(f"num_heads={self.num_heads} must be a multiple of kv_num_heads={self.kv_num_heads}")
        self.scale = float(a.get("scale", 0.0))
        self.softcap = float(a.get("softcap", 0.0))
        if self.softcap < 0:
            raise self.error(f"softcap must be >= 0, got {self.softcap}")
        self.do_rotary = bool(a.get("do_rotary", 0))
        self.interleaved = bool(a.get("rotary_interleaved", 0))
        window = int(a.get("local_window_size", -1))
        if not -1 <= window <= _INT32_MAX:  # ORT reads it as an int; -1 (and 0) mean no window
            raise self.error(f"local_window_size must be -1 (no window) or a window in [1, {_INT32_MAX}], got {window}")
        # ORT keeps the W most recent keys; the kernel's window counts keys before the query.
        self.window = window - 1 if window > 0 else -1
        self.smooth_softmax = bool(a.get("smooth_softmax", 0))
        self._reject_attr("qk_output", 0, "output_qk (qk_output != 0) is not supported")
        self._reject_attr("causal", 1, "non-causal (causal=0) attention is not supported")
        self.window_cache = int(a.get("sliding_window_cache", 0)) == 1
        if self.window_cache:  # ORT: only 1 turns it on
            if window <= 0:
                raise self.error(f"sliding_window_cache=1 needs a window (local_window_size >= 1), got {window}")
            if len(node.input) > 10 and node.input[10]:
                raise self.error("attention_bias is not supported with sliding_window_cache=1 (window-sized caches)")
        for name in ("k_quant_type", "v_quant_type"):
            if str(a.get(name, "NONE")).upper() != "NONE":
                raise self.error(f"quantized KV cache ({name}={a[name]!r}) is not supported")
        for pos in range(_SUPPORTED_INPUTS, len(node.input)):
            if node.input[pos]:
                raise self.error(f"input '{_INPUTS[pos] if pos < len(_INPUTS) else pos}' is not supported")
        if len(node.output) > 3 and node.output[3]:
            raise self.error("output 'output_qk' is not supported")
        self.has_present = tuple(i < len(node.output) and bool(node.output[i]) for i in (1, 2))
        self.bound = bool(ctx.bindings_for(node))
        self._past_names = (node.input[3], node.input[4]) if len(node.input) > 4 else ("", "")
        # Constant rotary tables (initializers) as float32 C-contiguous arrays, converted once: (cos, sin) as fed
        # -> (cos, sin) for the kernel.  A run fed other tables converts them itself.
        tables = [ctx.constant(node.input[i]) if len(node.input) > i and node.input[i] else None for i in (7, 8)]
        self._tables = None
        if self.do_rotary and all(isinstance(t, np.ndarray) for t in tables):
            self._tables = (tables[0], tables[1], *(np.ascontiguousarray(t, dtype=np.float32) for t in tables))

    def _reject_attr(self, name: str, default: int, message: str) -> None:
        if int(self.attrs.get(name, default)) != default:
            raise self.error(message)

    def _input_error(self, message: str) -> InputError:
        return InputError(f"{self.op_type} node '{self.name}': {message}")

    # -- run --------------------------------------------------------------------------------

    def compilable(self, inputs: list) -> bool:
        """A node bound to a state's caches may take the fused decode path, whose call a compiled step
        replays (:meth:`_decode_token` notes it); any other run refuses the recording."""
        return self.bound and not self.smooth_softmax

    #: Inputs a recorded decode call does not read (the past views: it writes the cache buffers directly).
    replay_unread = (3, 4)

    @property
    def takes_segments(self) -> bool:
        """Whether runs of segments may reach this node (:mod:`._gqa_segments`): bound to a state's cache,
        without attention_bias, head_sink or smooth_softmax."""
        inputs = self.node.input
        return self.bound and not self.smooth_softmax and not any(len(inputs) > i and inputs[i] for i in (10, 11))

    def run(self, inputs: list, rt: RunContext) -> Sequence[np.ndarray | None]:
        counts = segments_of(self, rt)
        if counts is not None:
            return run_segments(self, inputs, rt, counts)
        fast = self._decode_token(inputs, rt)
        if fast is None:
            fast = paged_decode(self, inputs, rt)  # notes its call on a recorder, as _decode_token does
        if fast is not None:
            return fast
        rec = _recorder()
        if rec is not None:
            rec.refused.append(f"{self.op_type} node '{self.name}': not a fused decode call")
            total = inputs[6] if len(inputs) > 6 else None
            query = inputs[0]
            if isinstance(total, np.ndarray) and total.size == 1 and getattr(query, "ndim", 0) == 3:
                rec.transient |= int(total.reshape(-1)[0]) == query.shape[1]  # a prompt: the shapes of a verification
        inputs = list(inputs) + [None] * (_SUPPORTED_INPUTS - len(inputs))
        query, key, value, past_key, past_value, seqlens_k, total_seqlen = inputs[:7]
        cos, sin, position_ids, attn_bias, head_sink = inputs[7:12]
        check_int32(self._input_error, "seqlens_k", seqlens_k)
        check_int32(self._input_error, "total_sequence_length", total_seqlen)

        q, k, v = split_qkv(self._input_error, self.num_heads, self.kv_num_heads, query, key, value)
        b, s, d = q.shape[0], q.shape[2], q.shape[3]
        dtype = query.dtype
        past_k_name, past_v_name = self._past_names
        in_place = self.bound and rt.in_place(past_k_name)
        if self.window_cache and not in_place:
            return self._run_window_cache(rt, q, k, v, inputs, dtype)
        # A state's cache may be stored narrower (float16/bfloat16) than the model's type.
        past_len = check_past(
            self._input_error, self.kv_num_heads, past_key, past_value, b, d, past_key.dtype if in_place else dtype
        )
        total = scalar_total(self._input_error, total_seqlen, past_len, s)
        first_prompt = s == total
        present_len = max(total, past_len)
        kv_len, past_lens = row_lengths(self._input_error, seqlens_k, b, s, total, past_len, first_prompt)
        if not first_prompt and s > 1 and b != 1 and (kv_len != kv_len[0]).any():
            # ONNX Runtime takes one row only here; rows of one length (a tree of speculative branches forked
            # from one sequence) are unambiguous: each continues its past with the same S tokens' positions
            raise self._input_error(
                f"batch_size must be 1, or every row's seqlens_k equal, when sequence_length={s} > 1 differs "
                f"from total_sequence_length={total}; got seqlens_k {(kv_len - 1).tolist()}"
            )
        if in_place and not first_prompt:
            check_written(
                self,
                rt.caches[past_k_name],
                past_lens,
                lambda row: f"seqlens_k[{row}]={int(kv_len[row]) - 1} with {s} new token(s)",
            )
        q_pos = past_lens[:, None] + np.arange(s)[None, :]

        if self.do_rotary:
            q, k = self._rotary(q, k, cos, sin, position_ids, q_pos, first_prompt)

        kv_dtype = None
        if in_place:
            # Shared-buffer mode: new rows go straight into the state's caches at past_b.
            present_k = rt.cache_write(past_k_name, k, past_lens, present_len)
            present_v = rt.cache_write(past_v_name, v, past_lens, present_len)
            if first_prompt and (kv_len < s).any():  # rows padded on the right hold their own positions only
                rt.cache_rows_hold(past_k_name, kv_len)  # one page table serves every plane: V's too
            ck, cv = rt.caches[past_k_name], rt.caches[past_v_name]
            keys, values = (None, None) if getattr(ck, "paged", False) else (ck.buffer, cv.buffer)
            if ck.storage == "bfloat16":
                kv_dtype = "bfloat16"
        else:
            present_k = self._present(rt, 1, past_key, k, past_lens, present_len, dtype)
            present_v = self._present(rt, 2, past_value, v, past_lens, present_len, dtype)
            keys, values = present_k, present_v

        output = self._attend(
            rt,
            q,
            keys,
            values,
            kv_len,
            q_pos,
            total,
            attn_bias,
            head_sink,
            dtype,
            (rt.caches[past_k_name], rt.caches[past_v_name]) if in_place else None,
            kv_dtype,
        )
        outs = (output, present_k if self.has_present[0] else None, present_v if self.has_present[1] else None)
        return outs[: len(self.node.output)]

    def _attend(
        self,
        rt: RunContext,
        q: np.ndarray,
        keys,
        values,
        kv_len: np.ndarray,
        q_pos: np.ndarray,
        total: int,
        attn_bias: np.ndarray | None,
        head_sink: np.ndarray | None,
        dtype: np.dtype,
        state: tuple | None = None,
        kv_dtype: str | None = None,
    ) -> np.ndarray:
        """The attention output [B, S, Hq*D] of ``dtype`` (output 0) of Q [B, Hq, S, D] over ``keys``/``values``.

        Query ``s`` of row ``b`` at position ``q_pos[b, s]`` sees the keys the
        module docstring's mask rule allows among the first ``kv_len[b]``;
        ``total`` bounds every ``kv_len``.  ``state`` is the state's (key,
        value) caches when the keys are read from them in place (a paged
        cache: ``keys``/``values`` None), stored as ``kv_dtype`` when narrow.
        """
        b, hq, s, d = q.shape
        output = rt.empty(0, (b, s, hq * d), dtype)
        # With one new token [B, Hq, 1, D] and [B, 1, Hq*D] are the same layout: the kernel writes the output.
        direct = s == 1 and dtype == np.float32
        out = output.reshape(b, hq, s, d) if direct else np.empty((b, hq, s, d), np.float32)
        sink = self._sink(head_sink)
        qf = q.astype(np.float32, copy=False)
        paged = state is not None and getattr(state[0], "paged", False)
        narrow = paged or kv_dtype is not None or (state is not None and keys.dtype == np.float16)
        kf, vf = (keys, values) if narrow else (t.astype(np.float32, copy=False) for t in (keys, values))
        scale = self._softmax_scale(d)
        if attn_bias is None and sink is None:
            if paged:
                rt.count(**paged_causal_attention(qf, *state, kv_len, q_pos, scale, self.softcap, self.window, out))
            else:
                causal_attention(qf, kf, vf, kv_len, q_pos, scale, self.softcap, self.window, out, kv_dtype)
        else:
            if narrow:
                kf, vf = state[0].as_float32(total), state[1].as_float32(total)
            bias = position_bias(kv_len, q_pos, total, self.window)
            if attn_bias is not None:
                bias = bias + self._check_bias(attn_bias, b, s, total)
            out[...], _ = dense_attention(qf, kf[:, :, :total], vf[:, :, :total], bias, scale, self.softcap, sink)
        if not direct:
            output.reshape(b, s, hq, d)[...] = out.transpose(0, 2, 1, 3)
        return output

    def _run_window_cache(
        self, rt: RunContext, q: np.ndarray, k: np.ndarray, v: np.ndarray, inputs: list, dtype: np.dtype
    ) -> Sequence[np.ndarray | None]:
        """The outputs of a ``sliding_window_cache=1`` node fed window-sized past buffers (:mod:`._gqa_window`).

        ``q`` [B, Hq, S, D], ``k``/``v`` [B, Hkv, S, D] as split; ``inputs`` the
        node's inputs.  The past buffers (capacity ``C >= local_window_size``)
        are required; ``seqlens_k[b] + 1`` is row ``b``'s absolute total, in
        ``[S, total_sequence_length]``.  Presents are [B, Hkv, C, D].
        """
        past_key, past_value, seqlens_k, total_seqlen = inputs[3:7]
        cos, sin, position_ids, _, head_sink = inputs[7:12]
        b, s, d = q.shape[0], q.shape[2], q.shape[3]
        w = self.window + 1
        if past_key is None or past_value is None:
            raise self._input_error(
                "sliding_window_cache=1 needs past_key and past_value (window-sized buffers of "
                f"at least local_window_size={w} positions)"
            )
        capacity = check_past(self._input_error, self.kv_num_heads, past_key, past_value, b, d, dtype)
        if capacity < w:
            raise self._input_error(
                f"sliding_window_cache=1 needs past buffers of at least local_window_size={w} positions, got {capacity}"
            )
        t = np.zeros(0) if total_seqlen is None else np.asarray(total_seqlen)
        if t.size != 1 or not s <= int(t.item()):
            raise self._input_error(
                f"total_sequence_length must be one int32 >= {s} (the new tokens), got {t.reshape(-1)[:4].tolist()}"
            )
        total = int(t.item())
        if seqlens_k is None or np.shape(seqlens_k) != (b,):
            raise self._input_error(f"seqlens_k must have shape ({b},), got {np.shape(seqlens_k)}")
        totals = np.asarray(seqlens_k, np.int64) + 1
        bad = (totals < s) | (totals > total)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise self._input_error(
                f"seqlens_k[{row}]={int(totals[row]) - 1} out of range: with a window-sized cache "
                f"it is the absolute total minus one, in [{s - 1}, {total - 1}] "
                f"(total_sequence_length={total}, {s} new tokens)"
            )
        past_lens = totals - s
        steps = np.arange(s)[None, :]
        if self.do_rotary:
            q, k = self._rotary(q, k, cos, sin, position_ids, past_lens[:, None] + steps, s == total)
        resident = window_end(past_lens, capacity, w)
        kept = window_end(totals, capacity, w)
        keys, values = stage(past_key, k, resident), stage(past_value, v, resident)
        presents = []
        for index, staged in ((1, keys), (2, values)):
            shape = (b, self.kv_num_heads, capacity, d)
            wanted = self.has_present[index - 1]
            present = rt.empty(index, shape, dtype) if wanted else np.empty(shape, dtype)
            keep(staged, resident, s, kept, present)
            if wanted:
                new_kept = np.minimum(kept, s)
                row = self.kv_num_heads * d * present.itemsize
                rt.count(
                    allocations=1,
                    allocated_bytes=present.nbytes,
                    prefix_copied_bytes=int((kept - new_kept).sum()) * row,
                    append_copied_bytes=int(new_kept.sum()) * row,
                )
            presents.append(present if wanted else None)
        output = self._attend(
            rt, q, keys, values, resident + s, resident[:, None] + steps, keys.shape[2], None, head_sink, dtype
        )
        return (output, *presents)[: len(self.node.output)]

    def _decode_token(self, inputs: list, rt: RunContext) -> tuple | None:
        """The fused decode call's outputs, or None for the general path (:func:`._gqa_decode.fused_decode`)."""
        return fused_decode(self, inputs, rt)

    def _softmax_scale(self, d: int) -> float:
        """The ``scale`` attribute, or ``1/sqrt(head_size)`` when it is 0."""
        return self.scale if self.scale != 0 else 1.0 / np.sqrt(d)

    def _rotary(
        self,
        q: np.ndarray,
        k: np.ndarray,
        cos: np.ndarray | None,
        sin: np.ndarray | None,
        position_ids: np.ndarray | None,
        q_pos: np.ndarray,
        first_prompt: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rotated float32 copies of Q and K ([B, H, S, D] each); float16 is rotated in float32."""
        if cos is None or sin is None:
            raise self._input_error("do_rotary=1 needs cos_cache and sin_cache")
        d = q.shape[3]
        if cos.ndim != 2 or cos.shape != sin.shape or 2 * cos.shape[1] > d or cos.dtype != q.dtype:
            raise self._input_error(
                f"cos_cache/sin_cache must be equal [max_pos, rot/2] {q.dtype} arrays with rot <= head_size={d}, "
                f"got {cos.shape} {cos.dtype} and {sin.shape} {sin.dtype}"
            )
        positions = q_pos
        if position_ids is not None:
            pid = np.asarray(position_ids)
            b, s = q_pos.shape
            if first_prompt and pid.size:
                positions = pid.reshape(-1)[0]  # the start of every row
            elif pid.shape == (b, s):
                positions = pid
            else:
                raise self._input_error(f"position_ids must have shape {(b, s)}, got {pid.shape}")
        positions = check_positions(self, positions, cos.shape[0], q_pos.shape)
        tables = self._tables
        if tables is not None and cos is tables[0] and sin is tables[1]:
            cos, sin = tables[2], tables[3]
        else:
            cos, sin = cos.astype(np.float32, copy=False), sin.astype(np.float32, copy=False)
        rotated = []
        for t in (q, k):
            x = t.transpose(0, 2, 1, 3).astype(np.float32, copy=False)  # [B, S, H, D]
            out = np.empty(x.shape, np.float32)
            rotate(x, cos, sin, positions, self.interleaved, out)
            rotated.append(out.transpose(0, 2, 1, 3))
        return rotated[0], rotated[1]

    def _present(
        self,
        rt: RunContext,
        index: int,
        past: np.ndarray | None,
        new: np.ndarray,
        past_lens: np.ndarray,
        present_len: int,
        dtype: np.dtype,
    ) -> np.ndarray:
        """Build present ``index`` (1 key, 2 value) of ``dtype``: zeros, past prefix, then the new rows."""
        b, hkv, s, d = new.shape
        wanted = self.has_present[index - 1]
        shape = (b, hkv, present_len, d)
        present = rt.empty(index, shape, dtype) if wanted else np.empty(shape, dtype)
        present.fill(0)
        for row in range(b):
            p = int(past_lens[row])
            if p:
                present[row, :, :p] = past[row, :, :p]
            present[row, :, p : p + s] = new[row]
        if wanted:
            item = present.itemsize
            rt.count(
                allocations=1,
                allocated_bytes=present.nbytes,
                prefix_copied_bytes=int(past_lens.sum()) * hkv * d * item,
                append_copied_bytes=b * s * hkv * d * item,
            )
        return present

    def _sink(self, head_sink: np.ndarray | None) -> np.ndarray | None:
        if head_sink is not None:
            if np.shape(head_sink) != (self.num_heads,):
                raise self._input_error(f"head_sink must have shape ({self.num_heads},), got {np.shape(head_sink)}")
            return np.asarray(head_sink, np.float32)
        return np.zeros(self.num_heads, np.float32) if self.smooth_softmax else None

    def _check_bias(self, bias: np.ndarray, b: int, s: int, total: int) -> np.ndarray:
        shape = bias.shape
        if (
            bias.ndim != 4
            or shape[0] not in (1, b)
            or shape[1] not in (1, self.num_heads)
            or shape[2] != s
            or shape[3] < total
        ):
            raise self._input_error(f"attention_bias must be [batch|1, num_heads|1, {s}, >= {total}], got {shape}")
        return bias[..., :total].astype(np.float32, copy=False)
