"""onnxkv.plan.static_dims: declared input dims that ONNX shape inference would size are refused, or enter it
as symbols (found by a fuzzing helper: a 20 KB model made the inference take GBs, or std::bad_alloc)."""

from __future__ import annotations

import pytest

from onnxkv.errors import ModelError
from onnxkv.plan.static_dims import DATA_DIM, MAX_DIM, static_dims
from onnxkv.zoo.builders import MICRO, build_model


@pytest.mark.parametrize("dim", [MAX_DIM, 2**62])
def test_a_fixed_input_dim_past_int32_is_refused(dim):
    model = build_model("tensorscatter", MICRO, seed=1)
    vi = next(i for i in model.graph.input if i.name == "write_indices")
    vi.type.tensor_type.shape.dim[0].dim_value = dim
    with pytest.raises(ModelError, match=f"graph input 'write_indices' declares dim {dim} at axis 0"):
        static_dims(model)


def test_a_large_fixed_dim_of_an_integer_input_enters_inference_as_a_symbol():
    """Data propagation holds an integer input's values: 2**24 declared indices cost 2.5 GB.  Such a dim is a
    symbol; a float input keeps its fixed dims whatever their size."""
    model = build_model("tensorscatter", MICRO, seed=1)
    vi = next(i for i in model.graph.input if i.name == "write_indices")
    vi.type.tensor_type.shape.dim[0].dim_value = 2**24
    assert static_dims(model)["write_indices"] == ("write_indices[0]",)
    vi.type.tensor_type.shape.dim[0].dim_value = DATA_DIM - 1
    assert static_dims(model)["write_indices"] == (DATA_DIM - 1,)
