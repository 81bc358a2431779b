"""Shape inference, alias classes and load-time domain checks for the paged-cache operators."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from onnxkv.model import load
from onnxkv.model.checker import check_model
from onnxkv.model.contract import ContractError, OutputAlias, set_output_alias, set_persistent_bindings
from onnxkv.model.shape_inference import infer_shapes

F16 = TensorProto.FLOAT16


def vi(name, shape, elem_type=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem_type, shape)


def update_model(cache_shape=(9, 2, 4, 8), block_size=4, declare=False):
    """``updated = PagedCacheUpdate(cache, table, values, position) -> Identity -> out``."""
    node = helper.make_node(
        "PagedCacheUpdate",
        ["cache", "table", "values", "position"],
        ["updated"],
        name="update",
        domain="ai.onnxkv",
        block_size=block_size,
    )
    if declare:
        set_output_alias(node, [OutputAlias(0, 0)])
    graph = helper.make_graph(
        [node, helper.make_node("Identity", ["updated"], ["out"], name="read")],
        "paged_update",
        [
            vi("cache", cache_shape),
            vi("table", ["batch", 3], TensorProto.INT64),
            vi("values", ["batch", 2, "new", 8]),
            vi("position", ["batch"], TensorProto.INT64),
        ],
        [vi("updated", None, 0), vi("out", None, 0)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnxkv", 1)])


def attention_model(past_shape=("pages", 2, 2, 4, 8), max_blocks=6, elem_type=F16, bind=False, **attrs):
    """``Y, present = PagedAttention(Q, K, V, past, table, seqlens)``; Y feeds a MatMul."""
    attrs = {"num_heads": 4, "kv_num_heads": 2, "block_size": 4, "max_tokens": 24, **attrs}
    node = helper.make_node(
        "PagedAttention",
        ["Q", "K", "V", "past", "table", "seqlens"],
        ["Y", "present"],
        name="attn",
        domain="ai.rt",
        **attrs,
    )
    graph = helper.make_graph(
        [node, helper.make_node("MatMul", ["Y", "W"], ["proj"], name="o_proj")],
        "paged_attention",
        [
            vi("Q", ["batch", "seq", 32], elem_type),
            vi("K", ["batch", "seq", 16], elem_type),
            vi("V", ["batch", "seq", 16], elem_type),
            vi("past", past_shape, elem_type),
            vi("table", ["batch", max_blocks], TensorProto.INT32),
            vi("seqlens", ["batch"], TensorProto.INT32),
            vi("W", [32, 5], elem_type),
        ],
        [vi("proj", None, 0), vi("present", None, 0)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.rt", 1)])
    if bind:
        set_output_alias(model.graph.node[0], [OutputAlias(1, 3)])
        set_persistent_bindings(model.graph, {"past": "present"})
    return model


def test_updated_cache_is_the_cache_even_without_a_declared_alias():
    shapes = infer_shapes(update_model())
    assert shapes["updated"] == shapes["out"] == (9, 2, 4, 8)


def test_attention_output_takes_q_shape_and_present_takes_past_shape():
    model = attention_model()
    shapes = infer_shapes(model)
    assert shapes["Y"] == ("batch", "seq", 32)
    assert shapes["proj"] == ("batch", "seq", 5)  # consumers of Y are inferred through ONNX
    assert shapes["present"] == ("pages", 2, 2, 4, 8)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: update_model(block_size=2), r"dim 2 of 'cache' is 4, but block_size is 2"),
        (lambda: attention_model(block_size=8), r"dim 3 of 'past' is 4, but block_size is 8"),
        (lambda: attention_model(kv_num_heads=1, num_heads=4), r"dim 2 of 'past' is 2, but kv_num_heads is 1"),
        (lambda: attention_model(past_shape=(9, 3, 2, 4, 8)), r"dim 1 of 'past' is 3, but K/V index \(2\) is 2"),
        (
            lambda: attention_model(max_blocks=5),
            r"max_tokens=24 exceeds the 5 blocks of 4 tokens of block table 'table'",
        ),
    ],
)
def test_dims_contradicting_the_attributes_are_contract_errors(build, match):
    with pytest.raises(ContractError, match=match) as info:
        infer_shapes(build())
    assert "node 'attn'" in str(info.value) or "node 'update'" in str(info.value)


def test_declared_contract_and_bindings_check_and_survive_save_load(tmp_path):
    model = attention_model(past_shape=(9, 2, 2, 4, 8), bind=True)
    check_model(model)
    path = tmp_path / "paged.onnx"
    onnx.save(model, path)
    loaded = load(path)  # ai.rt is a known domain
    check_model(loaded.proto)
    assert infer_shapes(loaded.proto)["present"] == (9, 2, 2, 4, 8)
    update = update_model(declare=True)
    check_model(update)
    assert [n.domain for n in load(update).proto.graph.node] == ["ai.onnxkv", ""]
