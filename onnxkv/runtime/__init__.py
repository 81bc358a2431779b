"""Sessions and per-request states."""

from onnxkv.runtime.session import Session
from onnxkv.runtime.state import Cancellation, State

__all__ = ["Session", "State", "Cancellation"]
