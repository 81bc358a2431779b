"""ai.onnxkv::PagedCacheUpdate and ai.rt::PagedAttention: in place through a block table, validated before writing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxkv
from onnxkv import CacheCapacityError, ContractError, InputError, ModelError
from onnxkv.model.contract import Access, OutputAlias, get_output_alias, set_access, set_output_alias

P, H, BS, D = 10, 2, 4, 8
TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def vi(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, shape)


def update_model(block_size=BS, dtype=np.float32, types=None, cache_shape=(P, H, BS, D)):
    """``present = PagedCacheUpdate(past, table, new, pos)`` with the contract's MUST_ALIAS declared.

    ``types`` overrides the declared element type of inputs by name (to reach the operator's own checks).
    """
    t = TYPES[dtype]
    types = types or {}
    node = helper.make_node("PagedCacheUpdate", ["past", "table", "new", "pos"], ["present"], domain="ai.onnxkv",
                            name="update", block_size=block_size)
    g = helper.make_graph([node], "paged_update",
                          [vi("past", t, list(cache_shape)), vi("table", types.get("table", TensorProto.INT64), ["B", "M"]),
                           vi("new", types.get("new", t), ["B", "H", "S", "D"]), vi("pos", TensorProto.INT64, None)],
                          [vi("present", t, list(cache_shape))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnxkv", 1)])
    set_output_alias(m.graph.node[0], [OutputAlias(0, 0)])
    set_access(m.graph.input[0], Access.READ_WRITE)
    return m


def attention_model(hq=4, hkv=H, block_size=BS, max_tokens=24, dtype=np.float32, types=None, **attrs):
    """``Y, present = PagedAttention(Q, K, V, past, table, seqlens)`` with the contract's MUST_ALIAS declared.

    ``types`` overrides the declared element type of inputs by name (to reach the operator's own checks).
    """
    t = TYPES[dtype]
    types = types or {}
    node = helper.make_node("PagedAttention", ["Q", "K", "V", "past", "table", "seqlens"], ["Y", "present"],
                            domain="ai.rt", name="attn", num_heads=hq, kv_num_heads=hkv, block_size=block_size,
                            max_tokens=max_tokens, **attrs)
    g = helper.make_graph([node], "paged_attention",
                          [vi("Q", t, ["B", "S", hq * D]), vi("K", t, ["B", "S", "KV"]),
                           vi("V", types.get("V", t), ["B", "S", "KV"]),
                           vi("past", types.get("past", t), ["P", "two", "Hkv", "bs", "D"]),
                           vi("table", types.get("table", TensorProto.INT32), ["B", "M"]),
                           vi("seqlens", TensorProto.INT32, ["B"])],
                          [vi("Y", t, ["B", "S", hq * D]), vi("present", types.get("past", t), ["P", "two", "Hkv", "bs", "D"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.rt", 1)])
    set_output_alias(m.graph.node[0], [OutputAlias(1, 3)])
    set_access(m.graph.input[3], Access.READ_WRITE)
    return m


def shuffled_table(rng, batch, max_blocks, num_pages):
    """Distinct pages for every (row, block), in random order."""
    return rng.permutation(num_pages)[: batch * max_blocks].reshape(batch, max_blocks)


# -- PagedCacheUpdate ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("table_type", [np.int32, np.int64])
def test_update_writes_each_token_to_its_page_slot_in_place(dtype, table_type):
    rng = np.random.default_rng(1)
    sess = onnxkv.Session(update_model(dtype=dtype, types={"table": helper.np_dtype_to_tensor_dtype(np.dtype(table_type))}),
                          threads=1)
    cache = rng.standard_normal((P, H, BS, D)).astype(dtype)
    table = shuffled_table(rng, 2, 3, P).astype(table_type)
    new = rng.standard_normal((2, H, 5, D)).astype(dtype)
    pos = np.array([3, 6], np.int64)
    expected = cache.copy()
    for b in range(2):
        for s in range(5):
            t = pos[b] + s
            expected[table[b, t // BS], :, t % BS] = new[b, :, s]
    out = sess.run({"past": cache, "table": table, "new": new, "pos": pos})
    assert out["present"].__array_interface__["data"][0] == cache.__array_interface__["data"][0]
    np.testing.assert_array_equal(cache, expected)
    # a scalar position writes every row at the same logical positions
    sess.run({"past": cache, "table": table, "new": new[:, :, :2], "pos": np.array(0, np.int64)})
    for b in range(2):
        np.testing.assert_array_equal(cache[table[b, 0], :, :2], new[b, :, :2])


def test_update_rejects_an_initializer_cache_at_build_time():
    m = update_model()
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.ones((P, H, BS, D), np.float32), "past"))
    del m.graph.input[0]
    with pytest.raises(ModelError, match="initializer"):
        onnxkv.Session(m, threads=1)


def _update_feeds(rng, **over):
    feeds = {"past": rng.standard_normal((P, H, BS, D)).astype(np.float32),
             "table": np.array([[4, 1, 7], [0, 9, 2]], np.int64),
             "new": rng.standard_normal((2, H, 3, D)).astype(np.float32),
             "pos": np.array([2, 5], np.int64)}
    feeds.update(over)
    return feeds


@pytest.mark.parametrize("over, error, match", [
    ({"table": np.array([[4, 10, 7], [0, 9, 2]], np.int64)}, InputError, r"'table'\[0, 1\] = 10 is not a page index"),
    ({"table": np.array([[4, 1, 7], [-1, -1, 2]], np.int64)}, InputError, r"'table'\[1, 1\] = -1"),
    ({"pos": np.array([2, -1], np.int64)}, InputError, "'pos' must be >= 0"),
    ({"pos": np.array([10, 5], np.int64)}, CacheCapacityError, r"'pos'\[0\] = 10 \+ 3 new tokens exceeds max_tokens = 12"),
    ({"table": np.array([[4, 1, 7], [0, 4, 2]], np.int64)}, InputError,
     r"rows 0 and 1 write logical positions 2 and 6 to the same physical slot \(page 4, offset 2\)"),
    ({"table": np.array([[4, 1, 7]], np.int64)}, InputError, r"must be int32/int64 \[2, max_blocks"),
    ({"pos": np.array([1, 2, 3], np.int64)}, InputError, "'pos' must be an int scalar or"),
], ids=["page-too-large", "page-negative", "position-negative", "capacity", "same-slot", "table-rows",
        "position-shape"])
def test_update_rejections_leave_every_byte_of_the_cache_unchanged(over, error, match):
    sess = onnxkv.Session(update_model(), threads=1)
    feeds = _update_feeds(np.random.default_rng(2), **over)
    before = feeds["past"].copy()
    with pytest.raises(error, match=match) as info:
        sess.run(feeds)
    assert "PagedCacheUpdate node 'update'" in str(info.value)
    np.testing.assert_array_equal(feeds["past"], before)


def test_update_rejects_unusable_storage_and_mismatched_values_before_writing():
    rng = np.random.default_rng(3)
    sess = onnxkv.Session(update_model(), threads=1)
    feeds = _update_feeds(rng)
    past = feeds["past"]
    before = past.copy()
    with pytest.raises(InputError, match="'new' dtype float16 differs from cache dtype float32"):
        onnxkv.Session(update_model(types={"new": TensorProto.FLOAT16}), threads=1).run(
            dict(feeds, new=feeds["new"].astype(np.float16)))
    with pytest.raises(InputError, match="block table 'table' must be int32/int64"):
        onnxkv.Session(update_model(types={"table": TensorProto.FLOAT}), threads=1).run(
            dict(feeds, table=feeds["table"].astype(np.float32)))
    with pytest.raises(InputError, match="does not fit cache shape"):
        sess.run(dict(feeds, new=rng.standard_normal((2, H, 3, D + 1)).astype(np.float32)))
    read_only = past.copy()
    read_only.flags.writeable = False
    with pytest.raises(InputError, match="read-only"):
        sess.run(dict(feeds, past=read_only))
    with pytest.raises(InputError, match="view of part of other storage"):
        sess.run(dict(feeds, past=np.concatenate([past, past])[:P]))
    np.testing.assert_array_equal(past, before)
    # the block_size attribute must describe the cache's pages: at build time when the dims are declared ...
    with pytest.raises(ContractError, match="dim 2 of 'past' is 4, but block_size is 2"):
        onnxkv.Session(update_model(block_size=2), threads=1)
    # ... and at run time otherwise
    with pytest.raises(InputError, match=r"block_size=2"):
        onnxkv.Session(update_model(block_size=2, cache_shape=["P", H, "bs", D]), threads=1).run(feeds)
    np.testing.assert_array_equal(past, before)


# -- PagedAttention -----------------------------------------------------------------------------------------------

def reference_attention(q, k, v, past_len, scale, softcap=0.0, window=-1, causal=True):
    """Row by row float64 attention of q [S, Hq, D] over logical k, v [T, Hkv, D]; query s is at past_len + s."""
    s_len, hq, _ = q.shape
    group = hq // k.shape[1]
    out = np.zeros(q.shape)
    for s in range(s_len):
        p = past_len + s
        keys = np.arange(k.shape[0])
        visible = keys <= (p if causal else k.shape[0] - 1)
        if window >= 0:
            visible &= keys >= p - window
        for h in range(hq):
            scores = k[visible, h // group].astype(np.float64) @ q[s, h].astype(np.float64) * scale
            if softcap > 0:
                scores = softcap * np.tanh(scores / softcap)
            w = np.exp(scores - scores.max())
            out[s, h] = (w / w.sum()) @ v[visible, h // group].astype(np.float64)
    return out


class PagedRows:
    """A paged cache and the logical K/V it holds per row (the test's independent bookkeeping)."""

    def __init__(self, rng, batch, max_blocks, num_pages, hkv, dtype, block_size=BS):
        self.bs = block_size
        self.past = rng.standard_normal((num_pages, 2, hkv, block_size, D)).astype(dtype)
        self.table = shuffled_table(rng, batch, max_blocks, num_pages).astype(np.int32)
        self.logical = [np.zeros((0, 2, hkv, D), dtype) for _ in range(batch)]

    def fill(self, row, tokens):
        """Append ``tokens`` [n, 2, Hkv, D] to ``row`` by writing the pages directly."""
        for t in tokens:
            pos = len(self.logical[row])
            self.past[self.table[row, pos // self.bs], :, :, pos % self.bs] = t
            self.logical[row] = np.concatenate([self.logical[row], t[None]])


def run_attention(sess, rows, rng, s, dtype, hq, hkv):
    b = len(rows.logical)
    q = rng.standard_normal((b, s, hq * D)).astype(dtype)
    k = rng.standard_normal((b, s, hkv * D)).astype(dtype)
    v = rng.standard_normal((b, s, hkv * D)).astype(dtype)
    seqlens = np.array([len(x) for x in rows.logical], np.int32)
    out = sess.run({"Q": q, "K": k, "V": v, "past": rows.past, "table": rows.table, "seqlens": seqlens})
    for row in range(b):
        new = np.stack([k[row].reshape(s, hkv, D), v[row].reshape(s, hkv, D)], axis=1)
        rows.logical[row] = np.concatenate([rows.logical[row], new])
    return q, seqlens, out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("attrs", [{}, {"left_window_size": 5}, {"softcap": 2.0, "scale": 0.3}, {"is_causal": 0}],
                         ids=["causal", "window", "softcap-scale", "non-causal"])
@pytest.mark.parametrize("hkv, block_size", [(2, 4), (1, 2)], ids=["aligned-pages", "small-pages"])
def test_attention_appends_in_place_and_matches_dense_reference(dtype, attrs, hkv, block_size):
    rng = np.random.default_rng(4)
    hq, batch, max_blocks = 4, 3, 12
    pages = batch * max_blocks + 2
    sess = onnxkv.Session(attention_model(hq=hq, hkv=hkv, block_size=block_size, max_tokens=22, dtype=dtype,
                                          **attrs), threads=1)
    rows = PagedRows(rng, batch, max_blocks, pages, hkv, dtype, block_size)
    for row, n in enumerate((0, 3, 7)):  # rows of different lengths
        rows.fill(row, rng.standard_normal((n, 2, hkv, D)).astype(dtype))
    tol = 2e-3 if dtype == np.float16 else 1e-5
    scale = attrs.get("scale", 1 / np.sqrt(D))
    for s in (6, 1, 1, 4):  # a prefill chunk, two decode steps, another chunk
        q, seqlens, out = run_attention(sess, rows, rng, s, dtype, hq, hkv)
        assert out["present"].__array_interface__["data"][0] == rows.past.__array_interface__["data"][0]
        assert out["Y"].dtype == dtype and out["Y"].shape == q.shape
        for row in range(batch):
            logical = rows.logical[row]
            for t in range(len(logical)):  # every logical token is where the table says
                np.testing.assert_array_equal(rows.past[rows.table[row, t // block_size], :, :, t % block_size],
                                              logical[t])
            want = reference_attention(q[row].reshape(s, hq, D), logical[:, 0], logical[:, 1], int(seqlens[row]),
                                       scale, attrs.get("softcap", 0.0), attrs.get("left_window_size", -1),
                                       bool(attrs.get("is_causal", 1)))
            np.testing.assert_allclose(out["Y"][row].reshape(s, hq, D), want, rtol=tol, atol=tol)


def _attention_feeds(rng, **over):
    hq, hkv = 4, H
    feeds = {"Q": rng.standard_normal((2, 2, hq * D)).astype(np.float32),
             "K": rng.standard_normal((2, 2, hkv * D)).astype(np.float32),
             "V": rng.standard_normal((2, 2, hkv * D)).astype(np.float32),
             "past": rng.standard_normal((P, 2, hkv, BS, D)).astype(np.float32),
             "table": np.array([[3, 8, 1, 5, 6, 0], [2, 7, 4, 9, 6, 0]], np.int32),
             "seqlens": np.array([5, 2], np.int32)}
    feeds.update(over)
    return feeds


@pytest.mark.parametrize("over, error, match", [
    ({"table": np.array([[3, 12, 1, 5, 6, 0], [2, 7, 4, 9, 6, 0]], np.int32)}, InputError,
     r"'table'\[0, 1\] = 12 is not a page index in \[0, 10\)"),
    ({"table": np.array([[-3, 8, 1, 5, 6, 0], [2, 7, 4, 9, 6, 0]], np.int32)}, InputError,
     r"'table'\[0, 0\] = -3"),  # a page that is only read is checked too
    ({"seqlens": np.array([5, -1], np.int32)}, InputError, "'seqlens' must be >= 0"),
    ({"seqlens": np.array([23, 2], np.int32)}, CacheCapacityError,
     r"'seqlens'\[0\] = 23 \+ 2 new tokens exceeds max_tokens = 24"),
    ({"table": np.array([[3, 8, 1, 5, 6, 0], [8, 7, 4, 9, 6, 0]], np.int32), "seqlens": np.array([5, 1], np.int32)},
     InputError, "rows 0 and 1 write logical positions 5 and 1 to the same physical slot"),
    ({"table": np.array([[3, 8, 1, 5], [2, 7, 4, 9]], np.int32)}, InputError,
     r"max_tokens=24 exceeds the 4 blocks of 4 tokens"),
    ({"past": np.zeros((P, 2, H, BS + 1, D), np.float32)}, InputError, r"past 'past' must be \[num_pages, 2"),
    ({"K": np.zeros((2, 2, 3 * D), np.float32)}, InputError, r"'K' must be \[batch, seq, kv_num_heads\*head_size\]"),
    ({"seqlens": np.array([5], np.int32)}, InputError, r"'seqlens' must be \[2\] ints"),
], ids=["page-too-large", "read-page-negative", "seqlens-negative", "capacity", "same-slot", "max-tokens",
        "past-shape", "k-shape", "seqlens-shape"])
def test_attention_rejections_leave_every_byte_of_the_cache_unchanged(over, error, match):
    sess = onnxkv.Session(attention_model(), threads=1)
    feeds = _attention_feeds(np.random.default_rng(5), **over)
    before = feeds["past"].copy()
    with pytest.raises(error, match=match) as info:
        sess.run(feeds)
    assert "PagedAttention node 'attn'" in str(info.value)
    np.testing.assert_array_equal(feeds["past"], before)


@pytest.mark.parametrize("name, elem_type, array, match", [
    ("past", TensorProto.FLOAT16, np.zeros((P, 2, H, BS, D), np.float16), "past 'past' dtype float16 differs"),
    ("V", TensorProto.FLOAT16, np.zeros((2, 2, H * D), np.float16), "'V' dtype float16 differs from Q dtype float32"),
    ("table", TensorProto.FLOAT, np.zeros((2, 6), np.float32), "block table 'table' must be int32/int64"),
])
def test_attention_rejects_mismatched_dtypes_before_writing(name, elem_type, array, match):
    sess = onnxkv.Session(attention_model(types={name: elem_type}), threads=1)
    feeds = _attention_feeds(np.random.default_rng(8), **{name: array})
    before = feeds["past"].copy()
    with pytest.raises(InputError, match=match):
        sess.run(feeds)
    np.testing.assert_array_equal(feeds["past"], before)


def test_attention_rejects_unusable_storage_before_writing():
    feeds = _attention_feeds(np.random.default_rng(6))
    sess = onnxkv.Session(attention_model(), threads=1)
    past = feeds["past"]
    read_only = past.copy()
    read_only.flags.writeable = False
    with pytest.raises(InputError, match="read-only"):
        sess.run(dict(feeds, past=read_only))
    np.testing.assert_array_equal(read_only, past)
    shared = np.concatenate([past, past])
    with pytest.raises(InputError, match="view of part of other storage"):
        sess.run(dict(feeds, past=shared[:P]))
    np.testing.assert_array_equal(shared[:P], past)


@pytest.mark.parametrize("attrs, match", [
    ({"is_causal": 0, "left_window_size": 2}, "needs is_causal=1"),
    ({"num_heads": 3}, "multiple of kv_num_heads"),
    ({"max_tokens": 0}, "max_tokens is required"),
    ({"left_window_size": -2}, "left_window_size must be >= -1"),
    ({"softcap": -1.0}, "softcap must be >= 0"),
])
def test_attention_rejects_bad_attributes_at_build_time(attrs, match):
    base = {"hq": 4, "max_tokens": 24}
    if "num_heads" in attrs:
        base["hq"] = attrs.pop("num_heads")
    if "max_tokens" in attrs:
        base["max_tokens"] = attrs.pop("max_tokens")
    with pytest.raises(ModelError, match=match):
        onnxkv.Session(attention_model(**base, **attrs), threads=1)


def test_models_survive_an_onnx_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(7)
    path = tmp_path / "paged.onnx"
    onnx.save(attention_model(), path)
    loaded = onnx.load(path)
    assert [(a.output_index, a.input_index) for a in get_output_alias(loaded.graph.node[0])] == [(1, 3)]
    onnxkv.check_model(loaded)
    feeds = _attention_feeds(rng)
    expected = onnxkv.Session(attention_model(), threads=1).run(dict(feeds, past=feeds["past"].copy()))
    got = onnxkv.Session(str(path), threads=1).run(feeds)
    np.testing.assert_array_equal(got["Y"], expected["Y"])
    np.testing.assert_array_equal(got["present"], expected["present"])
