"""Decoder hyper-parameters shared by every model builder.

A ``DecoderConfig`` describes a Llama-style decoder: token embedding, ``num_layers``
blocks of (RMSNorm -> grouped-query self-attention with rotary embeddings ->
residual -> RMSNorm -> SiLU-gated MLP -> residual), a final RMSNorm and an
untied LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecoderConfig", "MICRO", "TINY", "SMALL"]


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of a decoder model. ``head_size`` defaults to ``hidden_size // num_heads``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_length: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    head_size: int | None = None
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_length",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_size is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_size", self.hidden_size // self.num_heads)
        if not isinstance(self.head_size, int) or self.head_size <= 0 or self.head_size % 2:
            raise ValueError(f"head_size must be a positive even int, got {self.head_size!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection, ``num_heads * head_size``."""
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of the key and of the value projection, ``num_kv_heads * head_size``."""
        return self.num_kv_heads * self.head_size


MICRO = DecoderConfig(
    vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_length=128
)
TINY = DecoderConfig(vocab_size=1000, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=688)
SMALL = DecoderConfig(
    vocab_size=8000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=2816
)
