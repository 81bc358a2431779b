"""Model loading, cache conventions and (later) the alias contract."""

from onnxkv.model.convention import CacheConvention, CacheLayer, recognize_cache
from onnxkv.model.load import KNOWN_DOMAINS, Model, ModelIO, load

__all__ = ["CacheConvention", "CacheLayer", "recognize_cache", "Model", "ModelIO", "load", "KNOWN_DOMAINS"]
