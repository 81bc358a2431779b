"""Sessions (and, later, per-request states)."""

from onnxkv.runtime.session import Session

__all__ = ["Session"]
