"""Sessions and per-request states."""

from onnxkv.runtime.cache_config import CacheConfig, KeyLayout
from onnxkv.runtime.session import Session
from onnxkv.runtime.state import Cancellation, Checkpoint, State

__all__ = ["Session", "State", "Checkpoint", "Cancellation", "CacheConfig", "KeyLayout"]
