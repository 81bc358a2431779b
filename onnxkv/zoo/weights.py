"""Random decoder weights and rotary tables shared by every graph form.

Projection matrices are stored ``[in_features, out_features]`` (``y = x @ W``), which is
the transpose of a ``torch.nn.Linear`` weight and exactly the ``MatMul`` initializer layout
the ONNX Runtime GenAI builder writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DecoderConfig

__all__ = ["DecoderWeights", "LayerWeights", "random_weights", "rotary_cache"]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder block (float32). Norm weights are ``[hidden]``."""

    input_norm: np.ndarray  # [hidden]
    q_proj: np.ndarray  # [hidden, num_heads * head_size]
    k_proj: np.ndarray  # [hidden, num_kv_heads * head_size]
    v_proj: np.ndarray  # [hidden, num_kv_heads * head_size]
    o_proj: np.ndarray  # [num_heads * head_size, hidden]
    post_attn_norm: np.ndarray  # [hidden]
    gate_proj: np.ndarray  # [hidden, intermediate]
    up_proj: np.ndarray  # [hidden, intermediate]
    down_proj: np.ndarray  # [intermediate, hidden]


@dataclass(frozen=True)
class DecoderWeights:
    """All weights of a decoder (float32)."""

    embed: np.ndarray  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [hidden, vocab]


def random_weights(cfg: DecoderConfig, seed: int = 0) -> DecoderWeights:
    """Draw reproducible weights for ``cfg``.

    Projections use std ``1/sqrt(fan_in)`` (0.0625 for TINY, 0.031 for SMALL) so that
    attention scores are far from uniform and masking mistakes change the logits; norm
    weights are ``1 + 0.1 * N(0, 1)`` so that they are not all one.
    """
    rng = np.random.default_rng(seed)

    def dense(fan_in: int, fan_out: int) -> np.ndarray:
        return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(cfg.hidden_size)).astype(np.float32)

    h = cfg.hidden_size
    embed = rng.standard_normal((cfg.vocab_size, h)).astype(np.float32)
    layers = tuple(
        LayerWeights(
            input_norm=norm(),
            q_proj=dense(h, cfg.q_size),
            k_proj=dense(h, cfg.kv_size),
            v_proj=dense(h, cfg.kv_size),
            o_proj=dense(cfg.q_size, h),
            post_attn_norm=norm(),
            gate_proj=dense(h, cfg.intermediate_size),
            up_proj=dense(h, cfg.intermediate_size),
            down_proj=dense(cfg.intermediate_size, h),
        )
        for _ in range(cfg.num_layers)
    )
    return DecoderWeights(embed=embed, layers=layers, final_norm=norm(), lm_head=dense(h, cfg.vocab_size))


def rotary_cache(cfg: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """Non-interleaved RoPE tables ``cos, sin`` of shape ``[max_length, head_size // 2]`` (float32).

    Row ``p`` holds ``cos(p * theta**(-2i/head_size))`` for ``i < head_size // 2``: the
    ``cos_cache``/``sin_cache`` initializers of the GenAI builder.
    """
    d = cfg.head_size
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    freqs = np.outer(np.arange(cfg.max_length, dtype=np.float64), inv_freq)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
