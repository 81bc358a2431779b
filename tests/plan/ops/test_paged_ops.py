"""ai.onnxkv::PagedCacheUpdate and ai.rt::PagedAttention: in place through a block table, validated before writing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _attn_harness import owned_zeros
from onnx import TensorProto, helper

import onnxkv
from onnxkv import CacheCapacityError, ContractError, InputError, ModelError
from onnxkv.model.contract import Access, OutputAlias, get_output_alias, set_access, set_output_alias
from onnxkv.plan.ops import paged as paged_ops
from onnxkv.zoo.paged import PagedConfig, build_paged_model, paged_weights

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
    node = helper.make_node(
        "PagedCacheUpdate",
        ["past", "table", "new", "pos"],
        ["present"],
        domain="ai.onnxkv",
        name="update",
        block_size=block_size,
    )
    g = helper.make_graph(
        [node],
        "paged_update",
        [
            vi("past", t, list(cache_shape)),
            vi("table", types.get("table", TensorProto.INT64), ["B", "M"]),
            vi("new", types.get("new", t), ["B", "H", "S", "D"]),
            vi("pos", types.get("pos", TensorProto.INT64), None),
        ],
        [vi("present", t, list(cache_shape))],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnxkv", 1)])
    set_output_alias(m.graph.node[0], [OutputAlias(0, 0)])
    set_access(m.graph.input[0], Access.READ_WRITE)
    return m


def attention_model(hq=4, hkv=H, block_size=BS, max_tokens=24, dtype=np.float32, types=None, head_size=D, **attrs):
    """``Y, present = PagedAttention(Q, K, V, past, table, seqlens)`` with the contract's MUST_ALIAS declared.

    ``types`` overrides the declared element type of inputs by name (to reach the operator's own checks).
    """
    t = TYPES[dtype]
    types = types or {}
    node = helper.make_node(
        "PagedAttention",
        ["Q", "K", "V", "past", "table", "seqlens"],
        ["Y", "present"],
        domain="ai.rt",
        name="attn",
        num_heads=hq,
        kv_num_heads=hkv,
        block_size=block_size,
        max_tokens=max_tokens,
        **attrs,
    )
    g = helper.make_graph(
        [node],
        "paged_attention",
        [
            vi("Q", t, ["B", "S", hq * head_size]),
            vi("K", t, ["B", "S", "KV"]),
            vi("V", types.get("V", t), ["B", "S", "KV"]),
            vi("past", types.get("past", t), ["P", "two", "Hkv", "bs", "D"]),
            vi("table", types.get("table", TensorProto.INT32), ["B", "M"]),
            vi("seqlens", types.get("seqlens", TensorProto.INT32), ["B"]),
        ],
        [vi("Y", t, ["B", "S", hq * head_size]), vi("present", types.get("past", t), ["P", "two", "Hkv", "bs", "D"])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.rt", 1)])
    set_output_alias(m.graph.node[0], [OutputAlias(1, 3)])
    set_access(m.graph.input[3], Access.READ_WRITE)
    return m


def shuffled_table(rng, batch, max_blocks, num_pages):
    """Distinct pages for every (row, block), in random order."""
    return rng.permutation(num_pages)[: batch * max_blocks].reshape(batch, max_blocks)


def assert_rejected_before_writing(sess, feeds, error, match, label):
    """Running ``feeds`` raises ``error`` naming ``label``; every byte of ``feeds["past"]`` is unchanged."""
    before = feeds["past"].copy()
    with pytest.raises(error, match=match) as info:
        sess.run(feeds)
    assert label in str(info.value)
    np.testing.assert_array_equal(feeds["past"], before)


# -- PagedCacheUpdate ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("table_type", [np.int32, np.int64])
def test_update_writes_each_token_to_its_page_slot_in_place(dtype, table_type):
    rng = np.random.default_rng(1)
    table_elem = helper.np_dtype_to_tensor_dtype(np.dtype(table_type))
    sess = onnxkv.Session(update_model(dtype=dtype, types={"table": table_elem}), threads=1)
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
    feeds = {
        "past": rng.standard_normal((P, H, BS, D)).astype(np.float32),
        "table": np.array([[4, 1, 7], [0, 9, 2]], np.int64),
        "new": rng.standard_normal((2, H, 3, D)).astype(np.float32),
        "pos": np.array([2, 5], np.int64),
    }
    feeds.update(over)
    return feeds


@pytest.mark.parametrize(
    "over, error, match",
    [
        (
            {"table": np.array([[4, 10, 7], [0, 9, 2]], np.int64)},
            InputError,
            r"'table'\[0, 1\] = 10 is not a page index",
        ),
        ({"table": np.array([[4, 1, 7], [-1, -1, 2]], np.int64)}, InputError, r"'table'\[1, 1\] = -1"),
        ({"pos": np.array([2, -1], np.int64)}, InputError, r"'pos'\[1\] = -1 must be >= 0 \(expected \[0, 9\]\)"),
        (
            {"pos": np.array([10, 5], np.int64)},
            CacheCapacityError,
            r"'pos'\[0\] = 10 \+ 3 new tokens exceeds max_tokens = 12 \(3 blocks of 4\) of 'table' \(expected \[0, 9\]\)",
        ),
        (
            {"table": np.array([[4, 1, 7], [0, 4, 2]], np.int64)},
            InputError,
            r"rows 0 and 1 write logical positions 2 and 6 to the same physical slot \(page 4, offset 2\)",
        ),
        ({"table": np.array([[4, 1, 7]], np.int64)}, InputError, r"must be int32/int64 \[2, max_blocks"),
        ({"pos": np.array([1, 2, 3], np.int64)}, InputError, "'pos' must be an int scalar or"),
    ],
    ids=[
        "page-too-large",
        "page-negative",
        "position-negative",
        "capacity",
        "same-slot",
        "table-rows",
        "position-shape",
    ],
)
def test_update_rejections_leave_every_byte_of_the_cache_unchanged(over, error, match):
    sess = onnxkv.Session(update_model(), threads=1)
    assert_rejected_before_writing(
        sess, _update_feeds(np.random.default_rng(2), **over), error, match, "PagedCacheUpdate node 'update'"
    )


def test_update_rejects_unusable_storage_and_mismatched_values_before_writing():
    rng = np.random.default_rng(3)
    sess = onnxkv.Session(update_model(), threads=1)
    feeds = _update_feeds(rng)
    past = feeds["past"]
    before = past.copy()
    with pytest.raises(InputError, match="'new' dtype float16 differs from cache dtype float32"):
        onnxkv.Session(update_model(types={"new": TensorProto.FLOAT16}), threads=1).run(
            dict(feeds, new=feeds["new"].astype(np.float16))
        )
    with pytest.raises(InputError, match="block table 'table' must be int32/int64"):
        onnxkv.Session(update_model(types={"table": TensorProto.FLOAT}), threads=1).run(
            dict(feeds, table=feeds["table"].astype(np.float32))
        )
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


@pytest.mark.parametrize(
    "pos, row",
    [
        (np.array([2**63 - 1, 5], np.int64), 0),  # 2**63 - 1 + 3 wrapped negative and passed the capacity check
        (np.array([5, 2**63 - 2], np.int64), 1),
        (np.array(2**63 - 1, np.int64), 0),  # one position for every row
        (np.array([0, 2**64 - 1], np.uint64), 1),  # above the int64 range: not wrapped to -1
        (np.array([2**31 + 4, 0], np.int64), 0),
        (np.array([10, 0], np.int32), 0),
    ],
    ids=["int64-max", "int64-max-minus-1", "scalar", "uint64-max", "int32-max-plus-5", "int32"],
)
def test_update_positions_at_the_limits_of_their_width_are_capacity_errors(pos, row):
    sess = onnxkv.Session(update_model(types={"pos": helper.np_dtype_to_tensor_dtype(pos.dtype)}), threads=1)
    value = int(np.broadcast_to(pos, (2,))[row])
    assert_rejected_before_writing(
        sess,
        _update_feeds(np.random.default_rng(2), pos=pos),
        CacheCapacityError,
        rf"'pos'\[{row}\] = {value} \+ 3 new tokens exceeds max_tokens = 12 \(3 blocks of 4\) of 'table' "
        rf"\(expected \[0, 9\]\)$",
        "PagedCacheUpdate node 'update'",
    )


@pytest.mark.parametrize(
    "pos, match",
    [
        (np.array([-(2**63), 0], np.int64), r"'pos'\[0\] = -9223372036854775808 must be >= 0 \(expected \[0, 9\]\)"),
        (np.array([0, 1], np.float32), r"'pos' must be an int scalar or \[2\] ints, got float32 \(2,\)"),
        (np.array([True, False]), r"'pos' must be an int scalar or \[2\] ints, got bool \(2,\)"),
    ],
    ids=["int64-min", "float", "bool"],
)
def test_update_positions_that_are_not_non_negative_ints_are_input_errors(pos, match):
    sess = onnxkv.Session(update_model(types={"pos": helper.np_dtype_to_tensor_dtype(pos.dtype)}), threads=1)
    assert_rejected_before_writing(
        sess, _update_feeds(np.random.default_rng(2), pos=pos), InputError, match, "PagedCacheUpdate node 'update'"
    )


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
@pytest.mark.parametrize(
    "attrs",
    [{}, {"left_window_size": 5}, {"softcap": 2.0, "scale": 0.3}, {"is_causal": 0}],
    ids=["causal", "window", "softcap-scale", "non-causal"],
)
@pytest.mark.parametrize("hkv, block_size", [(2, 4), (1, 2)], ids=["aligned-pages", "small-pages"])
def test_attention_appends_in_place_and_matches_dense_reference(dtype, attrs, hkv, block_size):
    rng = np.random.default_rng(4)
    hq, batch, max_blocks = 4, 3, 12
    pages = batch * max_blocks + 2
    sess = onnxkv.Session(
        attention_model(hq=hq, hkv=hkv, block_size=block_size, max_tokens=22, dtype=dtype, **attrs), threads=1
    )
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
                np.testing.assert_array_equal(
                    rows.past[rows.table[row, t // block_size], :, :, t % block_size], logical[t]
                )
            want = reference_attention(
                q[row].reshape(s, hq, D),
                logical[:, 0],
                logical[:, 1],
                int(seqlens[row]),
                scale,
                attrs.get("softcap", 0.0),
                attrs.get("left_window_size", -1),
                bool(attrs.get("is_causal", 1)),
            )
            np.testing.assert_allclose(out["Y"][row].reshape(s, hq, D), want, rtol=tol, atol=tol)


def _attention_feeds(rng, **over):
    hq, hkv = 4, H
    feeds = {
        "Q": rng.standard_normal((2, 2, hq * D)).astype(np.float32),
        "K": rng.standard_normal((2, 2, hkv * D)).astype(np.float32),
        "V": rng.standard_normal((2, 2, hkv * D)).astype(np.float32),
        "past": rng.standard_normal((P, 2, hkv, BS, D)).astype(np.float32),
        "table": np.array([[3, 8, 1, 5, 6, 0], [2, 7, 4, 9, 6, 0]], np.int32),
        "seqlens": np.array([5, 2], np.int32),
    }
    feeds.update(over)
    return feeds


@pytest.mark.parametrize(
    "over, error, match",
    [
        (
            {"table": np.array([[3, 12, 1, 5, 6, 0], [2, 7, 4, 9, 6, 0]], np.int32)},
            InputError,
            r"'table'\[0, 1\] = 12 is not a page index in \[0, 10\)",
        ),
        (
            {"table": np.array([[-3, 8, 1, 5, 6, 0], [2, 7, 4, 9, 6, 0]], np.int32)},
            InputError,
            r"'table'\[0, 0\] = -3",
        ),  # a page that is only read is checked too
        (
            {"seqlens": np.array([5, -1], np.int32)},
            InputError,
            r"'seqlens'\[1\] = -1 must be >= 0 \(expected \[0, 22\]\)",
        ),
        (
            {"seqlens": np.array([23, 2], np.int32)},
            CacheCapacityError,
            r"'seqlens'\[0\] = 23 \+ 2 new tokens exceeds max_tokens = 24",
        ),
        (
            {
                "table": np.array([[3, 8, 1, 5, 6, 0], [8, 7, 4, 9, 6, 0]], np.int32),
                "seqlens": np.array([5, 1], np.int32),
            },
            InputError,
            "rows 0 and 1 write logical positions 5 and 1 to the same physical slot",
        ),
        (
            {"table": np.array([[3, 8, 1, 5], [2, 7, 4, 9]], np.int32)},
            InputError,
            r"max_tokens=24 exceeds the 4 blocks of 4 tokens",
        ),
        ({"past": np.zeros((P, 2, H, BS + 1, D), np.float32)}, InputError, r"past 'past' must be \[num_pages, 2"),
        (
            {"K": np.zeros((2, 2, 3 * D), np.float32)},
            InputError,
            r"'K' must be \[batch, seq, kv_num_heads\*head_size\]",
        ),
        ({"seqlens": np.array([5], np.int32)}, InputError, r"'seqlens' must be \[2\] ints"),
    ],
    ids=[
        "page-too-large",
        "read-page-negative",
        "seqlens-negative",
        "capacity",
        "same-slot",
        "max-tokens",
        "past-shape",
        "k-shape",
        "seqlens-shape",
    ],
)
def test_attention_rejections_leave_every_byte_of_the_cache_unchanged(over, error, match):
    sess = onnxkv.Session(attention_model(), threads=1)
    assert_rejected_before_writing(
        sess, _attention_feeds(np.random.default_rng(5), **over), error, match, "PagedAttention node 'attn'"
    )


@pytest.mark.parametrize(
    "name, elem_type, array, match",
    [
        ("past", TensorProto.FLOAT16, np.zeros((P, 2, H, BS, D), np.float16), "past 'past' dtype float16 differs"),
        (
            "V",
            TensorProto.FLOAT16,
            np.zeros((2, 2, H * D), np.float16),
            "'V' dtype float16 differs from Q dtype float32",
        ),
        ("table", TensorProto.FLOAT, np.zeros((2, 6), np.float32), "block table 'table' must be int32/int64"),
    ],
)
def test_attention_rejects_mismatched_dtypes_before_writing(name, elem_type, array, match):
    sess = onnxkv.Session(attention_model(types={name: elem_type}), threads=1)
    assert_rejected_before_writing(
        sess,
        _attention_feeds(np.random.default_rng(8), **{name: array}),
        InputError,
        match,
        "PagedAttention node 'attn'",
    )


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


#: The largest max_tokens (int32 positions) over 2**15 pages of 2**16 tokens: a small table and one page.
BIG_BS, BIG_M = 1 << 16, 1 << 15


def test_max_tokens_beyond_int32_is_a_model_error():
    """The kernels take int32 lengths: with max_tokens = 2**32 + 2**16, seqlens_k = 2**32 + 4 was narrowed to
    4 (5 keys attended, a wrong answer with no error) and 2**31 + 4 wrote the new K/V into past before the
    kernel refused the wrapped length."""
    with pytest.raises(
        ModelError,
        match=r"PagedAttention node 'attn': attribute max_tokens must be at most "
        r"2147483647 \(positions are int32\), got 4295032832",
    ):
        onnxkv.Session(
            attention_model(hq=1, hkv=1, block_size=BIG_BS, max_tokens=2**32 + BIG_BS, head_size=2), threads=1
        )


@pytest.mark.parametrize("offset", [0, 16], ids=["kernel", "gather"])
@pytest.mark.parametrize(
    "seqlen, dtype",
    [
        (2**31 + 4, np.int64),
        (2**32 + 4, np.int64),
        (2**63 - 1, np.int64),
        (2**64 - 1, np.uint64),
        (2**31 - 1, np.int32),
    ],
)
def test_lengths_past_max_tokens_are_refused_before_writing(offset, seqlen, dtype):
    sess = onnxkv.Session(
        attention_model(
            hq=1,
            hkv=1,
            block_size=BIG_BS,
            max_tokens=2**31 - 1,
            head_size=2,
            types={"seqlens": helper.np_dtype_to_tensor_dtype(np.dtype(dtype))},
        ),
        threads=1,
    )
    rng = np.random.default_rng(13)
    past = owned_zeros((1, 2, 1, BIG_BS, 2), np.float32, offset)
    past[...] = rng.standard_normal(past.shape)
    feeds = {name: rng.standard_normal((1, 1, 2)).astype(np.float32) for name in ("Q", "K", "V")}
    feeds.update(past=past, table=np.zeros((1, BIG_M), np.int32), seqlens=np.array([seqlen], dtype))
    assert_rejected_before_writing(
        sess,
        feeds,
        CacheCapacityError,
        rf"'seqlens'\[0\] = {seqlen} \+ 1 new tokens exceeds max_tokens = "
        rf"2147483647 \(expected \[0, 2147483646\]\)$",
        "PagedAttention node 'attn'",
    )


@pytest.mark.parametrize("offset", [0, 16], ids=["kernel", "gather"])
def test_positions_at_the_int32_limit_are_written_and_attended(offset):
    """The last position max_tokens allows: the token lands in the last block's last slot but one, the
    query sees its window of 4 keys, and the table's other entries (-1) are never read."""
    sess = onnxkv.Session(
        attention_model(hq=2, hkv=1, block_size=BIG_BS, max_tokens=2**31 - 1, head_size=2, left_window_size=3),
        threads=1,
    )
    rng = np.random.default_rng(14)
    past = owned_zeros((2, 2, 1, BIG_BS, 2), np.float32, offset)
    past[1] = rng.standard_normal(past.shape[1:])
    table = np.full((1, BIG_M), -1, np.int32)
    table[0, -1] = 1
    pos = 2**31 - 2
    q, k, v = (rng.standard_normal((1, 1, n)).astype(np.float32) for n in (4, 2, 2))
    expected = past.copy()
    expected[1, :, 0, pos % BIG_BS] = np.stack([k[0, 0], v[0, 0]])
    out = sess.run({"Q": q, "K": k, "V": v, "past": past, "table": table, "seqlens": np.array([pos], np.int32)})
    np.testing.assert_array_equal(past, expected)
    keys = expected[1, :, 0, pos % BIG_BS - 3 : pos % BIG_BS + 1]  # [2, 4 keys, 2]
    want = reference_attention(q[0].reshape(1, 2, 2), keys[0][:, None], keys[1][:, None], 3, 1 / np.sqrt(2))
    np.testing.assert_allclose(out["Y"][0].reshape(1, 2, 2), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "seqlens, error, match",
    [
        (np.array([-(2**63), 0], np.int64), InputError, r"'seqlens'\[0\] = -9223372036854775808 must be >= 0"),
        (
            np.array([5, 2**64 - 2], np.uint64),
            CacheCapacityError,
            r"'seqlens'\[1\] = 18446744073709551614 \+ 2 new tokens exceeds max_tokens = 24 \(expected \[0, 22\]\)",
        ),
        (np.array([5.0, 2.0], np.float32), InputError, r"'seqlens' must be \[2\] ints, got float32 \(2,\)"),
    ],
    ids=["int64-min", "uint64", "float"],
)
def test_attention_lengths_are_checked_in_their_own_width(seqlens, error, match):
    sess = onnxkv.Session(attention_model(types={"seqlens": helper.np_dtype_to_tensor_dtype(seqlens.dtype)}), threads=1)
    assert_rejected_before_writing(
        sess, _attention_feeds(np.random.default_rng(5), seqlens=seqlens), error, match, "PagedAttention node 'attn'"
    )


@pytest.mark.parametrize("window", [24, 2**62 + 5, 2**63 - 1])
def test_a_window_of_max_tokens_or_more_is_no_window(window):
    rng = np.random.default_rng(15)
    feeds = _attention_feeds(rng)
    want = onnxkv.Session(attention_model(), threads=1).run(dict(feeds, past=feeds["past"].copy()))
    got = onnxkv.Session(attention_model(left_window_size=window), threads=1).run(feeds)
    # the two caches' alignments may differ (in place kernel vs gather): equal up to summation order
    np.testing.assert_allclose(got["Y"], want["Y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["present"], want["present"])


@pytest.mark.parametrize("table", [None, np.full((2, 6), -1, np.int32)], ids=["pages", "no-pages"])
def test_zero_new_tokens_write_nothing(table):
    """No query, no write: nothing changes, and the block table is not looked at (-1 was refused)."""
    rng = np.random.default_rng(11)
    feeds = _attention_feeds(rng) if table is None else _attention_feeds(rng, table=table)
    for name in ("Q", "K", "V"):
        feeds[name] = feeds[name][:, :0].copy()
    before = feeds["past"].copy()
    out = onnxkv.Session(attention_model(), threads=1).run(feeds)
    assert out["Y"].shape == (2, 0, 4 * D)
    np.testing.assert_array_equal(feeds["past"], before)
    update = _update_feeds(rng, new=np.zeros((2, H, 0, D), np.float32))
    before = update["past"].copy()
    onnxkv.Session(update_model(), threads=1).run(update)
    np.testing.assert_array_equal(update["past"], before)


@pytest.mark.parametrize(
    "attrs, match",
    [
        ({"is_causal": 0, "left_window_size": 2}, "needs is_causal=1"),
        ({"num_heads": 3}, "multiple of kv_num_heads"),
        ({"max_tokens": 0}, "max_tokens is required"),
        ({"left_window_size": -2}, "left_window_size must be >= -1"),
        ({"softcap": -1.0}, "softcap must be >= 0"),
    ],
)
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
    # alignment of the two caches may differ (in place kernel vs gather): equal up to summation order
    np.testing.assert_allclose(got["Y"], expected["Y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["present"], expected["present"])


# -- the paged decoder model (onnxkv.zoo.paged) in a persistent state ------------------------------------------


def reference_decoder(weights, hidden, logical, seqlens, cfg):
    """Float64 forward of :func:`build_paged_model`; appends each layer's new K/V to ``logical[layer][row]``."""
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    b, s, _ = hidden.shape
    x = hidden.astype(np.float64)
    for layer, w in enumerate(weights):
        q, k, v = (x @ getattr(w, name).astype(np.float64) for name in ("q_proj", "k_proj", "v_proj"))
        y = np.empty((b, s, hq * d))
        for row in range(b):
            new = np.stack([k[row].reshape(s, hkv, d), v[row].reshape(s, hkv, d)], axis=1)
            logical[layer][row] = np.concatenate([logical[layer][row], new])
            kv = logical[layer][row]
            y[row] = reference_attention(
                q[row].reshape(s, hq, d),
                kv[:, 0],
                kv[:, 1],
                int(seqlens[row]),
                1 / np.sqrt(d),
                cfg.softcap,
                cfg.left_window_size,
                bool(cfg.is_causal),
            ).reshape(s, hq * d)
        x = x + y @ w.o_proj.astype(np.float64)
    return x


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"num_layers": 2, "left_window_size": 5, "dtype": "float16"},
        {"num_layers": 2, "softcap": 3.0, "block_size": 2, "max_blocks": 12, "num_kv_heads": 1},
        {"is_causal": 0},
        {"num_kv_heads": 1, "block_size": 2, "max_blocks": 12, "left_window_size": 3, "dtype": "float16"},
    ],
    ids=["fp32", "fp16-window", "softcap-mqa-small-pages", "non-causal", "fp16-pages-below-64-bytes"],
)
def test_paged_model_state_writes_in_place_and_matches_dense_reference(config):
    cfg = PagedConfig(num_pages=30, **config)
    weights = paged_weights(cfg, seed=3)
    sess = onnxkv.Session(build_paged_model(cfg, weights), threads=1)
    assert sess.declared_bindings == {f"past.{i}": f"present.{i}" for i in range(cfg.num_layers)}
    rng = np.random.default_rng(9)
    batch = 2
    table = shuffled_table(rng, batch, cfg.max_blocks, cfg.num_pages).astype(np.int32)
    logical = [[np.zeros((0, 2, cfg.num_kv_heads, cfg.head_size)) for _ in range(batch)] for _ in range(cfg.num_layers)]
    seqlens = np.zeros(batch, np.int32)
    tol = 2e-2 if cfg.dtype == "float16" else 1e-4
    with sess.new_state() as state:
        storage = None
        for s in (6, 1, 1, 4, 1):  # prefill, decode, decode, a chunk, decode
            hidden = rng.standard_normal((batch, s, cfg.hidden_size)).astype(cfg.dtype)
            out = state.run({"hidden": hidden, "block_table": table, "seqlens_k": seqlens})
            assert set(out) == {"output"}
            want = reference_decoder(weights, hidden, logical, seqlens, cfg)
            np.testing.assert_allclose(out["output"].astype(np.float64), want, rtol=tol, atol=tol)
            seqlens = seqlens + s
            held = [state.values[f"past.{i}"] for i in range(cfg.num_layers)]
            storage = storage or held
            assert all(np.shares_memory(a, b) for a, b in zip(held, storage))  # the same pages every step
        for i in range(cfg.num_layers):
            pages = storage[i]
            for row in range(batch):
                bs = cfg.block_size
                got = np.stack([pages[table[row, t // bs], :, :, t % bs] for t in range(int(seqlens[row]))])
                np.testing.assert_allclose(got.astype(np.float64), logical[i][row], rtol=tol, atol=tol)


def gqa_twin(cfg, weights):
    """The same decoder with GroupQueryAttention over contiguous [1, Hkv, T, D] past/present tensors."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(cfg.dtype))
    nodes, inits, inputs, outputs = (
        [],
        [],
        [
            vi("hidden", elem, [1, "seq", cfg.hidden_size]),
            vi("seqlens_k", TensorProto.INT32, [1]),
            vi("total", TensorProto.INT32, []),
        ],
        [],
    )
    x = "hidden"
    for i, w in enumerate(weights):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            inits.append(onnx.numpy_helper.from_array(getattr(w, name), f"{name}.{i}"))
        for name in ("q", "k", "v"):
            nodes.append(helper.make_node("MatMul", [x, f"{name}_proj.{i}"], [f"{name}.{i}"]))
        kv = [1, cfg.num_kv_heads, "T", cfg.head_size]
        inputs += [vi(f"past_key.{i}", elem, kv), vi(f"past_value.{i}", elem, kv)]
        outputs += [vi(f"present_key.{i}", elem, kv), vi(f"present_value.{i}", elem, kv)]
        window = cfg.left_window_size + 1 if cfg.left_window_size >= 0 else -1
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [f"q.{i}", f"k.{i}", f"v.{i}", f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total"],
                [f"y.{i}", f"present_key.{i}", f"present_value.{i}"],
                domain="com.microsoft",
                num_heads=cfg.num_heads,
                kv_num_heads=cfg.num_kv_heads,
                local_window_size=window,
                softcap=float(cfg.softcap),
            )
        )
        nodes.append(helper.make_node("MatMul", [f"y.{i}", f"o_proj.{i}"], [f"o.{i}"]))
        nodes.append(helper.make_node("Add", [x, f"o.{i}"], [f"x.{i}"]))
        x = f"x.{i}"
    nodes.append(helper.make_node("Identity", [x], ["output"]))
    outputs.insert(0, vi("output", elem, [1, "seq", cfg.hidden_size]))
    graph = helper.make_graph(nodes, "gqa_twin", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_model_matches_the_group_query_attention_twin(dtype, threads):
    cfg = PagedConfig(num_layers=2, left_window_size=4, num_pages=16, dtype=dtype)
    weights = paged_weights(cfg, seed=5)
    paged = onnxkv.Session(build_paged_model(cfg, weights), threads=threads)
    twin = onnxkv.Session(gqa_twin(cfg, weights), threads=1)
    rng = np.random.default_rng(10)
    table = rng.permutation(cfg.num_pages)[None, : cfg.max_blocks].astype(np.int32)  # shuffled pages, one row
    past = {
        f"past_{kind}.{i}": np.zeros((1, cfg.num_kv_heads, 0, cfg.head_size), dtype)
        for i in range(cfg.num_layers)
        for kind in ("key", "value")
    }
    total = 0
    tol = 1e-2 if dtype == "float16" else 1e-5
    with paged.new_state() as state:
        for s in (7, 1, 1, 1, 3):
            hidden = rng.standard_normal((1, s, cfg.hidden_size)).astype(dtype)
            got = state.run({"hidden": hidden, "block_table": table, "seqlens_k": np.array([total], np.int32)})
            total += s
            ref = twin.run(
                {
                    "hidden": hidden,
                    "seqlens_k": np.array([total - 1], np.int32),
                    "total": np.array(total, np.int32),
                    **past,
                }
            )
            past = {name: ref[name.replace("past", "present")] for name in past}
            np.testing.assert_allclose(
                got["output"].astype(np.float32), ref["output"].astype(np.float32), rtol=tol, atol=tol
            )


@pytest.mark.parametrize("total", [5, 2**31 - 1])
def test_group_query_attention_refuses_a_total_length_past_its_cache_before_growing_it(total):
    """total_sequence_length sizes the present: 2**31 - 1 after a 3-token prompt made the state grow its
    cache to 2**31 - 1 positions (a 128 GiB allocation) before anything refused it."""
    cfg = PagedConfig(num_layers=1, num_pages=16)
    sess = onnxkv.Session(gqa_twin(cfg, paged_weights(cfg, seed=5)), threads=1)
    rng = np.random.default_rng(16)
    with sess.new_state() as state:
        hidden = rng.standard_normal((1, 3, cfg.hidden_size)).astype(np.float32)
        state.run({"hidden": hidden, "seqlens_k": np.array([2], np.int32), "total": np.array(3, np.int32)})
        before = {name: value.copy() for name, value in state.values.items()}
        hidden = rng.standard_normal((1, 1, cfg.hidden_size)).astype(np.float32)
        with pytest.raises(
            InputError,
            match=rf"total_sequence_length must be in \[1, 4\] \(past length 3 \+ 1 "
            rf"new tokens\), got {total}",
        ):
            state.run({"hidden": hidden, "seqlens_k": np.array([3], np.int32), "total": np.array(total, np.int32)})
        assert state.length == 3
        for name, value in state.values.items():
            np.testing.assert_array_equal(value, before[name])


@pytest.mark.parametrize(
    "config, in_place",
    [
        ({}, True),  # 128-byte page halves in a state's 64-byte aligned storage
        ({"num_kv_heads": 1, "block_size": 2, "max_blocks": 12, "dtype": "float16"}, False),  # 32-byte halves
    ],
    ids=["aligned-pages", "pages-below-64-bytes"],
)
def test_aligned_pages_are_read_in_place_by_the_paged_kernel(monkeypatch, config, in_place):
    calls = []
    kernel = paged_ops._kernels.paged_attention

    def spy(*args, **kwargs):
        calls.append(args[3].copy())  # the block table the kernel reads
        return kernel(*args, **kwargs)

    monkeypatch.setattr(paged_ops._kernels, "paged_attention", spy)
    cfg = PagedConfig(num_layers=2, num_pages=30, **config)
    sess = onnxkv.Session(build_paged_model(cfg), threads=1)
    table = shuffled_table(np.random.default_rng(12), 1, cfg.max_blocks, cfg.num_pages).astype(np.int32)
    with sess.new_state() as state:
        for step, s in enumerate((5, 1)):
            hidden = np.random.default_rng(step).standard_normal((1, s, cfg.hidden_size)).astype(cfg.dtype)
            state.run({"hidden": hidden, "block_table": table, "seqlens_k": np.array([5 * step], np.int32)})
    assert len(calls) == (4 if in_place else 0)  # one call per layer and step, or none
    if in_place:
        blocks = (6 + cfg.block_size - 1) // cfg.block_size  # 6 tokens after the second step
        np.testing.assert_array_equal(calls[-1][0, :blocks], table[0, :blocks])
        assert (calls[-1][0, blocks:] == -1).all()  # entries past the row's length are never handed over
