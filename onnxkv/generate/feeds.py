"""Building a decoder's feeds step by step, as each model family needs them.

A :class:`FeedBuilder` turns a batch of prompts (left-padded, HF style, with
an attention mask) into the inputs of the first run, and after every run
into the inputs of the next one, threading the cache from ``present.*``
outputs to ``past.*`` inputs as ordinary tensors.

Layouts by family:

* ``concat`` / ``attention`` (HF-style graphs): the prompt is fed
  left-padded; ``attention_mask`` grows by one column per step;
  ``position_ids = cumsum(mask) - 1`` (1 on pads, as transformers does).
* ``group_query_attention`` (GenAI graphs): GroupQueryAttention derives
  ``seqlens_k`` from the number of ones in ``attention_mask`` and expects each
  row's tokens *first* (right padding), so the prompt is re-laid out
  right-padded; the logits of row b are read at its own last token.
* ``tensor_scatter`` (static cache of fixed capacity): the cache is allocated
  once at capacity; ``write_indices`` and ``nonpad_kv_seqlen`` say where each
  row writes and how much of it is valid (right padding).
* ``none``: no cache; the whole sequence is fed every step.
"""

from __future__ import annotations

import numpy as np

from onnxkv.errors import InputError
from onnxkv.plan.step_loop import DecodeNames

__all__ = ["FeedBuilder"]


class FeedBuilder:
    """Feeds for one generation.

    Args:
        plan_inputs: the plan's :class:`~onnxkv.plan.plan.GraphInput` list.
        model: the :class:`~onnxkv.model.Model`.
        prompt: int64 [B, L] left-padded prompt ids.
        lengths: int64 [B] number of real tokens per row.
        pad_id: id written into padding positions.
        thread_cache: feed ``past.*`` from the previous ``present.*`` outputs
            (tensor path); False when a state supplies the cache.
    """

    def __init__(
        self, plan_inputs, model, prompt: np.ndarray, lengths: np.ndarray, pad_id: int, thread_cache: bool = True
    ) -> None:
        self.model = model
        self.conv = model.convention
        self.io = model.io
        self.kind = self.conv.kind
        self.dtypes = {g.name: g.dtype for g in plan_inputs}
        self.shapes = {g.name: g.shape for g in plan_inputs}
        self.batch, self.prompt_len = prompt.shape
        self.lengths = lengths.astype(np.int64)
        self.pad_id = pad_id
        self.prompt = prompt
        self.thread_cache = thread_cache
        self.right_padded = self.kind in ("group_query_attention", "tensor_scatter")
        self.total = 0  # columns of the attention mask / tokens fed so far
        self.history = prompt.copy()  # used when there is no cache
        #: The attention mask's storage: int64 [B, capacity], its first :attr:`total` columns valid (grown by
        #: doubling, so a step writes its new columns in place instead of copying the mask); None before
        #: :meth:`first`.
        self._mbuf: np.ndarray | None = None
        #: int64 [B]: the ones of each row of the mask (the row's tokens in the cache).
        self._ones = np.zeros(self.batch, dtype=np.int64)
        known = {self.io.input_ids, self.io.attention_mask, self.io.position_ids, *self.conv.past_inputs}
        known.discard(None)
        if self.kind == "tensor_scatter":
            if self.conv.capacity is None:
                raise InputError("generate: the static (TensorScatter) cache has no fixed capacity in the model")
            known.update(n for n in self.dtypes if n.startswith(("write_indices", "nonpad_kv_seqlen")))
        required = [g.name for g in plan_inputs if not g.has_default and g.name not in known]
        if required:
            raise InputError(f"generate: the model needs inputs generate cannot make: {required}")
        if self.io.input_ids is None:
            raise InputError("generate: the model has no 'input_ids' input")

    # -- helpers -------------------------------------------------------
    def _cast(self, name: str, value: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(value.astype(self.dtypes[name], copy=False))

    def _empty_past(self, name: str) -> np.ndarray:
        shape = self.shapes.get(name)
        kv = self.conv.kv_heads or (shape[1] if shape and isinstance(shape[1], int) else None)
        hs = self.conv.head_size or (shape[3] if shape and isinstance(shape[3], int) else None)
        if kv is None or hs is None:
            raise InputError(f"generate: cannot tell the KV heads / head size of '{name}' from the model")
        length = self.conv.capacity if self.kind == "tensor_scatter" else 0
        layer = next(x for x in self.conv.layers if name in (x.past_key, x.past_value))
        if layer.window_cache:  # a window-sized buffer (sliding_window_cache=1) starts as one window of zeros
            length = layer.window
        return np.zeros((self.batch, kv, length, hs), dtype=self.dtypes[name])

    @property
    def mask(self) -> np.ndarray:
        """The attention mask fed so far: int64 [B, total], a view of the builder's storage (the next
        step writes past it in place; copy it to keep it)."""
        return self._mbuf[:, : self.total]

    def _set_mask(self, mask: np.ndarray) -> None:
        """Store ``mask`` (int64 [B, total]) as the mask so far, with room to grow."""
        rows, cols = mask.shape
        self._mbuf = np.zeros((rows, max(2 * cols, cols + 64)), dtype=np.int64)
        self._mbuf[:, :cols] = mask
        self._ones = mask.sum(axis=1, dtype=np.int64)

    def _mask_feed(self, mask: np.ndarray) -> np.ndarray:
        """``mask`` cast to the attention mask input's dtype, as a new C-contiguous array (never a view of
        the builder's storage, which later steps write)."""
        return np.array(mask, dtype=self.dtypes[self.io.attention_mask], order="C")

    # -- steps ---------------------------------------------------------
    def first(self) -> tuple[dict, np.ndarray]:
        """Feeds of the prefill run and, per row, the logits position to read."""
        B, L = self.batch, self.prompt_len
        feeds: dict[str, np.ndarray] = {}
        if self.kind == "none":
            return self._full_sequence_feeds(), np.full(B, L - 1)
        if self.right_padded:
            # columns past the longest row are padding in every row: left out, so that the mask is as wide
            # as the longest row (a paged state's cache holds each row's tokens only, no padding after them)
            L = int(self.lengths.max())
            ids = np.full((B, L), self.pad_id, dtype=np.int64)
            mask = np.zeros((B, L), dtype=np.int64)
            for b in range(B):
                n = int(self.lengths[b])
                ids[b, :n] = self.prompt[b, self.prompt_len - n :]
                mask[b, :n] = 1
            read = self.lengths - 1
            pos = np.where(mask == 1, np.arange(L)[None, :], 0)
        else:
            ids = self.prompt
            mask = (np.arange(L)[None, :] >= (L - self.lengths)[:, None]).astype(np.int64)
            pos = np.cumsum(mask, axis=1) - 1
            pos = np.where(mask == 0, 1, pos)
            read = np.full(B, L - 1)
        self.total = L
        self._set_mask(mask)
        feeds[self.io.input_ids] = self._cast(self.io.input_ids, ids)
        if self.kind == "tensor_scatter":
            pos = np.broadcast_to(np.arange(L), (B, L))
            mask = self._static_mask(self.lengths)
        if self.io.attention_mask:
            feeds[self.io.attention_mask] = self._mask_feed(mask)
        if self.io.position_ids:
            feeds[self.io.position_ids] = self._cast(self.io.position_ids, pos)
        if self.thread_cache:
            for name in self.conv.past_inputs:
                feeds[name] = self._empty_past(name)
        if self.kind == "tensor_scatter":
            self._scatter_feeds(feeds, np.zeros(B, np.int64), self.lengths)
        return feeds, read

    def next(self, tokens: np.ndarray, outputs: dict) -> dict:
        """Feeds of the run that consumes ``tokens`` ([B] or [B, S]) given the previous run's outputs.

        Several tokens per row continue a prompt in chunks (rows must then
        share one length unless S is 1).
        """
        B = self.batch
        tokens = tokens[:, None] if tokens.ndim == 1 else tokens
        S = tokens.shape[1]
        if self.kind == "none":
            self.history = np.concatenate([self.history, tokens], axis=1)
            return self._full_sequence_feeds()
        feeds: dict[str, np.ndarray] = {self.io.input_ids: self._cast(self.io.input_ids, tokens)}
        total, valid = self.total, self._ones  # valid: tokens already in the cache per row
        if total + S > self._mbuf.shape[1]:
            grown = np.zeros((B, 2 * (total + S)), dtype=np.int64)
            grown[:, :total] = self._mbuf[:, :total]
            self._mbuf = grown
        buf = self._mbuf
        if B == 1:
            v = int(valid[0])
            pos = np.arange(v, v + S, dtype=np.int64)[None, :]
        else:
            pos = valid[:, None] + np.arange(S)[None, :]
        if not self.right_padded:
            buf[:, total : total + S] = 1
        else:  # each row's new tokens right after its own
            buf[:, total : total + S] = 0
            if B == 1:
                buf[0, v : v + S] = 1
            else:
                buf[np.arange(B)[:, None], pos] = 1
        self.total = total + S
        self._ones = valid + S
        if self.io.attention_mask:
            mask = self._static_mask(valid + S) if self.kind == "tensor_scatter" else self.mask
            feeds[self.io.attention_mask] = self._mask_feed(mask)
        if self.io.position_ids:
            feeds[self.io.position_ids] = self._cast(self.io.position_ids, pos)
        if self.thread_cache:
            for layer in self.conv.layers:
                feeds[layer.past_key] = outputs[layer.present_key]
                feeds[layer.past_value] = outputs[layer.present_value]
        if self.kind == "tensor_scatter":
            self._scatter_feeds(feeds, valid, valid + S)
        return feeds

    def ragged(self, tokens: np.ndarray, lengths: np.ndarray) -> dict:
        """Feeds of ``tokens`` (int [B] one per row, or [B, S]) for rows that hold ``lengths`` (int [B])
        cached tokens each, rows of different generations batched into one run, built from the lengths
        alone (this builder's own rows are neither read nor changed); positions ``length .. length + S - 1``.

        * GroupQueryAttention (right padded): mask ones on each row's first ``length + S`` columns.
        * Attention (HF style, in a state): the graph's keys are the longest row's ``max(lengths)``
          positions and then the new ones, so the mask has ones on each row's first ``length`` columns and
          on the last ``S``, zeros on the columns the row never wrote between them (the Attention kernel
          then stores the row's new keys after its own: :func:`onnxkv.plan.ops.attention_onnx.ragged_mask`).

        Several tokens per row need rows of one length.  InputError for any other graph form."""
        if self.kind not in ("group_query_attention", "attention"):
            raise InputError(
                f"FeedBuilder.ragged: needs a GroupQueryAttention or Attention graph, this one is '{self.kind}'"
            )
        lengths = np.asarray(lengths, np.int64)
        tokens = np.asarray(tokens)
        tokens = tokens[:, None] if tokens.ndim == 1 else tokens
        S = tokens.shape[1]
        if S > 1 and (lengths != lengths[0]).any():
            raise InputError(f"FeedBuilder.ragged: {S} tokens per row need rows of one length, got {lengths.tolist()}")
        feeds = {self.io.input_ids: self._cast(self.io.input_ids, tokens)}
        if self.io.attention_mask:
            longest = int(lengths.max())
            cols = np.arange(longest + S)[None, :]
            if self.kind == "group_query_attention":
                mask = cols < (lengths + S)[:, None]
            else:
                mask = (cols < lengths[:, None]) | (cols >= longest)
            feeds[self.io.attention_mask] = self._cast(self.io.attention_mask, mask.astype(np.int64))
        if self.io.position_ids:
            feeds[self.io.position_ids] = self._cast(self.io.position_ids, lengths[:, None] + np.arange(S)[None, :])
        return feeds

    @property
    def decode_names(self) -> DecodeNames | None:
        """The values :meth:`State.decode_steps <onnxkv.runtime.state.State.decode_steps>` makes for the
        steps :meth:`next` would feed one token at a time (None: the model has no attention mask)."""
        io = self.io
        if io.attention_mask is None:
            return None
        return DecodeNames(io.input_ids, io.attention_mask, io.logits, io.position_ids)

    def select_rows(self, indices) -> None:
        """Make row ``i`` of every later feed continue old row ``indices[i]`` (beam search).

        ``indices``: int [N], N ≥ 1, each in ``[0, batch)``; N may differ from
        the batch (``np.repeat(np.arange(B), k)`` expands B rows to k beams
        each).  Every piece of per-row bookkeeping (prompt, lengths, mask,
        history, batch) is gathered alike; the cache itself is the caller's
        (a state's ``reorder`` or the presents fed to :meth:`next`).
        """
        idx = np.asarray(indices)
        if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
            raise InputError(
                f"FeedBuilder.select_rows: indices must be a non-empty 1-D int array, got "
                f"shape {idx.shape} dtype {idx.dtype}"
            )
        if idx.min() < 0 or idx.max() >= self.batch:
            raise InputError(
                f"FeedBuilder.select_rows: indices must be in [0, {self.batch}), got min {idx.min()}, max {idx.max()}"
            )
        self.batch = int(idx.size)
        self.prompt = self.prompt[idx]
        self.lengths = self.lengths[idx]
        self.history = self.history[idx]
        if self._mbuf is not None:
            self._set_mask(self.mask[idx])

    def _full_sequence_feeds(self) -> dict:
        ids = self.history
        B, L = ids.shape
        mask = (np.arange(L)[None, :] >= (self.prompt_len - self.lengths)[:, None]).astype(np.int64)
        feeds = {self.io.input_ids: self._cast(self.io.input_ids, ids)}
        if self.io.attention_mask:
            feeds[self.io.attention_mask] = self._cast(self.io.attention_mask, mask)
        if self.io.position_ids:
            pos = np.where(mask == 0, 1, np.cumsum(mask, axis=1) - 1)
            feeds[self.io.position_ids] = self._cast(self.io.position_ids, pos)
        return feeds

    def _static_mask(self, valid: np.ndarray) -> np.ndarray:
        """[B, capacity] mask with ones on each row's first ``valid[b]`` cache slots."""
        cap = self.conv.capacity
        if int(valid.max()) > cap:
            raise InputError(f"generate: static cache capacity {cap} exceeded (need {int(valid.max())})")
        return (np.arange(cap)[None, :] < valid[:, None]).astype(np.int64)

    def _scatter_feeds(self, feeds: dict, write_at: np.ndarray, valid_after: np.ndarray) -> None:
        for name in self.dtypes:
            if name.startswith("write_indices"):
                feeds[name] = self._cast(name, write_at)
            elif name.startswith("nonpad_kv_seqlen"):
                feeds[name] = self._cast(name, valid_after)

    def rewind(self, total: int) -> None:
        """Forget every fed position at and after ``total`` (speculative decoding's rollback).

        Drops the attention-mask columns (and, for a model without a cache, the
        token history) past ``total`` fed positions and sets :attr:`total` to it,
        so the next :meth:`next` continues from position ``total``; pair it with
        ``State.truncate(total)`` on the state that holds the cache.  Exact when
        the rows share one length (batch 1 or an unpadded batch), like
        ``State.truncate``.  ``total`` must be in ``[0, fed]`` (``[prompt length,
        fed]`` without a cache), where ``fed`` counts the positions fed so far.

        Raises:
            InputError: ``total`` is not an int in that range.
        """
        fed = self.history.shape[1] if self.kind == "none" else self.total
        low = self.prompt_len if self.kind == "none" else 0
        if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or not low <= total <= fed:
            raise InputError(f"FeedBuilder.rewind: total must be an int in [{low}, {fed}], got {total!r}")
        if total == fed:
            return
        if self.kind == "none":
            self.history = self.history[:, :total]
        else:
            self.total = int(total)
            self._ones = self.mask.sum(axis=1, dtype=np.int64)
