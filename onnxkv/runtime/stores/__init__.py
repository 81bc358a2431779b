"""Storage strategies of a :class:`~onnxkv.runtime.state.State` (see :mod:`onnxkv.runtime.stores.protocol`)."""

from onnxkv.runtime.stores.checkpoint import Checkpoint
from onnxkv.runtime.stores.contiguous import ContiguousStore
from onnxkv.runtime.stores.declared import DeclaredStore
from onnxkv.runtime.stores.paged import PagedStore
from onnxkv.runtime.stores.protocol import Store, StoreContext

__all__ = ["Store", "StoreContext", "ContiguousStore", "PagedStore", "DeclaredStore", "Checkpoint"]
