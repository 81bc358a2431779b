"""Exception types shared by every onnxkv package.

This module imports nothing from onnxkv so that every layer (``alloc``,
``cache``, ``plan``, ``runtime``) can raise and catch the same classes.
"""

from __future__ import annotations

__all__ = [
    "OnnxkvError",
    "ModelError",
    "UnsupportedOperatorError",
    "ContractError",
    "InputError",
    "SerializationError",
    "SegmentsRefused",
    "OperatorError",
    "OutOfMemory",
    "CacheCapacityError",
    "StateError",
    "Cancelled",
]


class OnnxkvError(Exception):
    """Base class of every error onnxkv raises on purpose."""


class ModelError(OnnxkvError, ValueError):
    """The model file or graph is malformed or uses something onnxkv cannot run."""


class UnsupportedOperatorError(ModelError):
    """An operator in an unknown domain (or without any implementation) was found at load time."""


class ContractError(ModelError):
    """The model's serialised alias/persistence contract is malformed or violated."""


class InputError(OnnxkvError, ValueError):
    """A feed, argument or option given by the caller is invalid."""


class SerializationError(InputError):
    """A serialised KV cache is malformed, truncated or of another format, or a snapshot to write breaks a rule."""


class SegmentsRefused(InputError):
    """An attention node cannot take this run of segments (``State.run(segments=...)``): its graph gave it
    something other than plain causal attention over the run's token axis.  Nothing was written; the same
    rows run one at a time (:class:`~onnxkv.Engine` then does so for the model's steps)."""


class OperatorError(OnnxkvError, RuntimeError):
    """An operator failed while running; the message names the node and operator."""


class OutOfMemory(OnnxkvError, MemoryError):
    """An allocator could not satisfy a request; nothing was allocated or written."""


class CacheCapacityError(OnnxkvError, ValueError):
    """A KV cache would grow past its fixed capacity; nothing was written."""


class StateError(OnnxkvError, RuntimeError):
    """A state was used wrongly: closed, busy with another call, or fed a bound input."""


class Cancelled(OnnxkvError):
    """A run was cancelled through its :class:`onnxkv.Cancellation` token; nothing was published."""
