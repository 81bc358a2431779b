"""A node's subgraph (``If`` branches, ``Loop``/``Scan`` bodies) as a model of its own, for a nested plan.

:func:`subgraph_model` wraps a subgraph into a ``ModelProto`` that
:class:`~onnxkv.plan.plan.Plan` builds like a main graph, with the scope the
subgraph is nested in resolved:

* the names it reads from enclosing scopes
  (:func:`~onnxkv.model.scopes.scope_names`: node inputs at any depth and
  graph outputs it does not define) are its *scope*;
* scope values known while the enclosing plan is built (initializers and
  folded constants, but not graph inputs with a default, which a feed may
  override) become initializers of the wrapper, held outside the proto as
  external data are (no copy), so kernels inside fold and pack them;
* the others are fed at run time after the subgraph's own inputs (the
  nested plan's ``scope``).

Declared types: onnxkv runs tensor values only, so a subgraph input or
output declared as a sequence, optional, map or sparse tensor is a
:class:`~onnxkv.errors.ModelError` naming the node, attribute, value and
type; an untyped one (as function expansions make) is a tensor of any
element type.  Declared input *shapes* are dropped: ONNX
does not bind a subgraph input to them (a loop-carried value may change
shape from one iteration to the next), so the nested plan must not fold
shapes from them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
import onnx
from onnx import helper

from onnxkv.errors import ModelError
from onnxkv.model.scopes import scope_names

__all__ = ["subgraph_model", "type_kind"]


def type_kind(t: onnx.TypeProto) -> str | None:
    """What a declared type is when it is not a tensor ("a sequence", ...; None for a tensor or no type)."""
    which = t.WhichOneof("value")
    if which in ("tensor_type", None):
        return None
    return {
        "sequence_type": "a sequence",
        "optional_type": "an optional",
        "map_type": "a map",
        "sparse_tensor_type": "a sparse tensor",
    }.get(which, which)


def subgraph_model(
    graph: onnx.GraphProto,
    opsets: Mapping[str, int],
    constants: Mapping[str, np.ndarray | None],
    overridable: Collection[str],
    where: str,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[str]]:
    """``graph`` as a model: (model, external arrays of its scope constants, scope names fed at run time).

    ``opsets`` are the enclosing model's; ``constants`` the values known in
    the enclosing scope while it is built (None: dropped, not available);
    ``overridable`` names constants a feed may replace; ``where`` names the
    node and attribute in errors (see the module docstring).
    """
    for kind, values in (("input", graph.input), ("output", graph.output)):
        for vi in values:
            what = type_kind(vi.type)
            if what is not None:
                raise ModelError(f"{where}: subgraph {kind} '{vi.name}' is {what}; onnxkv runs tensor values only")
    wrapped = onnx.GraphProto()
    wrapped.CopyFrom(graph)
    for vi in wrapped.input:
        vi.type.tensor_type.ClearField("shape")
    external: dict[str, np.ndarray] = {}
    scope: list[str] = []
    for name in scope_names(graph):
        value = constants.get(name)
        if value is None or name in overridable:
            scope.append(name)
            continue
        external[name] = value
        wrapped.initializer.append(
            onnx.TensorProto(
                name=name,
                data_type=helper.np_dtype_to_tensor_dtype(value.dtype),
                dims=value.shape,
                data_location=onnx.TensorProto.EXTERNAL,
            )
        )
    model = helper.make_model(wrapped, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    return model, external, scope
