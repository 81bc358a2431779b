"""The Plan: slots, constant folding, buffer lifetimes through views, errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxkv
from onnxkv import ArenaAllocator, InputError, ModelError, Session, SystemAllocator, UnsupportedOperatorError
from onnxkv.zoo.builders import MICRO, build_model


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=21):
    return helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=[helper.make_opsetid("", opset)]
    )


def test_constant_subgraphs_are_folded_at_build_time():
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    nodes = [
        helper.make_node("Mul", ["w", "w"], ["w2"]),  # constant
        helper.make_node("Transpose", ["w2"], ["w2t"]),  # constant
        helper.make_node("MatMul", ["x", "w2t"], ["y"]),  # depends on x
    ]
    m = _model(nodes, [_vi("x", [4, 3])], [_vi("y", [4, 2])], [w])
    sess = Session(m, threads=1)
    assert sess.plan.folded_nodes == 2 and len(sess.plan.nodes) == 1
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    wv = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(sess.run({"x": x})["y"], x @ (wv * wv).T, rtol=1e-6)


def test_a_folded_view_of_a_whole_constant_is_not_copied(tmp_path):
    """Reshape(w) folds to a view of w: a weight mapped from external data stays mapped (not copied, not read);
    a folded node making new values (Transpose) still gets its own copy."""
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    nodes = [
        helper.make_node("Reshape", ["w", "shape"], ["flat"]),
        helper.make_node("Transpose", ["w"], ["wt"]),
        helper.make_node("Gather", ["flat", "i"], ["y"]),
        helper.make_node("Gather", ["wt", "i"], ["z"]),
    ]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([32, 128], np.int64), "shape")]
    m = _model(nodes, [_vi("i", [2], TensorProto.INT64)], [_vi("y", None), _vi("z", None)], inits)
    onnx.save(m, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data", size_threshold=64)
    model = onnxkv.load(tmp_path / "m.onnx")
    sess = Session(model, threads=1)
    template, slot = sess.plan._template, sess.plan.slot_of
    assert isinstance(template[slot["flat"]], np.memmap) and template[slot["flat"]].shape == (32, 128)
    assert np.shares_memory(template[slot["flat"]], model.external["w"])
    assert not np.shares_memory(template[slot["wt"]], model.external["w"])
    out = sess.run({"i": np.array([3, 31], np.int64)})
    np.testing.assert_array_equal(out["y"], w.reshape(32, 128)[[3, 31]])
    np.testing.assert_array_equal(out["z"], w.T[[3, 31]])


def test_views_keep_arena_buffers_alive_until_their_last_use():
    # a = x + 1 (arena buffer); b = Reshape(a) (view); c = Transpose(x) uses the
    # arena after a's own last use; d = b * 2 reads the view afterwards.
    nodes = [
        helper.make_node("Add", ["x", "one"], ["a"]),
        helper.make_node("Reshape", ["a", "shape"], ["b"]),
        helper.make_node("Neg", ["x"], ["c"]),
        helper.make_node("Mul", ["c", "c"], ["c2"]),
        helper.make_node("Mul", ["b", "two"], ["d"]),
        helper.make_node("Add", ["d", "c2"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(1, np.float32), "one"),
        numpy_helper.from_array(np.array(2, np.float32), "two"),
        numpy_helper.from_array(np.array([6], np.int64), "shape"),
    ]
    m = _model(nodes, [_vi("x", [6])], [_vi("y", [6])], inits)
    arena = ArenaAllocator(1 << 16)
    sess = Session(m, threads=1, allocator=arena)
    x = np.arange(6, dtype=np.float32)
    y = sess.run({"x": x})["y"]
    np.testing.assert_allclose(y, (x + 1) * 2 + x * x)
    st = arena.stats()
    assert st.live == 0 and st.allocations > 0 and st.allocations == st.frees


def test_graph_outputs_never_come_from_the_allocator():
    m = build_model("gqa", MICRO, seed=0)
    arena = ArenaAllocator(1 << 22)
    sess = Session(m, threads=1, allocator=arena)
    feeds = {"input_ids": np.array([[1, 2, 3]]), "attention_mask": np.ones((1, 3), np.int64)}
    for i in range(MICRO.num_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, MICRO.num_kv_heads, 0, MICRO.head_size), np.float32)
    out = sess.run(feeds)
    before = {k: v.copy() for k, v in out.items()}
    sess.run(feeds)  # reuses the arena: must not overwrite returned outputs
    for k in out:
        np.testing.assert_array_equal(out[k], before[k])
    assert arena.stats().live == 0


def test_unknown_operator_is_rejected_naming_nodes():
    m = _model([helper.make_node("NoSuchOp", ["x"], ["y"], name="mystery")], [_vi("x", [2])], [_vi("y", [2])])
    with pytest.raises(UnsupportedOperatorError, match="mystery"):
        Session(m)


@pytest.mark.parametrize("op", ["ViewChain", "MaskedAttention", "SiluMul", "ShapeOf", "SiblingMatMul"])
def test_operators_only_onnxkvs_passes_make_are_refused_in_a_model(op):
    """A fusion's node trusts the structure its pass guarantees (a ViewChain body of view ops only, ...):
    a model file holding one directly is refused, in a subgraph too; the public graph forms
    (ai.onnxkv::CacheUpdate, ai.rt::PagedAttention, ...) are not internal."""
    from onnxkv.plan.registry import is_internal

    node = helper.make_node(op, ["x"], ["y"], name="made", domain="ai.onnxkv")
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("ai.onnxkv", 1)]
    m = helper.make_model(helper.make_graph([node], "g", [_vi("x", [2])], [_vi("y", [2])]), opset_imports=opsets)
    with pytest.raises(UnsupportedOperatorError, match=f"only onnxkv's own passes make.*'made' \\(ai.onnxkv::{op}\\)"):
        Session(m)
    body = helper.make_graph([node], "body", [], [_vi("y", [2])])
    outer = helper.make_node("If", ["c"], ["z"], then_branch=body, else_branch=body)
    m = helper.make_model(
        helper.make_graph([outer], "g", [_vi("c", [], TensorProto.BOOL), _vi("x", [2])], [_vi("z", [2])]),
        opset_imports=opsets,
    )
    with pytest.raises(UnsupportedOperatorError, match="only onnxkv's own passes make"):
        Session(m).run({"c": np.array(True), "x": np.ones(2, np.float32)})
    for public in (("ai.onnxkv", "CacheUpdate"), ("ai.onnxkv", "PagedCacheUpdate"), ("ai.rt", "PagedAttention")):
        assert not is_internal(*public)


def test_cycles_are_rejected():
    nodes = [helper.make_node("Neg", ["b"], ["a"]), helper.make_node("Neg", ["a"], ["b"])]
    m = _model(nodes, [_vi("x", [2])], [_vi("b", [2])])
    with pytest.raises(ModelError, match="cycle"):
        Session(m)


def test_feed_validation_errors():
    m = _model([helper.make_node("Neg", ["x"], ["y"])], [_vi("x", [2, 3])], [_vi("y", [2, 3])])
    sess = Session(m, threads=1)
    with pytest.raises(InputError, match="missing input 'x'"):
        sess.run({})
    with pytest.raises(InputError, match="dtype float64"):
        sess.run({"x": np.zeros((2, 3))})
    with pytest.raises(InputError, match=r"shape \(2, 4\)"):
        sess.run({"x": np.zeros((2, 4), np.float32)})
    with pytest.raises(InputError, match="unknown input 'z'"):
        sess.run({"x": np.zeros((2, 3), np.float32), "z": np.zeros(1)})
    with pytest.raises(InputError, match="unknown output"):
        sess.run({"x": np.zeros((2, 3), np.float32)}, ["nope"])


@pytest.mark.parametrize("ir", [8, 3])
def test_an_initializer_listed_as_an_input_is_a_default_a_feed_replaces_from_ir_4(ir):
    """From IR 4 on it is a default (ONNX Runtime honours a feed): the fed value used to be ignored, the
    initializer folded into w * w and packed as the MatMul's weight.  In IR 3 every initializer is listed
    as an input and is a constant: a feed is refused by name."""
    nodes = [
        helper.make_node("Mul", ["w", "w"], ["w2"]),
        helper.make_node("MatMul", ["x", "w2"], ["y"]),
        helper.make_node("MatMul", ["x", "v"], ["z"]),
    ]
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    v = numpy_helper.from_array(np.full((4, 3), 3, np.float32), "v")  # an initializer only: a constant
    m = _model(nodes, [_vi("x", [2, 4]), _vi("w", [4, 3])], [_vi("y", [2, 3]), _vi("z", [2, 3])], [w, v])
    m.ir_version = ir
    sess = Session(m, threads=1)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = sess.run({"x": x})
    np.testing.assert_array_equal(out["y"], x @ np.ones((4, 3), np.float32))
    np.testing.assert_array_equal(out["z"], x @ np.full((4, 3), 3, np.float32))
    fed = np.full((4, 3), 2, np.float32)
    if ir >= 4:
        for _ in range(3):  # repeated runs (a compiled step would take a default for a constant)
            np.testing.assert_array_equal(sess.run({"x": x, "w": fed})["y"], x @ (fed * fed))
            np.testing.assert_array_equal(sess.run({"x": x})["y"], x @ np.ones((4, 3), np.float32))  # the default
            fed = fed + 1
    else:
        with pytest.raises(InputError, match="input 'w' is a constant of an IR 3 model"):
            sess.run({"x": x, "w": fed})


def test_failed_run_returns_every_buffer():
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Reshape", ["a", "s"], ["y"])]
    m = _model(nodes, [_vi("x", [4]), _vi("s", [2], TensorProto.INT64)], [_vi("y", None)])
    arena = ArenaAllocator(1 << 12)
    sess = Session(m, threads=1, allocator=arena)
    with pytest.raises(Exception, match="Reshape"):
        sess.run({"x": np.ones(4, np.float32), "s": np.array([3, 3])})
    assert arena.stats().live == 0
    assert sess.run({"x": np.ones(4, np.float32), "s": np.array([2, 2])})["y"].shape == (2, 2)


def test_user_allocator_object_is_used():
    class Counting(SystemAllocator):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def allocate(self, nbytes, alignment=64):
            self.calls += 1
            return super().allocate(nbytes, alignment)

    nodes = [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Mul", ["a", "a"], ["y"])]
    m = _model(nodes, [_vi("x", [4])], [_vi("y", [4])])
    alloc = Counting()
    sess = Session(m, threads=1, allocator=alloc)
    np.testing.assert_allclose(sess.run({"x": np.ones(4, np.float32)})["y"], 4.0)
    assert alloc.calls == 1  # 'a' is a temporary; 'y' reaches the caller


def test_bad_allocator_is_rejected():
    with pytest.raises(TypeError):
        Session(build_model("gqa", MICRO), allocator=object())


def test_omitted_inputs_and_outputs_run_and_free_their_buffers():
    # Slice without axes (an omitted input in the middle: rows 1..2) and LayerNormalization whose mean / inv_std_var
    # outputs are omitted: the run loop reads None for the first and drops what the kernel returns for the second.
    consts = [
        numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("starts", [1]), ("ends", [3]), ("steps", [1]))
    ]
    gamma = numpy_helper.from_array(np.linspace(0.5, 1.5, 5, dtype=np.float32), "gamma")
    nodes = [
        helper.make_node("Add", ["x", "x"], ["n"]),
        helper.make_node("Slice", ["n", "starts", "ends", "", "steps"], ["c"]),
        helper.make_node("Mul", ["c", "c"], ["d"]),
        helper.make_node("LayerNormalization", ["d", "gamma"], ["ln", "", ""], axis=-1),
        helper.make_node("Add", ["ln", "d"], ["y"]),
    ]
    m = _model(nodes, [_vi("x", [3, 5])], [_vi("y", [2, 5])], [*consts, gamma])
    arena = ArenaAllocator(1 << 16)
    sess = Session(m, threads=1, allocator=arena)
    rng = np.random.default_rng(5)
    for _ in range(2):
        x = rng.standard_normal((3, 5)).astype(np.float32)
        d = (2 * x[1:]) ** 2
        ln = (d - d.mean(-1, keepdims=True)) / np.sqrt(d.var(-1, keepdims=True) + 1e-5) * numpy_helper.to_array(gamma)
        np.testing.assert_allclose(sess.run({"x": x})["y"], ln + d, rtol=1e-5, atol=1e-5)
        st = arena.stats()
        assert st.live == 0 and st.allocations == st.frees > 0


def _decode_feeds(rng, past):
    feeds = {"input_ids": rng.integers(0, MICRO.vocab_size, (1, 1)), "attention_mask": np.ones((1, past + 1), np.int64)}
    for i in range(MICRO.num_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal(
                (1, MICRO.num_kv_heads, past, MICRO.head_size)
            ).astype(np.float32)
    return feeds


def test_session_keeps_temporaries_between_runs_so_a_repeated_step_allocates_nothing():
    m = build_model("gqa", MICRO, seed=0)
    sess = Session(m, threads=1, events=True)
    own = Session(m, threads=1, allocator=SystemAllocator())  # a caller's allocator: all back after each run
    rng = np.random.default_rng(6)
    feeds = _decode_feeds(rng, 5)
    first = sess.run(feeds)
    kept = {k: v.copy() for k, v in first.items()}
    allocated = sess.allocator.stats().allocations
    assert allocated > 0 and sess.allocator.stats().live > 0
    second = sess.run(_decode_feeds(rng, 5))
    assert sess.allocator.stats().allocations == allocated  # every temporary came from the last run
    for k in first:  # earlier outputs are never overwritten
        np.testing.assert_array_equal(first[k], kept[k])
    want = own.run(_decode_feeds(np.random.default_rng(6), 5))
    for k in first:
        np.testing.assert_array_equal(first[k], want[k])
    assert own.allocator.stats().live == 0 and own.allocator.stats().allocations > 0
    totals = [sess.events.totals(step) for step in (0, 1)]
    # the run's outputs are new arrays each run; its temporaries (allocated from the session's allocator in step 0)
    # are reuses in step 1
    assert totals[0]["allocations"] - totals[1]["allocations"] == allocated
    assert totals[1]["reuse_count"] == totals[0]["reuse_count"] + allocated
    assert set(second) == set(first)


def test_kept_buffer_viewed_by_an_output_is_not_reused():
    """y = Reshape(x + x) is a view of a temporary: the next run must not write into it."""
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Reshape", ["a", "s"], ["y"])]
    inits = [numpy_helper.from_array(np.array([2, 3], np.int64), "s")]
    m = _model(nodes, [_vi("x", [6])], [_vi("y", [2, 3])], inits)
    sess = Session(m, threads=1)
    rng = np.random.default_rng(7)
    x1, x2 = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    y1 = sess.run({"x": x1})["y"]
    y2 = sess.run({"x": x2})["y"]
    np.testing.assert_array_equal(y1, (2 * x1).reshape(2, 3))
    np.testing.assert_array_equal(y2, (2 * x2).reshape(2, 3))


def test_failed_run_of_a_session_allocator_returns_every_buffer():
    nodes = [
        helper.make_node("Add", ["x", "x"], ["a"]),
        helper.make_node("Mul", ["a", "a"], ["b"]),
        helper.make_node("Reshape", ["b", "s"], ["y"]),
    ]
    m = _model(nodes, [_vi("x", [4]), _vi("s", [2], TensorProto.INT64)], [_vi("y", None)])
    sess = Session(m, threads=1)
    assert sess.run({"x": np.ones(4, np.float32), "s": np.array([2, 2])})["y"].shape == (2, 2)
    with pytest.raises(Exception, match="Reshape"):
        sess.run({"x": np.ones(4, np.float32), "s": np.array([3, 3])})
    assert sess.allocator.stats().live == 0
    np.testing.assert_array_equal(sess.run({"x": np.ones(4, np.float32), "s": np.array([4, 1])})["y"], 4.0)


# -- graphs that are not well formed: errors at build time ------------------------------------------------
def test_a_node_reading_an_undefined_value_is_a_model_error_at_build_time():
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")]
    with pytest.raises(ModelError, match=r"Add node 'adder' reads the value 'ghost'"):
        Session(_model(nodes, [_vi("x", [2])], [_vi("y", [2])]))


def test_a_subgraph_capturing_an_undefined_value_is_a_model_error():
    branch = helper.make_graph([helper.make_node("Identity", ["phantom"], ["out"])], "b", [], [_vi("out", [2])])
    cond = numpy_helper.from_array(np.array(True), "c")
    node = helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=branch, else_branch=branch)
    with pytest.raises(ModelError, match=r"If node 'branchy' reads the value 'phantom'"):
        Session(_model([node], [_vi("x", [2])], [_vi("y", [2])], [cond]))


def test_a_value_produced_twice_is_a_model_error():
    nodes = [helper.make_node("Neg", ["x"], ["y"], name="first"), helper.make_node("Abs", ["x"], ["y"], name="second")]
    with pytest.raises(ModelError, match=r"Abs node 'second' writes the value 'y', which Neg node 'first'"):
        Session(_model(nodes, [_vi("x", [2])], [_vi("y", [2])]))
    shadow = [helper.make_node("Neg", ["x"], ["x"], name="shadow")]
    with pytest.raises(ModelError, match=r"node 'shadow' writes the value 'x'.*graph input"):
        Session(_model(shadow, [_vi("x", [2])], [_vi("x", [2])]))


def _tensor(name, dims, raw=None, floats=None):
    """A float TensorProto as a hostile file may hold it (no consistency check)."""
    t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims)
    if raw is not None:
        t.raw_data = raw
    t.float_data.extend(floats or [])
    return t


def test_initializer_whose_data_does_not_match_its_dims_names_sizes():
    w = _tensor("w", [1 << 40], raw=b"\0" * 16)
    m = _model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [4])], [_vi("y", [4])], [w])
    with pytest.raises(ModelError, match=r"initializer 'w' holds 16 bytes of raw_data, expected 4398046511104"):
        Session(m)
    typed = _tensor("w", [3], floats=[1.0, 2.0])
    m = _model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [3])], [_vi("y", [3])], [typed])
    with pytest.raises(ModelError, match=r"initializer 'w' holds 2 entries in float_data, expected 3"):
        Session(m)
    negative = _tensor("w", [-1], floats=[1.0])
    m = _model([helper.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [1])], [_vi("y", [1])], [negative])
    with pytest.raises(ModelError, match=r"initializer 'w' has dims \[-1\]"):
        Session(m)


def test_attributes_of_the_wrong_type_or_bad_utf8_name_node_and_attribute():
    concat = helper.make_node("Concat", ["x", "x"], ["y"], name="join", axis=0)
    concat.attribute[0].CopyFrom(helper.make_attribute("axis", "zero"))
    with pytest.raises(ModelError, match=r"Concat node 'join': attribute 'axis' has type STRING, expected INT"):
        Session(_model([concat], [_vi("x", [2])], [_vi("y", [4])]))
    pad = helper.make_node("Pad", ["x", "pads"], ["y"], name="padder", mode="constant")
    pad.attribute[0].s = b"\xff\xfe"
    pads = numpy_helper.from_array(np.array([1, 1], np.int64), "pads")
    with pytest.raises(ModelError, match=r"Pad node 'padder': attribute 'mode' holds the bytes .*UTF-8"):
        Session(_model([pad], [_vi("x", [2])], [_vi("y", [4])], [pads]))
    const = helper.make_node("Constant", [], ["y"], name="k", value=_tensor("v", [1 << 20], raw=b"\0" * 4))
    with pytest.raises(
        ModelError,
        match=r"Constant node 'k': attribute 'value' holds 4 bytes of raw_data, "
        r"expected 4194304",
    ):
        Session(_model([const], [], [_vi("y", [1 << 20])]))


def test_attribute_type_with_no_value_is_a_model_error():
    node = helper.make_node("Gather", ["x", "i"], ["y"], name="g")
    node.attribute.add(name="axis", type=onnx.AttributeProto.INT)  # declared INT, no value set
    i = numpy_helper.from_array(np.array([0], np.int64), "i")
    with pytest.raises(ModelError, match=r"Gather node 'g': attribute 'axis' has type INT but no value"):
        Session(_model([node], [_vi("x", [2])], [_vi("y", [1])], [i]))


def test_kernel_failing_on_its_attributes_is_a_model_error_naming_the_node():
    node = helper.make_node(
        "RotaryEmbedding", ["x", "p", "c", "s"], ["y"], name="rope", domain="com.microsoft", num_heads="four"
    )
    m = helper.make_model(
        helper.make_graph([node], "g", [_vi(n, [1, 1, 1, 4]) for n in "xpcs"], [_vi("y", None)]),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    with pytest.raises(ModelError, match=r"RotaryEmbedding node 'rope'"):
        Session(m)


@pytest.mark.parametrize("blas", [False, True])
def test_the_blas_limit_hook_runs_only_before_a_python_node_that_may_call_blas(blas):
    # Cast and Shape never call BLAS; a MatMul run by NumPy may (here: an int32 product, not onnxkv's kernel)
    nodes = [helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT32), helper.make_node("Shape", ["xi"], ["s"])]
    outputs = [_vi("s", [2], TensorProto.INT64)]
    if blas:
        nodes.append(helper.make_node("MatMul", ["xi", "xi"], ["p"]))
        outputs.append(_vi("p", [2, 2], TensorProto.INT32))
    sess = Session(_model(nodes, [_vi("x", [2, 2])], outputs), threads=1)
    calls = []
    sess.plan.run({"x": np.eye(2, dtype=np.float32)}, on_python=lambda: calls.append(1))
    assert calls == ([1] if blas else [])
