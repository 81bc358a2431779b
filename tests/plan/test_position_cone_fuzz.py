"""Soundness of the position-table fusion under mutations (onnxkv.plan.position_cone, fusion_position).

The Llama fixture's rotary cone, cut out as a model of its own, mutated at
random (an Unsqueeze's axes, a Concat's axis, a constant reshaped so that it
varies along the positions' axes or broadcast over more axes): the plan with
the fusion must give what the plan without it gives on random positions --
the same values bit for bit, or an onnxkv error in both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from _same_outcome import assert_same_outcome, mutants, outcome
from fuzzing import examples
from onnx import helper, numpy_helper

from onnxkv.plan.fusion_position import fuse_position_tables

LLAMA = Path(__file__).resolve().parents[1] / "data" / "arch" / "llama_tied" / "torch" / "model.onnx"


def _cone() -> onnx.ModelProto:
    """The fixture's rotary cone: PositionTable's body as a model (input position_ids, outputs its outputs)."""
    model = onnx.load(str(LLAMA))
    g = model.graph
    nodes = fuse_position_tables(list(g.node), {o.name for o in g.output}, {})
    (node,) = [n for n in nodes if n.op_type == "PositionTable"]
    body = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "body")
    inputs = [helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, ["B", "S"])]
    outputs = [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output]
    graph = helper.make_graph(list(body.node), "cone", inputs, outputs)
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)


def _mutate(model: onnx.ModelProto, rng: np.random.Generator) -> str:
    nodes = model.graph.node
    while True:
        n = nodes[int(rng.integers(len(nodes)))]
        if n.op_type == "Concat":
            axis = next(a for a in n.attribute if a.name == "axis")
            axis.i = int(rng.choice([i for i in (-3, -2, -1, 0, 1, 2) if i != axis.i]))
            return f"{n.name}: axis {axis.i}"
        if n.op_type != "Constant":
            continue
        t = next((a.t for a in n.attribute if a.name == "value"), None)
        if t is None:
            continue
        v = numpy_helper.to_array(t)
        if v.dtype == np.int64 and v.size == 1:  # an Unsqueeze's axes
            w = v + int(rng.integers(-2, 3))
        elif v.dtype == np.float32 and v.size > 1:  # the inverse frequencies: move or add axes
            w = v.reshape(rng.permutation([v.size, 1, 1]).tolist())
        elif v.dtype == np.float32:
            w = np.full(int(rng.integers(1, 4)), float(v.reshape(-1)[0]), np.float32).reshape(-1, 1)
        else:
            continue
        t.CopyFrom(numpy_helper.from_array(w, t.name))
        return f"{n.name}: {v.shape} -> {w.shape}"


def test_a_mutated_cone_gives_the_same_outcome_with_and_without_tables(monkeypatch):
    base = _cone()
    rng = np.random.default_rng(31)
    for iteration, what, _model, fused, plain in mutants(
        base, _mutate, rng, examples(30), monkeypatch, "fuse_position_tables"
    ):
        for positions in (rng.integers(0, 9000, (2, 3)), np.array([[5]]), rng.integers(-4, 4, (1, 4))):
            feeds = {"position_ids": positions.astype(np.int64)}
            got, want = outcome(fused, feeds), outcome(plain, feeds)
            context = f"iteration {iteration}, {what}, positions {positions.tolist()}"
            assert_same_outcome(got, want, context)
