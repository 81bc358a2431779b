"""Plain NumPy forward pass of the decoder: the oracle every graph form must match.

The cache follows the Concat convention: ``present[i] = concat(past[i], new, axis=2)``
with K/V of shape ``[batch, num_kv_heads, seq, head_size]``. Arithmetic is float64;
outputs are float32.
"""

from __future__ import annotations

import numpy as np

from .config import DecoderConfig
from .weights import DecoderWeights, rotary_cache

__all__ = ["reference_forward", "default_position_ids"]

KV = tuple[np.ndarray, np.ndarray]


def default_position_ids(attention_mask: np.ndarray, seq_len: int) -> np.ndarray:
    """Positions of the last ``seq_len`` tokens: ``max(cumsum(mask) - 1, 0)`` (left padding safe)."""
    positions = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0)
    return positions[:, -seq_len:].astype(np.int64)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Non-interleaved RoPE on ``x`` [B, N, S, D] with ``cos``/``sin`` [B, 1, S, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, group: int) -> np.ndarray:
    """Masked softmax attention; q [B,H,S,D], k/v [B,KV,T,D], allowed [B,1,S,T]. Empty rows give 0."""
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    probs = np.exp(scores - row_max)
    total = probs.sum(axis=-1, keepdims=True)
    probs = np.divide(probs, total, out=np.zeros_like(probs), where=total > 0)
    return probs @ v


def reference_forward(
    cfg: DecoderConfig,
    weights: DecoderWeights,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
    past: list[KV] | None = None,
) -> tuple[np.ndarray, list[KV]]:
    """Run the decoder on ``input_ids`` [B, S] after ``past`` (per layer ``(key, value)``,
    each [B, KV, P, D]; default empty).

    ``attention_mask`` [B, P + S] marks real tokens with 1 (default all ones);
    ``position_ids`` [B, S] default to :func:`default_position_ids`. Query ``i`` attends key
    ``j`` iff ``mask[b, j] == 1`` and ``j <= P + i``. Returns ``logits`` [B, S, vocab] and
    ``present`` (per layer ``(key, value)`` [B, KV, P + S, D]), float32.
    """
    input_ids = np.asarray(input_ids, dtype=np.int64)
    batch, seq = input_ids.shape
    past_len = 0 if past is None else past[0][0].shape[2]
    total = past_len + seq
    if attention_mask is None:
        attention_mask = np.ones((batch, total), dtype=np.int64)
    if attention_mask.shape != (batch, total):
        raise ValueError(f"attention_mask shape {attention_mask.shape} != {(batch, total)}")
    if position_ids is None:
        position_ids = default_position_ids(attention_mask, seq)

    cos_table, sin_table = rotary_cache(cfg)
    cos = cos_table[position_ids][:, None].astype(np.float64)
    sin = sin_table[position_ids][:, None].astype(np.float64)
    causal = np.arange(total)[None, :] <= past_len + np.arange(seq)[:, None]
    allowed = causal[None, None] & (attention_mask[:, None, None, :] != 0)

    def heads(x: np.ndarray, n: int) -> np.ndarray:
        return x.reshape(batch, seq, n, cfg.head_size).transpose(0, 2, 1, 3)

    x = weights.embed[input_ids].astype(np.float64)
    present: list[KV] = []
    for i, lw in enumerate(weights.layers):
        h = _rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
        q = _rotate(heads(h @ lw.q_proj, cfg.num_heads), cos, sin)
        k = _rotate(heads(h @ lw.k_proj, cfg.num_kv_heads), cos, sin)
        v = heads(h @ lw.v_proj, cfg.num_kv_heads)
        if past is not None:
            k = np.concatenate([past[i][0], k], axis=2)
            v = np.concatenate([past[i][1], v], axis=2)
        present.append((k.astype(np.float32), v.astype(np.float32)))
        attn = _attend(q, k, v, allowed, cfg.group_size)
        x = x + attn.transpose(0, 2, 1, 3).reshape(batch, seq, cfg.q_size) @ lw.o_proj
        h = _rms_norm(x, lw.post_attn_norm, cfg.rms_norm_eps)
        gate = h @ lw.gate_proj
        x = x + (gate / (1.0 + np.exp(-gate)) * (h @ lw.up_proj)) @ lw.down_proj
    logits = _rms_norm(x, weights.final_norm, cfg.rms_norm_eps) @ weights.lm_head
    return logits.astype(np.float32), present
