"""``onnxkv.contract``: the serialised alias and persistence contract.

Reads and writes ``NodeProto.output_alias``, ``ValueInfoProto.access`` /
``alias_of`` and ``GraphProto.persistent_bindings`` (protobuf fields ≥ 1000 on
the standard messages; see :mod:`onnxkv.model.contract` for the table) and
checks them (:func:`check_model`).
"""

from onnxkv.model.checker import check_model
from onnxkv.model.contract import (
    MUST_ALIAS,
    Access,
    Contract,
    ContractError,
    OutputAlias,
    get_access,
    get_alias_of,
    get_output_alias,
    get_persistent_bindings,
    set_access,
    set_alias_of,
    set_output_alias,
    set_persistent_bindings,
)
from onnxkv.model.shape_inference import infer_shapes

__all__ = [
    "MUST_ALIAS",
    "Access",
    "Contract",
    "ContractError",
    "OutputAlias",
    "check_model",
    "infer_shapes",
    "get_access",
    "get_alias_of",
    "get_output_alias",
    "get_persistent_bindings",
    "set_access",
    "set_alias_of",
    "set_output_alias",
    "set_persistent_bindings",
]
