"""Fusion of exports' mask chains into ai.onnxkv::ExportMask (onnxkv.plan.fusion_export_mask, mask_formula).

Each torch.onnx.export fixture's mask chain is cut out of its model
(onnx.utils.Extractor) and run by onnxkv, fused, against onnx.reference on
random batches: left padding, holes, batch rows and lengths of every kind,
masks longer than the keys; the values must be equal bit for bit, and the
formula must have computed them (the body not evaluated) wherever its
conditions hold.  Mutated chains (a strict comparison, a shifted mask read)
must either not fuse or give the reference's values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import onnxkv
from onnxkv.plan.fusion_export_mask import fuse_export_masks
from onnxkv.plan.mask_formula import analyse, mask_formula
from onnxkv.plan.ops import export_mask

DATA = Path(__file__).resolve().parents[1] / "data"
EXPORTS = {p.parts[-3]: p for p in sorted((DATA / "arch").glob("*/torch/model.onnx"))}
EXPORTS["torch_tiny_llama"] = DATA / "torch_tiny_llama" / "model.onnx"
#: Window of the masks of each export that has sliding-window layers (transformers' config: 8).
WINDOWS = {"mistral": {8}, "gemma2": {0, 8}, "gemma3": {0, 8}}


def _fused_node(model: onnx.ModelProto) -> onnx.NodeProto:
    g = model.graph
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    nodes = fuse_export_masks(list(g.node), {o.name for o in g.output}, consts)
    (node,) = [n for n in nodes if n.op_type == "ExportMask"]
    return node


def _chain(path: Path) -> tuple[onnx.ModelProto, onnx.NodeProto]:
    """The export's mask chain as a model of its own: the fused node's body (inputs: the mask and the tensors
    whose dims it reads; outputs: the masks)."""
    model = onnx.load(str(path))
    node = _fused_node(model)
    body = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "body")
    f, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    inputs = [helper.make_tensor_value_info(x, i64 if x == "attention_mask" else f, None) for x in node.input]
    outputs = [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output]
    graph = helper.make_graph(list(body.node), "mask_chain", inputs, outputs)
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version), node


def _feeds(chain: onnx.ModelProto, rng, b: int, s: int, p: int, extra: int = 0) -> dict:
    """Random feeds: a float tensor of [b, s, 8] for the embeddings, [b, 2, p, 4] for a past, and a 0/1 mask
    of ``p + s + extra`` columns, left-padded per row with a random hole or two."""
    feeds = {}
    for vi in chain.graph.input:
        if vi.name == "attention_mask":
            t = p + s + extra
            mask = (rng.random((b, t)) < 0.85).astype(np.int64)
            for row in range(b):
                mask[row, : rng.integers(0, max(1, t // 2))] = 0
            feeds[vi.name] = mask
        elif "past" in vi.name:
            feeds[vi.name] = np.zeros((b, 2, p, 4), np.float32)
        else:
            feeds[vi.name] = np.zeros((b, s, 8), np.float32)
    return feeds


@pytest.fixture
def body_runs(monkeypatch):
    """Counts the ExportMask calls that evaluated the body instead of the formula."""
    runs = []
    real = export_mask.Body.evaluate

    def counting(self, *args, **kwargs):
        runs.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(export_mask.Body, "evaluate", counting)
    return runs


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_every_mask_of_each_export_is_proved_with_its_window(name):
    model = onnx.load(str(EXPORTS[name]))
    node = _fused_node(model)
    g = model.graph
    values = analyse(list(g.node), {}, {i.name for i in g.input})
    formulas = [mask_formula(values[o]) for o in node.output]
    assert all(f is not None and f.mask == "attention_mask" for f in formulas)
    assert {f.window for f in formulas} == WINDOWS.get(name, {0})


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_fused_masks_equal_the_reference_bit_for_bit(name, body_runs):
    chain, node = _chain(EXPORTS[name])
    sess = onnxkv.Session(chain, threads=1)
    assert [n.op_type for n in sess.plan.nodes] == ["ExportMask"]
    ref = ReferenceEvaluator(chain)
    rng = np.random.default_rng(len(name))
    for b, s, p, extra in [(1, 1, 0, 0), (1, 1, 37, 0), (3, 5, 0, 0), (2, 4, 9, 0), (2, 1, 20, 3), (1, 7, 3, 2)]:
        feeds = _feeds(chain, rng, b, s, p, extra)
        got = sess.run(feeds)
        want = dict(zip(node.output, ref.run(None, feeds)))
        for out in node.output:
            assert got[out].dtype == want[out].dtype and got[out].shape == want[out].shape
            np.testing.assert_array_equal(got[out], want[out])
    assert body_runs == []  # every run was inside the formula's conditions


@pytest.mark.parametrize("name", ["llama_tied", "gemma2"])
def test_a_mask_shorter_than_the_keys_runs_the_body_with_its_outcome(name, body_runs):
    chain, node = _chain(EXPORTS[name])
    sess = onnxkv.Session(chain, threads=1)
    feeds = _feeds(chain, np.random.default_rng(3), 2, 2, 6)
    feeds["attention_mask"] = feeds["attention_mask"][:, :5]  # 5 columns for 8 keys: reads past the rows
    try:
        want = dict(zip(node.output, ReferenceEvaluator(chain).run(None, feeds)))
    except Exception:  # the reference refuses the out-of-range read: so must onnxkv
        with pytest.raises(onnxkv.OnnxkvError):
            sess.run(feeds)
    else:
        got = sess.run(feeds)
        for out in node.output:
            np.testing.assert_array_equal(got[out], want[out])
    assert body_runs


def _mutated(op_type: str) -> onnx.ModelProto:
    chain, _ = _chain(EXPORTS["llama_tied"])
    graph = chain.graph
    flat = {o for n in graph.node if n.op_type == "Flatten" for o in n.output}
    for i, n in enumerate(graph.node):
        if n.op_type == op_type and (op_type != "Gather" or n.input[0] in flat):
            if op_type == "LessOrEqual":  # a strict causal mask: no key sees itself
                graph.node[i].op_type = "Less"
            else:  # the padding read one column further on
                one = helper.make_tensor(f"{n.output[0]}_one", onnx.TensorProto.INT64, [], [1])
                graph.initializer.append(one)
                shifted = helper.make_node("Add", [n.input[1], one.name], [f"{n.output[0]}_shifted"])
                graph.node[i].input[1] = shifted.output[0]
                graph.node.insert(i, shifted)
            return chain
    raise AssertionError(op_type)


@pytest.mark.parametrize("op_type", ["LessOrEqual", "Gather"])
def test_a_chain_that_is_not_the_formula_is_not_fused(op_type):
    chain = _mutated(op_type)
    sess = onnxkv.Session(chain, threads=1)
    assert "ExportMask" not in [n.op_type for n in sess.plan.nodes]
    feeds = _feeds(chain, np.random.default_rng(9), 2, 3, 4, 1)
    want = ReferenceEvaluator(chain).run(None, feeds)
    for g, w in zip(sess.run(feeds).values(), want):
        np.testing.assert_array_equal(g, w)
