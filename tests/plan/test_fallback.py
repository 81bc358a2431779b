"""The onnx.reference fallback: operators defined by a function body, and what it cannot run (named errors)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxkv import ModelError, OperatorError, Session


def _session(nodes: list, inputs: dict[str, np.ndarray], opset: int = 21) -> Session:
    """A session of ``nodes`` whose graph inputs are ``inputs`` and outputs the last node's outputs."""
    g_in = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in inputs.items()
    ]
    g_out = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in nodes[-1].output]
    graph = helper.make_graph(nodes, "g", g_in, g_out)
    return Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), threads=1)


@pytest.mark.parametrize(
    "op,want",
    [
        ("Mish", lambda x: x * np.tanh(np.log1p(np.exp(x)))),
        ("HardSwish", lambda x: x * np.clip(x / 6 + 0.5, 0, 1)),
        (
            "MeanVarianceNormalization",
            lambda x: (
                (x - x.mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(x.var(axis=(0, 2, 3), keepdims=True) + 1e-9)
            ),
        ),
    ],
)
def test_operators_defined_by_a_function_body_run_that_body(op, want):
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    session = _session([helper.make_node(op, ["x"], ["y"], name="n")], {"x": x})
    assert session.fallback_nodes == ["n"]
    np.testing.assert_allclose(session.run({"x": x})["y"], want(x), rtol=1e-5, atol=1e-6)


def test_a_sequence_output_is_an_operator_error_naming_the_node():
    x = np.zeros((4, 2), np.float32)
    session = _session([helper.make_node("SplitToSequence", ["x"], ["s"], name="n", axis=0)], {"x": x})
    with pytest.raises(
        OperatorError,
        match=r"SplitToSequence node 'n': output 's' is a sequence of 4 tensors; "
        "onnxkv values are tensors",
    ):
        session.run({"x": x})


def test_a_subgraph_operator_without_kernel_is_a_model_error_naming_node_and_attribute():
    body = helper.make_graph(
        [helper.make_node("Identity", ["t"], ["u"])],
        "b",
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("u", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["s"], axis=0),
        helper.make_node("SequenceMap", ["s"], ["m"], name="n", body=body),
    ]
    with pytest.raises(
        ModelError,
        match=r"SequenceMap node 'n': no kernel, and the onnx.reference fallback runs no "
        r"subgraph \(attribute\(s\) \['body'\]\)",
    ):
        _session(nodes, {"x": np.zeros((4, 2), np.float32)})
