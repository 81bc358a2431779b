"""Public names of the model builders and a ``build_model`` dispatcher over graph forms."""

from __future__ import annotations

import onnx

from .attention23 import build_attention_model
from .concat import build_concat_model
from .config import MICRO, SMALL, TINY, DecoderConfig
from .gqa import build_gqa_model, genai_config, save_genai_folder
from .reference import default_position_ids, reference_forward
from .tensorscatter import build_tensorscatter_model
from .weights import DecoderWeights, LayerWeights, random_weights, rotary_cache

__all__ = [
    "DecoderConfig",
    "MICRO",
    "TINY",
    "SMALL",
    "DecoderWeights",
    "LayerWeights",
    "random_weights",
    "rotary_cache",
    "build_gqa_model",
    "genai_config",
    "save_genai_folder",
    "build_attention_model",
    "build_concat_model",
    "build_tensorscatter_model",
    "reference_forward",
    "default_position_ids",
    "FAMILIES",
    "build_model",
]

FAMILIES = ("gqa", "attention", "concat", "tensorscatter")


def build_model(
    family: str, cfg: DecoderConfig, seed: int = 0, weights: DecoderWeights | None = None
) -> onnx.ModelProto:
    """Build ``family`` (one of :data:`FAMILIES`) with ``weights`` or ``random_weights(cfg, seed)``."""
    builders = {
        "gqa": build_gqa_model,
        "attention": build_attention_model,
        "concat": build_concat_model,
        "tensorscatter": build_tensorscatter_model,
    }
    if family not in builders:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    return builders[family](cfg, weights, seed)
