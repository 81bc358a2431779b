"""Many requests over one session: :class:`Engine` and its :class:`Request` (see :mod:`onnxkv.engine.engine`)."""

from onnxkv.engine.engine import DEFAULT_MAX_BATCH_TOKENS, Engine
from onnxkv.engine.request import Request

__all__ = ["Engine", "Request", "DEFAULT_MAX_BATCH_TOKENS"]
