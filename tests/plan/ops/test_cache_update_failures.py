"""In-place operators on a caller's array in a plain ``Session.run``: one rule for every operator.

The array is the node's output (MUST_ALIAS).  A node that rejects its inputs
writes nothing; once it ran, what it wrote (positions, or the page
conversion of ``QuantizePagedCache``) stays in the caller's array when a
later node fails.  Nothing is saved or restored for a caller's array: only a state's storage is put back (see
``tests/runtime/test_state_atomicity.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
from faults import failing_after
from onnx import TensorProto, helper

import onnxkv
from onnxkv.cache.page_set import PageSet
from onnxkv.errors import OperatorError
from onnxkv.model.contract import Access, OutputAlias, set_access, set_output_alias
from onnxkv.zoo.paged import PagedConfig, build_paged_model

CAP, H, D = 8, 2, 4


def update_then_sum():
    nodes = [
        helper.make_node("CacheUpdate", ["past", "new", "pos"], ["present"], domain="ai.onnxkv", name="update"),
        helper.make_node("ReduceSum", ["present"], ["total"], keepdims=0, name="sum"),
    ]
    inputs = [
        helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, H, CAP, D]),
        helper.make_tensor_value_info("new", TensorProto.FLOAT, [1, H, 2, D]),
        helper.make_tensor_value_info("pos", TensorProto.INT64, []),
    ]
    outputs = [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])]
    m = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnxkv", 1)],
    )
    set_output_alias(m.graph.node[0], [OutputAlias(0, 0)])
    set_access(m.graph.input[0], Access.READ_WRITE)
    return m


def test_a_caller_cache_keeps_the_positions_a_node_wrote():
    sess = onnxkv.Session(update_then_sum(), threads=1)
    past = np.zeros((1, H, CAP, D), np.float32)
    new = np.random.default_rng(0).standard_normal((1, H, 2, D)).astype(np.float32)
    feeds = {"past": past, "new": new, "pos": np.array(3)}
    with failing_after(sess.plan, 0), pytest.raises(OperatorError, match="injected failure"):
        sess.run(feeds)
    np.testing.assert_array_equal(past[:, :, 3:5], new)  # MUST_ALIAS: the caller's array is the node's output
    assert not past[:, :, :3].any() and not past[:, :, 5:].any()


def test_paged_operators_follow_the_same_rule_on_a_caller_cache():
    """PagedAttention's new tokens and QuantizePagedCache's conversion stay in the caller's pages."""
    cfg = PagedConfig(num_pages=8, key_format="int8", value_format="int8")
    sess = onnxkv.Session(build_paged_model(cfg, seed=1), threads=1)
    rng = np.random.default_rng(1)
    past = rng.standard_normal(cfg.past_shape).astype(np.float32)
    table = np.arange(cfg.max_blocks, dtype=np.int32)[None]
    feeds = {
        "past.0": past,
        "hidden": rng.standard_normal((1, 1, cfg.hidden_size)).astype(np.float32),
        "block_table": table,
        "seqlens_k": np.array([5], np.int32),
        "quantize_blocks": np.array([0], np.int32),
        "key_scale.0": np.full((1, cfg.num_kv_heads), 0.05, np.float32),
        "value_scale.0": np.full((1, cfg.num_kv_heads), 0.05, np.float32),
        "key_zero_point.0": np.zeros((1, cfg.num_kv_heads), np.int8),
        "value_zero_point.0": np.zeros((1, cfg.num_kv_heads), np.int8),
    }
    before = past.copy()
    attention = next(k for k, n in enumerate(sess.plan.nodes) if n.op_type == "PagedAttention")
    with failing_after(sess.plan, attention), pytest.raises(OperatorError, match="injected failure"):
        sess.run(feeds)
    handle = PageSet.of(past)
    assert handle.formats[:, 0].tolist() == [3, 3] and np.isnan(past[0]).all()  # page 0 converted, not undone
    handle.audit()
    assert not np.array_equal(past[1, :, :, 1], before[1, :, :, 1])  # token 5: page 1, slot 1, written
    untouched = np.ones(past.shape, bool)
    untouched[0] = False
    untouched[1, :, :, 1] = False
    np.testing.assert_array_equal(past[untouched], before[untouched])
