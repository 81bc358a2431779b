"""The dims of every value of a model that checked facts prove (step 1 of :mod:`onnxkv.plan.shape_fold`)."""

from __future__ import annotations

import onnx

from onnxkv.errors import ModelError
from onnxkv.model.shape_inference import _light_model

__all__ = ["Entry", "static_dims", "MAX_DIM"]

#: Fixed dims a graph input may declare, at most (exclusive): int32's range.
MAX_DIM = 2**31
#: Larger fixed dims of an integer graph input enter shape inference as symbols: its data propagation would
#: hold every element of such an input (a 20 KB model declaring 2**24 indices made it take 2.5 GB).
DATA_DIM = 2**16
_INTEGER_TYPES = frozenset(
    onnx.TensorProto.DataType.Value(t)
    for t in ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
)

#: An entry of a shape value: the dim, a symbol (equal entries are equal at run time) or None (unknown).
Entry = int | str | None


def static_dims(model: onnx.ModelProto) -> dict[str, tuple[Entry, ...]]:
    """Value name -> dims (int, symbol or None) for every main-graph value of known rank.

    Only checked facts feed the inference (see the module docstring): each
    input dim that is not a declared positive integer (below :data:`DATA_DIM` for
    an integer input) becomes a symbol of its own, ``value_info`` / output shapes and overridable initializer defaults are
    removed before ONNX shape inference runs.  Raises ModelError when ONNX
    shape inference itself fails.
    """
    light = _light_model(model)
    graph = light.graph
    del graph.value_info[:]
    for out in graph.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    declared = {vi.name for vi in model.graph.input}
    kept = [t for t in graph.initializer if t.name not in declared]  # an input's default may be overridden
    del graph.initializer[:]
    graph.initializer.extend(kept)
    for vi in graph.input:
        tt = vi.type.tensor_type
        # an integer input may be a shape: inference propagates its values, about 150 bytes per element
        big = DATA_DIM if tt.elem_type in _INTEGER_TYPES else MAX_DIM
        if tt.HasField("shape"):
            for axis, d in enumerate(tt.shape.dim):
                if d.HasField("dim_value") and d.dim_value >= MAX_DIM:  # shape inference would size it
                    raise ModelError(
                        f"graph input '{vi.name}' declares dim {d.dim_value} at axis {axis}; onnxkv takes fixed "
                        f"dims below {MAX_DIM}"
                    )
                if not (d.HasField("dim_value") and 0 < d.dim_value < big):
                    d.Clear()
                    d.dim_param = f"{vi.name}[{axis}]"
    try:
        inferred = onnx.shape_inference.infer_shapes(light, check_type=False, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError, MemoryError) as exc:
        # ValueError / MemoryError: the C++ inference's own failures (std::length_error, std::bad_alloc)
        raise ModelError(f"ONNX shape inference failed while folding shapes: {type(exc).__name__}: {exc}") from None
    dims: dict[str, tuple[Entry, ...]] = {}
    for t in model.graph.initializer:
        if t.name not in declared:
            dims[t.name] = tuple(int(d) for d in t.dims)
    for vi in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]:
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is not None and tt.HasField("shape") and vi.name not in dims:
            dims[vi.name] = tuple(
                int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
            )
    return dims
