"""Soundness of the mask-chain fusion under mutations (onnxkv.plan.mask_formula, fusion_export_mask).

Random single mutations of the Llama and Gemma 2 fixtures' mask chains (a
comparison's operator or operand order, an integer constant, an Unsqueeze's
axes, an And turned into Or): whatever the mutated chain computes, the plan
with the fusion must give what the plan without it gives on random batches --
the same values bit for bit, or an onnxkv error in both.  A mutation the
analysis cannot prove leaves the chain unfused; one it proves is a mask the
formula computes exactly.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _same_outcome import assert_same_outcome, mutants, outcome
from fuzzing import examples
from onnx import numpy_helper
from test_fusion_export_mask import EXPORTS, _chain, _feeds

import onnxkv
import onnxkv.plan.fusion_passes as fusion_passes

_COMPARE = ["LessOrEqual", "Less", "GreaterOrEqual", "Greater"]


def _mutate(model: onnx.ModelProto, rng: np.random.Generator) -> str:
    """One random mutation of ``model``'s chain, in place; returns what it did."""
    graph = model.graph
    while True:
        i = int(rng.integers(len(graph.node)))
        n = graph.node[i]
        if n.op_type in _COMPARE:
            if rng.random() < 0.5:
                n.op_type = str(rng.choice([c for c in _COMPARE if c != n.op_type]))
                return f"node {i}: {n.name} -> {n.op_type}"
            n.input[0], n.input[1] = n.input[1], n.input[0]
            return f"node {i}: {n.name} operands swapped"
        if n.op_type == "And":
            n.op_type = "Or"
            return f"node {i}: {n.name} -> Or"
        if n.op_type == "Constant":
            t = next((a for a in n.attribute if a.name == "value"), None)
            if t is None:
                continue
            v = numpy_helper.to_array(t.t)
            if v.dtype != np.int64 or v.size > 4:
                continue
            w = v + rng.integers(-2, 3, v.shape)
            t.t.CopyFrom(numpy_helper.from_array(w.astype(np.int64), t.t.name))
            return f"node {i}: {n.name} {v.tolist()} -> {w.tolist()}"


@pytest.mark.parametrize("name", ["llama_tied", "gemma2"])
def test_a_mutated_chain_gives_the_same_outcome_fused_and_unfused(name, monkeypatch):
    base, _ = _chain(EXPORTS[name])
    rng = np.random.default_rng(17 if name == "llama_tied" else 23)
    fused_count = 0
    for iteration, what, model, fused, plain in mutants(
        base, _mutate, rng, examples(40), monkeypatch, "fuse_export_masks"
    ):
        fused_count += "ExportMask" in [n.op_type for n in fused.plan.nodes]
        for b, s, p, extra in [(1, 1, 9, 0), (2, 3, 4, 0), (2, 1, 6, 2)]:
            feeds = _feeds(model, rng, b, s, p, extra)
            got, want = outcome(fused, feeds), outcome(plain, feeds)
            context = f"iteration {iteration}, {what}, feeds b={b} s={s} p={p} extra={extra}"
            assert_same_outcome(got, want, context)
    assert fused_count > 0  # some mutations stay masks the formula computes (a moved offset, say)


def test_a_chain_proved_with_no_queries_gives_the_empty_mask_it_means(monkeypatch):
    # Found by the test above: the queries' Range starting at 1 instead of 0 makes S - 1 queries, none for a
    # decode step; the fused node wrote no row (it reshaped an empty array with -1 and failed)
    model, _ = _chain(EXPORTS["llama_tied"])
    (start,) = [n for n in model.graph.node if n.op_type == "Range" and n.output[0].endswith("Range_1_output_0")]
    (const,) = [n for n in model.graph.node if n.output[0] == start.input[0]]
    const.attribute[0].t.CopyFrom(numpy_helper.from_array(np.array(1, np.int64), const.attribute[0].t.name))
    fused = onnxkv.Session(model, threads=1)
    assert "ExportMask" in [n.op_type for n in fused.plan.nodes]
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, "fuse_export_masks", lambda nodes, protected, constants: nodes)
        plain = onnxkv.Session(model, threads=1)
    feeds = _feeds(model, np.random.default_rng(1), 1, 1, 9)
    got, want = outcome(fused, feeds), outcome(plain, feeds)
    assert isinstance(got, dict) and isinstance(want, dict)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].shape[2] == 0
