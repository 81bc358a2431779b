"""ai.onnxkv::CacheUpdate with MUST_ALIAS: in place, identity-checked, never a silent copy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxkv
from onnxkv import CacheCapacityError, InputError, ModelError, OperatorError
from onnxkv.model.contract import Access, OutputAlias, set_access, set_output_alias, set_persistent_bindings

CAP, H, D = 8, 2, 4


def cache_model(new_len: int = 2, bind: bool = True, cache_initializer: bool = False):
    node = helper.make_node("CacheUpdate", ["past", "new", "pos"], ["present"], domain="ai.onnxkv", name="update")
    total = helper.make_node("ReduceSum", ["present"], ["total"], keepdims=0)
    inputs = [
        helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, H, CAP, D]),
        helper.make_tensor_value_info("new", TensorProto.FLOAT, [1, H, new_len, D]),
        helper.make_tensor_value_info("pos", TensorProto.INT64, []),
    ]
    outputs = [
        helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, H, CAP, D]),
        helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
    ]
    inits = []
    if cache_initializer:
        inits = [numpy_helper.from_array(np.zeros((1, H, CAP, D), np.float32), "past")]
        inputs = inputs[1:]
    g = helper.make_graph([node, total], "cache", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnxkv", 1)])
    set_output_alias(m.graph.node[0], [OutputAlias(0, 0)])
    if not cache_initializer:
        set_access(m.graph.input[0], Access.READ_WRITE)
    if bind:
        set_persistent_bindings(m.graph, {"past": "present"})
    return m


def feeds(pos, new_len=2, seed=0):
    new = np.random.default_rng(seed).standard_normal((1, H, new_len, D)).astype(np.float32)
    return {"new": new, "pos": np.array(pos, np.int64)}


def test_writes_in_place_into_caller_storage():
    sess = onnxkv.Session(cache_model(bind=False), threads=1)
    past = np.zeros((1, H, CAP, D), np.float32)
    f = feeds(3)
    out = sess.run(dict(f, past=past))
    assert np.shares_memory(out["present"], past)  # no output allocation: the caller's storage itself
    np.testing.assert_array_equal(past[:, :, 3:5], f["new"])
    assert not past[:, :, :3].any() and not past[:, :, 5:].any()  # only [position, position + S) written


def test_rejections_leave_storage_untouched():
    sess = onnxkv.Session(cache_model(bind=False), threads=1)
    past = np.arange(H * CAP * D, dtype=np.float32).reshape(1, H, CAP, D)
    before = past.copy()
    with pytest.raises(CacheCapacityError, match="exceeds the capacity 8"):
        sess.run(dict(feeds(7), past=past))
    ro = past.copy()
    ro.flags.writeable = False
    with pytest.raises(InputError, match="read-only"):
        sess.run(dict(feeds(0), past=ro))
    big = np.zeros((1, H, CAP * 2, D), np.float32)
    with pytest.raises(InputError, match="view of part of other storage"):
        sess.run(dict(feeds(0), past=big[:, :, :CAP]))
    with pytest.raises(InputError, match="position must be >= 0"):
        sess.run(dict(feeds(-1), past=past))
    np.testing.assert_array_equal(past, before)
    with pytest.raises(ModelError, match="initializer"):
        onnxkv.Session(cache_model(bind=False, cache_initializer=True), threads=1)


def test_persistent_state_accumulates_in_place_and_publishes_atomically():
    sess = onnxkv.Session(cache_model(), threads=1, events=True)
    assert sess.declared_bindings == {"past": "present"}
    state = sess.new_state()
    expected = np.zeros((1, H, CAP, D), np.float32)
    for step, pos in enumerate((0, 2, 4)):
        f = feeds(pos, seed=step)
        out = state.run(f)
        expected[:, :, pos : pos + 2] = f["new"]
        assert set(out) == {"total"}
        np.testing.assert_allclose(out["total"], expected.sum(), rtol=1e-6)
    np.testing.assert_array_equal(state.values["past"], expected)
    storage = state.values["past"]
    storage.flags.writeable = True  # a caller forcing its view of the state's storage writable
    with pytest.raises(CacheCapacityError):
        state.run(feeds(7))
    np.testing.assert_array_equal(state.values["past"], expected)
    assert np.shares_memory(state.values["past"], storage)  # nothing reallocated or copied
    # the state's storage cannot be written through another run
    with pytest.raises(InputError, match="bound to a state"):
        sess.run(dict(feeds(6), past=storage))
    np.testing.assert_array_equal(state.values["past"], expected)
    state.close()


def test_must_alias_is_checked_after_the_node():
    node = helper.make_node("Add", ["past", "x"], ["present"], name="not_in_place")
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("past", "x")]
    g = helper.make_graph([node], "g", vi, [helper.make_tensor_value_info("present", TensorProto.FLOAT, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    set_output_alias(m.graph.node[0], [OutputAlias(0, 0)])
    sess = onnxkv.Session(m, threads=1)
    with pytest.raises(OperatorError, match="must alias input 'past'"):
        sess.run({"past": np.zeros(4, np.float32), "x": np.ones(4, np.float32)})
