"""Rotary tables of exports read from PositionTable (onnxkv.plan.fusion_position, position_cone, ops.position_table).

Each torch.onnx.export fixture's rotary cone is fused into one PositionTable;
its values must equal the unfused plan's bit for bit at positions inside the
tables (read from them), past them and negative (the body evaluated).  Small
graphs check the cone's rules: a constant that varies along the positions'
axes, or a layout whose features come before the positions, is not fused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxkv
import onnxkv.plan.fusion_passes as fusion_passes
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan import registry
from onnxkv.plan.fusion_position import TABLE_ROWS
from onnxkv.plan.ops import position_table

DATA = Path(__file__).resolve().parents[1] / "data"
EXPORTS = {p.parts[-3]: p for p in sorted((DATA / "arch").glob("*/torch/model.onnx"))}
EXPORTS["torch_tiny_llama"] = DATA / "torch_tiny_llama" / "model.onnx"


@pytest.fixture
def body_runs(monkeypatch):
    """Counts the PositionTable runs that evaluated the body instead of reading the tables (as they were, or
    grown by the run)."""
    runs = []
    table = position_table.PositionTable
    real_run = table.run

    def counting(self, inputs, rt):
        out = real_run(self, inputs, rt)
        runs.extend([] if self._covering(inputs[0]) else [1])
        return out

    monkeypatch.setattr(table, "run", counting)
    return runs


def _cover_rows(sess: onnxkv.Session) -> int:
    (table,) = [k for k in sess.plan.kernels if isinstance(k, position_table.PositionTable)]
    return table._cover[0]


def _unfused(model, monkeypatch) -> onnxkv.Session:
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, "fuse_position_tables", lambda nodes, protected, constants: nodes)
        return onnxkv.Session(model, threads=1)


def _logits(sess: onnxkv.Session, positions: np.ndarray) -> np.ndarray:
    """Logits of a prefill of ``positions.shape[1]`` tokens at the given positions (one row per batch row)."""
    b, s = positions.shape
    ids = (np.arange(b * s).reshape(b, s) * 7 % 200).astype(np.int64)
    fb = FeedBuilder(sess.plan.inputs, sess.model, ids, np.full(b, s), 0)
    feeds, _ = fb.first()
    feeds["position_ids"] = positions
    return sess.run(feeds)["logits"]


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_each_exports_rotary_cone_reads_its_tables_bit_for_bit(name, body_runs, monkeypatch):
    fused = onnxkv.Session(EXPORTS[name], threads=1)
    ops = [n.op_type for n in fused.plan.nodes]
    assert ops.count("PositionTable") == 1 and not {"Cos", "Sin"} & set(ops)
    unfused = _unfused(EXPORTS[name], monkeypatch)
    rng = np.random.default_rng(len(name))
    for positions in (rng.integers(0, TABLE_ROWS, (2, 3)), np.array([[0, 1, TABLE_ROWS - 1]])):
        np.testing.assert_array_equal(_logits(fused, positions), _logits(unfused, positions))
    assert body_runs == []
    np.testing.assert_array_equal(_logits(fused, np.array([[-3, 2]])), _logits(unfused, np.array([[-3, 2]])))
    assert len(body_runs) == 1  # a negative position: the body
    positions = np.array([[TABLE_ROWS, 2 * TABLE_ROWS + 5]])  # past the tables: they grow to cover it
    epoch = registry.baked_epoch()
    np.testing.assert_array_equal(_logits(fused, positions), _logits(unfused, positions))
    assert len(body_runs) == 1 and _cover_rows(fused) == 4 * TABLE_ROWS and registry.baked_epoch() == epoch + 1


def test_tables_grow_only_within_their_byte_limit(body_runs, monkeypatch):
    path = EXPORTS["llama_tied"]
    fused, unfused = onnxkv.Session(path, threads=1), _unfused(path, monkeypatch)
    bytes_now = sum(t.nbytes for t in {id(t): t for t in fused.plan.kernels[_table_index(fused)]._cover[1]}.values())
    monkeypatch.setattr(position_table, "MAX_TABLE_BYTES", 2 * bytes_now - 1)  # not even doubled
    positions = np.array([[TABLE_ROWS + 1, 3]])
    np.testing.assert_array_equal(_logits(fused, positions), _logits(unfused, positions))
    assert len(body_runs) == 1 and _cover_rows(fused) == TABLE_ROWS


def _table_index(sess: onnxkv.Session) -> int:
    return next(i for i, k in enumerate(sess.plan.kernels) if isinstance(k, position_table.PositionTable))


def _cone_model(constant_shape: tuple, unsqueeze: int = 2) -> onnx.ModelProto:
    """positions [B, S] -> Unsqueeze -> Cast -> Mul(constant) -> Cos -> y (a graph output)."""
    freq = np.linspace(0.1, 1.0, int(np.prod(constant_shape))).astype(np.float32).reshape(constant_shape)
    nodes = [
        helper.make_node("Unsqueeze", ["positions", "axes"], ["u"]),
        helper.make_node("Cast", ["u"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["f", "freq"], ["a"]),
        helper.make_node("Cos", ["a"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cone",
        [helper.make_tensor_value_info("positions", TensorProto.INT64, ["B", "S"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([unsqueeze], np.int64), "axes"), numpy_helper.from_array(freq, "freq")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize(
    "constant_shape,unsqueeze,fused",
    [
        ((1, 1, 4), 2, True),  # features after the positions: a table
        ((4,), 2, True),
        ((1, 3, 1), 2, False),  # varies along S: not a function of each position alone
        ((1, 4, 1), 1, False),  # features between B and S: not [B, S, features] in memory
    ],
)
def test_the_cone_rules(constant_shape, unsqueeze, fused, body_runs):
    model = _cone_model(constant_shape, unsqueeze)
    sess = onnxkv.Session(model, threads=1)
    assert ("PositionTable" in [n.op_type for n in sess.plan.nodes]) == fused
    from onnx.reference import ReferenceEvaluator

    positions = np.array([[0, 5, 9], [2, 7, 1000]], np.int64)
    if not fused and constant_shape == (1, 3, 1):
        positions = positions[:, :3]
    want = ReferenceEvaluator(model).run(None, {"positions": positions})[0]
    np.testing.assert_allclose(sess.run({"positions": positions})["y"], want, rtol=1e-6, atol=1e-6)
    assert body_runs == []


def test_decode_steps_replay_the_tables_and_grow_them_past_their_end(monkeypatch):
    """A decode crossing the tables' end (24 rows here) grows them to 48: the steps recorded with 24 are
    dropped, and those recorded after replay the grown tables; logits equal the unfused plan's throughout."""
    import onnxkv.plan.fusion_position as fusion_position
    from onnxkv.plan.compiled_step import Segment

    monkeypatch.setattr(fusion_position, "TABLE_ROWS", 24)  # the decode below crosses the tables' end
    path = EXPORTS["llama_tied"]
    fused, unfused = onnxkv.Session(path, threads=2), _unfused(path, monkeypatch)
    prompt = (np.arange(1, 17, dtype=np.int64) * 5 % 250)[None]
    runs = []
    for sess in (fused, unfused):
        state = sess.new_state()
        fb = FeedBuilder(sess.plan.inputs, sess.model, prompt, np.array([prompt.shape[1]]), 0, thread_cache=False)
        feeds, _ = fb.first()
        out = state.run(feeds)
        logits = []
        for i in range(16):  # positions 16 .. 31
            feeds = fb.next(np.argmax(out["logits"][:, -1], axis=-1)[:, None], out)
            out = state.run(feeds)
            logits.append(out["logits"].copy())
            if sess is fused and i in (4, 12):  # inside the tables (grown at i = 8): the steps replay them
                assert _cover_rows(sess) == (24 if i == 4 else 48)
                assert any(
                    "PositionTable" in {type(sess.plan.kernels[k]).__name__ for k in range(item.first, item.end)}
                    for step in sess.plan.steps.idle
                    for item in step.items
                    if isinstance(item, Segment)
                )
        runs.append(logits)
    for got, want in zip(*runs):
        np.testing.assert_array_equal(got, want)
