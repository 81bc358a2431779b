"""ai.rt::QuantizePagedCache: per-page formats of an explicit paged cache, read by PagedAttention."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from test_paged_ops import reference_attention, reference_decoder, shuffled_table, update_model, vi

import onnxkv
from onnxkv import ContractError, InputError, ModelError, OutOfMemory
from onnxkv.alloc import ArenaAllocator
from onnxkv.cache.formats import decode_header, page_bytes, page_format, params_for
from onnxkv.cache.page_set import PageSet, PlaneTarget
from onnxkv.model.contract import Access, OutputAlias, set_access, set_output_alias
from onnxkv.plan.ops import paged as paged_ops
from onnxkv.zoo.paged import PagedConfig, build_paged_model, paged_weights

P, HQ, H, BS, D = 12, 4, 2, 4, 8
ZP_TYPES = {
    "int8": (np.int8, TensorProto.INT8),
    "uint8": (np.uint8, TensorProto.UINT8),
    "int4": (ml_dtypes.int4, TensorProto.INT4),
    "uint4": (ml_dtypes.uint4, TensorProto.UINT4),
    "int2": (ml_dtypes.int2, TensorProto.INT2),
    "uint2": (ml_dtypes.uint2, TensorProto.UINT2),
    "float32": (np.float32, TensorProto.FLOAT),
    "float16": (np.float16, TensorProto.FLOAT16),
    "bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16),
    "int16": (np.int16, TensorProto.INT16),
}


def quantize_model(
    k_fmt="int8",
    v_fmt="int8",
    attend=True,
    dtype=TensorProto.FLOAT,
    cache_shape=None,
    scale_type=TensorProto.FLOAT,
    **attrs,
):
    """``c = QuantizePagedCache(past, blocks, ks, kz, vs, vz)`` (node attributes ``attrs``), then
    (``attend``) ``PagedAttention`` over ``c``."""
    shape = cache_shape or ["P", 2, H, BS, D]
    nodes = [
        helper.make_node(
            "QuantizePagedCache",
            ["past", "blocks", "ks", "kz", "vs", "vz"],
            ["c"],
            domain="ai.rt",
            name="quantize",
            **attrs,
        )
    ]
    inputs = [
        vi("past", dtype, shape),
        vi("blocks", TensorProto.INT64, ["N"]),
        vi("ks", scale_type, None),
        vi("kz", ZP_TYPES[k_fmt][1], None),
        vi("vs", TensorProto.FLOAT, None),
        vi("vz", ZP_TYPES[v_fmt][1], None),
    ]
    outputs = [vi("c", dtype, shape)]
    if attend:
        nodes.append(
            helper.make_node(
                "PagedAttention",
                ["Q", "K", "V", "c", "table", "seqlens"],
                ["Y", "present"],
                domain="ai.rt",
                name="attn",
                num_heads=HQ,
                kv_num_heads=H,
                block_size=BS,
                max_tokens=16,
            )
        )
        inputs += [
            vi("Q", dtype, ["B", "S", HQ * D]),
            vi("K", dtype, ["B", "S", H * D]),
            vi("V", dtype, ["B", "S", H * D]),
            vi("table", TensorProto.INT32, ["B", "M"]),
            vi("seqlens", TensorProto.INT32, ["B"]),
        ]
        outputs = [vi("Y", dtype, ["B", "S", HQ * D]), vi("present", dtype, shape)]
    m = helper.make_model(
        helper.make_graph(nodes, "quantize_paged", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.rt", 1)],
        ir_version=13,
    )
    set_output_alias(m.graph.node[0], [OutputAlias(0, 0)])
    if attend:
        set_output_alias(m.graph.node[1], [OutputAlias(1, 3)])
    set_access(m.graph.input[0], Access.READ_WRITE)
    return m


def params(pages_f32, fmt, per_channel):
    """Scales and zero points (fed types) from params_for over ``pages_f32`` [N, H, bs, D]."""
    n, h, _, d = pages_f32.shape
    out = [params_for(x.astype(np.float32), fmt, "channel" if per_channel else "head") for x in pages_f32]
    shape = (n, h, d) if per_channel else (n, h)
    scale = np.stack([s for s, _ in out]).reshape(shape)
    zero = np.stack([z for _, z in out]).reshape(shape).astype(ZP_TYPES[fmt][0])
    return scale, zero


def marker(fmt):
    return np.zeros(0, np.float32), np.zeros(0, ZP_TYPES[fmt][0])


def slot_addresses(pages):
    """uint64 [2, P]: the address of every (plane, page) slot of a [P, 2, H, bs, D] tensor."""
    base = pages.__array_interface__["data"][0]
    return (base + np.arange(2)[:, None] * pages.strides[1] + np.arange(len(pages))[None] * pages.strides[0]).astype(
        np.uint64
    )


def logical_kv(handle, table, row, length, bs=BS):
    """Float32 [length, 2, H, D] of ``row`` read through the handle (every page in its own format)."""
    return np.stack(
        [
            np.stack([handle.page_values(plane, int(table[row, t // bs]))[:, t % bs] for plane in (0, 1)])
            for t in range(length)
        ]
    )


@pytest.mark.parametrize(
    "k_fmt, v_fmt, k_channel, dtype",
    [
        ("int8", "uint4", True, np.float32),
        ("int4", "int8", False, np.float32),
        ("uint2", "int2", True, np.float32),
        ("uint8", "float16", False, np.float32),
        ("int8", "bfloat16", True, np.float16),
        ("uint4", "int4", False, np.float16),
    ],
)
def test_quantized_pages_are_replaced_and_read_by_attention(k_fmt, v_fmt, k_channel, dtype):
    rng = np.random.default_rng(1)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    sess = onnxkv.Session(quantize_model(k_fmt, v_fmt, dtype=elem), threads=1)
    past = rng.standard_normal((P, 2, H, BS, D)).astype(dtype)
    table = shuffled_table(rng, 2, 4, P).astype(np.int32)
    seqlens = np.array([8, 5], np.int32)
    full = np.array([table[0, 0], table[0, 1], table[1, 0]], np.int64)
    ks, kz = params(past[full, 0], k_fmt, k_channel)
    vs, vz = marker(v_fmt) if page_format(v_fmt).is_float else params(past[full, 1], v_fmt, False)
    slots = slot_addresses(past)
    before = past.copy()
    q = rng.standard_normal((2, 2, HQ * D)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, H * D)).astype(dtype) for _ in range(2))
    out = sess.run(
        {
            "past": past,
            "blocks": full,
            "ks": ks,
            "kz": kz,
            "vs": vs,
            "vz": vz,
            "Q": q,
            "K": k,
            "V": v,
            "table": table,
            "seqlens": seqlens,
        }
    )
    handle = PageSet.of(out["present"])
    assert handle is PageSet.of(past) and out["present"] is past
    keep = np.setdiff1d(np.arange(P), full)
    np.testing.assert_array_equal(handle.ptrs[:, keep], slots[:, keep])  # unselected pages keep their storage
    assert (handle.ptrs[:, full] != slots[:, full]).all()
    assert (handle.formats[0, full] == page_format(k_fmt).code).all()
    assert (handle.formats[1, full] == page_format(v_fmt).code).all()
    assert handle.groups == [D if k_channel else 1, 0 if page_format(v_fmt).is_float else 1]
    for i, p in enumerate(full):  # per-head / per-channel QuantizeLinear with the given parameters
        f = page_format(k_fmt)
        s, z = ks[i][..., None, None] if not k_channel else ks[i][:, None], kz[i].astype(np.float32)
        z = z[..., None, None] if not k_channel else z[:, None]
        want = (np.clip(np.rint(before[p, 0].astype(np.float32) / s) + z, f.qmin, f.qmax) - z) * s
        np.testing.assert_array_equal(handle.page_values(0, int(p)), want.astype(np.float32))
    untouched = np.setdiff1d(keep, [table[0, 2], table[1, 1]])  # pages the new tokens did not go to
    np.testing.assert_array_equal(past[untouched], before[untouched])
    for row in range(2):
        kv = logical_kv(handle, table, row, int(seqlens[row]) + 2)
        np.testing.assert_array_equal(kv[seqlens[row] :, 0], k[row].reshape(2, H, D))  # appended to float pages
        want = reference_attention(q[row].reshape(2, HQ, D), kv[:, 0], kv[:, 1], int(seqlens[row]), 1 / np.sqrt(D))
        tol = 1e-5 if dtype == np.float32 else 2e-3
        np.testing.assert_allclose(out["Y"][row].reshape(2, HQ, D).astype(np.float64), want, rtol=tol, atol=tol)
    handle.audit()


def channel_zp_feed(pages_f32, fmt):
    """Key parameters of a channel-zp plane for ``pages_f32`` [N, H, bs, D]: scale [N, H, D] equal within
    each head (float32), zero points [N, H, D] of the format's type centring each channel (clipped)."""
    f = page_format(fmt)
    x = pages_f32.astype(np.float64)
    ctr = (x.max(axis=2) + x.min(axis=2)) / 2  # [N, H, D]
    hr = ((x.max(axis=2) - x.min(axis=2)) / 2).max(axis=2, keepdims=True)  # [N, H, 1]
    scale = np.broadcast_to(hr / ((f.qmax - f.qmin) // 2 - 1), ctr.shape).astype(np.float32)
    zero = np.clip(np.rint((f.qmin + f.qmax + 1) // 2 - ctr / scale), f.qmin, f.qmax)
    return np.ascontiguousarray(scale), zero.astype(ZP_TYPES[fmt][0])


@pytest.mark.parametrize("k_fmt", ["int8", "uint8"])
def test_channel_zp_key_pages_are_replaced_and_read_by_attention(k_fmt):
    rng = np.random.default_rng(11)
    sess = onnxkv.Session(quantize_model(k_fmt, "int8", key_channel_zero_points=1), threads=1)
    past = rng.standard_normal((P, 2, H, BS, D)).astype(np.float32)
    past[:, 0] += rng.uniform(-6, 6, (1, 1, 1, D)).astype(np.float32)  # keys: per-channel offsets
    table = shuffled_table(rng, 2, 4, P).astype(np.int32)
    seqlens = np.array([8, 5], np.int32)
    full = np.array([table[0, 0], table[0, 1], table[1, 0]], np.int64)
    ks, kz = channel_zp_feed(past[full, 0], k_fmt)
    vs, vz = params(past[full, 1], "int8", False)
    slots, before = slot_addresses(past), past.copy()
    q = rng.standard_normal((2, 2, HQ * D)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, H * D)).astype(np.float32) for _ in range(2))
    out = sess.run(
        {
            "past": past,
            "blocks": full,
            "ks": ks,
            "kz": kz,
            "vs": vs,
            "vz": vz,
            "Q": q,
            "K": k,
            "V": v,
            "table": table,
            "seqlens": seqlens,
        }
    )
    handle = PageSet.of(past)
    keep = np.setdiff1d(np.arange(P), full)
    np.testing.assert_array_equal(handle.ptrs[:, keep], slots[:, keep])  # unselected pages keep their storage
    assert (handle.ptrs[:, full] != slots[:, full]).all()
    assert handle.groups == [D, 1] and handle.headers == ["channel-zp", "float32"]
    f = page_format(k_fmt)
    for i, p in enumerate(full):
        payload = handle.payloads.pages[0][int(p)]
        assert payload.nbytes == page_bytes(k_fmt, H, BS, D, D, "channel-zp")
        s, z = decode_header(payload, k_fmt, H, D, "channel-zp")
        np.testing.assert_array_equal(s, ks[i].reshape(-1))
        np.testing.assert_array_equal(z, kz[i].reshape(-1).astype(np.float32))
        s, z = ks[i][:, None], kz[i].astype(np.float32)[:, None]
        want = (np.clip(np.rint(before[p, 0] / s) + z, f.qmin, f.qmax) - z) * s
        np.testing.assert_array_equal(handle.page_values(0, int(p)), want.astype(np.float32))
    for row in range(2):
        kv = logical_kv(handle, table, row, int(seqlens[row]) + 2)
        want = reference_attention(q[row].reshape(2, HQ, D), kv[:, 0], kv[:, 1], int(seqlens[row]), 1 / np.sqrt(D))
        np.testing.assert_allclose(out["Y"][row].reshape(2, HQ, D).astype(np.float64), want, rtol=1e-5, atol=1e-5)
    handle.audit()


@pytest.mark.parametrize(
    "over, match",
    [
        (
            {"ks": np.full((2, H), 0.05, np.float32), "kz": np.zeros((2, H), np.int8)},
            r"scale 'ks' must be \[2, 2, 8\] for channel-zp pages",
        ),
        (
            {"ks": np.full((2, H, D), 0.05, np.float32) + np.float32(0.01) * (np.arange(D) == 5)},
            r"page 0 of scale 'ks' / zero point 'kz': scale\[5\] = .* differs from scale\[0\] = .*one scale per head",
        ),
    ],
    ids=["per-head-shape", "scales-differ-in-a-head"],
)
def test_channel_zp_rejections_leave_the_cache_unchanged(over, match):
    rng = np.random.default_rng(12)
    sess = onnxkv.Session(quantize_model(attend=False, key_channel_zero_points=1), threads=1)
    feeds = _feeds(rng, kz=np.zeros((2, H, D), np.int8), ks=np.full((2, H, D), 0.05, np.float32))
    feeds.update(over)
    handle = assert_rejected(sess, feeds, match)
    assert handle.headers == ["float32", "float32"]


def test_channel_zp_and_float32_key_pages_do_not_mix_in_a_plane():
    rng = np.random.default_rng(13)
    past = rng.standard_normal((P, 2, H, BS, D)).astype(np.float32)
    per_channel = onnxkv.Session(quantize_model(attend=False), threads=1)
    czp = onnxkv.Session(quantize_model(attend=False, key_channel_zero_points=1), threads=1)
    ks, kz = params(past[[3, 7], 0], "int8", True)
    vs, vz = params(past[[3, 7], 1], "int8", False)
    per_channel.run({"past": past, "blocks": np.array([3, 7]), "ks": ks, "kz": kz, "vs": vs, "vz": vz})
    handle = PageSet.of(past)
    assert handle.headers == ["float32", "float32"] and handle.groups == [D, 1]
    fmts = handle.formats.copy()
    ks, kz = channel_zp_feed(past[[4], 0], "int8")
    with pytest.raises(
        InputError,
        match=r"scale 'ks' gives channel-zp scales but plane 0 already holds pages "
        r"quantized per channel \(e.g. page 3\); one granularity per plane",
    ):
        czp.run({"past": past, "blocks": np.array([4]), "ks": ks, "kz": kz, "vs": vs[:1], "vz": vz[:1]})
    np.testing.assert_array_equal(handle.formats, fmts)


def test_key_channel_zero_points_attribute_is_checked():
    with pytest.raises(ModelError, match="key_channel_zero_points must be 0 or 1, got 2"):
        onnxkv.Session(quantize_model(attend=False, key_channel_zero_points=2), threads=1)


def _feeds(rng, **over):
    past = rng.standard_normal((P, 2, H, BS, D)).astype(np.float32)
    feeds = {
        "past": past,
        "blocks": np.array([3, 7]),
        "ks": np.full((2, H), 0.05, np.float32),
        "kz": np.zeros((2, H), np.int8),
        "vs": np.full((2, H), 0.05, np.float32),
        "vz": np.zeros((2, H), np.int8),
    }
    feeds.update(over)
    return feeds


@pytest.mark.parametrize(
    "over, match",
    [
        ({"blocks": np.array([3, 12])}, r"block_indices 'blocks'\[1\] = 12 is not a page id in \[0, 12\)"),
        ({"blocks": np.array([5, 5])}, "block_indices 'blocks' must be distinct, page 5 is selected 2 times"),
        ({"ks": np.array([[0.1, 0.0], [0.1, 0.1]], np.float32)}, r"scale 'ks'\[0, 1\] = .*finite and > 0"),
        ({"vs": np.array([[0.1, np.nan], [0.1, 0.1]], np.float32)}, r"scale 'vs'\[0, 1\] = .*finite and > 0"),
        ({"ks": np.full((3, H), 0.1, np.float32)}, r"scale 'ks' must be \[2, 2\] .* or \[2, 2, 8\]"),
        ({"kz": np.zeros((2, H, D), np.int8)}, r"'ks' shape \[2, 2\] differs from zero point 'kz' shape \[2, 2, 8\]"),
    ],
    ids=["index-range", "duplicate", "zero-scale", "nan-scale", "scale-shape", "zp-shape"],
)
def test_rejections_name_the_value_and_leave_the_cache_unchanged(over, match):
    rng = np.random.default_rng(2)
    sess = onnxkv.Session(quantize_model(attend=False), threads=1)
    assert_rejected(sess, _feeds(rng, **over), match)


def assert_rejected(sess, feeds, match):
    """Run ``feeds`` expecting the node's InputError matching ``match``; assert the cache's bytes, addresses
    and formats are unchanged and nothing was converted; return the cache's handle."""
    handle = PageSet.attach(feeds["past"])
    state = (feeds["past"].copy(), handle.ptrs.copy(), handle.formats.copy())
    with pytest.raises(InputError, match=match) as info:
        sess.run(feeds)
    assert "QuantizePagedCache node 'quantize'" in str(info.value)
    for a, b in zip((feeds["past"], handle.ptrs, handle.formats), state):
        np.testing.assert_array_equal(a, b)
    assert not handle.any_converted
    return handle


@pytest.mark.parametrize(
    "k_fmt, scale_type, over, match",
    [
        (
            "int16",
            TensorProto.FLOAT,
            {"kz": np.zeros((2, H), np.int16)},
            "zero point 'kz' has element type int16; expected one of int8",
        ),
        ("int8", TensorProto.DOUBLE, {"ks": np.full((2, H), 0.1)}, "scale 'ks' must be float32, got float64"),
    ],
    ids=["zero-point-type", "scale-type"],
)
def test_element_types_are_checked_before_anything_changes(k_fmt, scale_type, over, match):
    rng = np.random.default_rng(3)
    sess = onnxkv.Session(quantize_model(k_fmt, "int8", attend=False, scale_type=scale_type), threads=1)
    feeds = _feeds(rng, **over)
    before = feeds["past"].copy()
    with pytest.raises(InputError, match=match):
        sess.run(feeds)
    np.testing.assert_array_equal(feeds["past"], before)
    assert PageSet.of(feeds["past"]) is None


def test_granularity_must_match_pages_already_quantized():
    rng = np.random.default_rng(4)
    sess = onnxkv.Session(quantize_model("int8", "float32", attend=False), threads=1)
    feeds = _feeds(rng, vs=np.zeros(0, np.float32), vz=np.zeros(0, np.float32))
    sess.run(feeds)
    handle = PageSet.of(feeds["past"])
    assert handle.formats[:, [3, 7]].tolist() == [[3, 3], [1, 1]] and handle.groups == [1, 0]
    before = feeds["past"].copy()
    with pytest.raises(InputError, match="per-channel scales but plane 0 already holds pages quantized per head"):
        sess.run(
            dict(feeds, blocks=np.array([1]), ks=np.full((1, H, D), 0.1, np.float32), kz=np.zeros((1, H, D), np.int8))
        )
    np.testing.assert_array_equal(feeds["past"], before, strict=True)
    assert (handle.formats[0] == 3).sum() == 2


def test_a_float_marker_dequantizes_and_the_cache_type_returns_pages_to_the_tensor():
    rng = np.random.default_rng(5)
    feeds = _feeds(rng)
    onnxkv.Session(quantize_model(attend=False), threads=1).run(feeds)
    handle = PageSet.of(feeds["past"])
    int8 = handle.page_values(0, 3)
    sess = onnxkv.Session(quantize_model("bfloat16", "float32", attend=False), threads=1)
    sess.run(dict(feeds, blocks=np.array([3]), kz=np.zeros(0, ml_dtypes.bfloat16), vz=np.zeros((0,), np.float32)))
    assert handle.formats[:, 3].tolist() == [16, 1] and handle.formats[:, 7].tolist() == [3, 3]
    np.testing.assert_allclose(handle.page_values(0, 3), int8, rtol=2**-8)
    np.testing.assert_array_equal(handle.page_values(1, 3), feeds["past"][3, 1])  # back in its slot
    assert np.isnan(feeds["past"][3, 0]).all() and np.isnan(feeds["past"][7]).all()


def test_events_count_the_payloads_allocated():
    rng = np.random.default_rng(6)
    sess = onnxkv.Session(quantize_model(attend=False), threads=1, events=True)
    feeds = _feeds(rng)
    sess.run(feeds)
    (ev,) = [e for e in sess.events if e.op == "QuantizePagedCache"]
    assert ev.allocations == 4  # 2 pages x 2 planes, each allocated once
    assert ev.allocated_bytes == PageSet.of(feeds["past"]).payload_bytes == 4 * (64 + H * BS * D)


def test_no_selected_pages_change_nothing():
    rng = np.random.default_rng(7)
    feeds = _feeds(
        rng,
        blocks=np.zeros(0, np.int64),
        ks=np.zeros((0, H), np.float32),
        kz=np.zeros((0, H), np.int8),
        vs=np.zeros((0, H), np.float32),
        vz=np.zeros((0, H), np.int8),
    )
    before = feeds["past"].copy()
    out = onnxkv.Session(quantize_model(attend=False), threads=1).run(feeds)
    assert out["c"] is feeds["past"] and PageSet.of(feeds["past"]) is None
    np.testing.assert_array_equal(feeds["past"], before)


def test_build_and_shape_checks():
    model = quantize_model(attend=False)
    model.graph.initializer.append(
        helper.make_tensor("past", TensorProto.FLOAT, [1, 2, H, BS, D], np.zeros(2 * H * BS * D, np.float32))
    )
    with pytest.raises(ModelError, match="MUST_ALIAS input 'past' is an initializer"):
        onnxkv.Session(model, threads=1)
    with pytest.raises(ContractError, match=r"dim 1 of 'past' is 3, but K/V index \(2\) is 2"):
        onnxkv.Session(quantize_model(attend=False, cache_shape=[P, 3, H, BS, D]), threads=1)


def test_writes_into_converted_pages_are_rejected_before_writing():
    rng = np.random.default_rng(8)
    sess = onnxkv.Session(quantize_model(), threads=1)
    past = rng.standard_normal((P, 2, H, BS, D)).astype(np.float32)
    table = np.array([[3, 4, 5, 6]], np.int32)
    q = rng.standard_normal((1, 1, HQ * D)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, H * D)).astype(np.float32) for _ in range(2))
    feeds = {
        "past": past,
        "blocks": np.array([4]),
        "ks": np.full((1, H), 0.05, np.float32),
        "kz": np.zeros((1, H), np.int8),
        "vs": np.full((1, H), 0.05, np.float32),
        "vz": np.zeros((1, H), np.int8),
        "Q": q,
        "K": k,
        "V": v,
        "table": table,
        "seqlens": np.array([6], np.int32),
    }  # token 6 goes to page 4 (block 1), which this run quantizes
    original = past.copy()
    with pytest.raises(
        InputError,
        match="PagedAttention node 'attn': a new token goes to page 4 of cache 'c', which "
        r"QuantizePagedCache converted to int8 \(plane 0\).*quantize only full pages",
    ):
        sess.run(feeds)
    # the caller's cache is the node's output (MUST_ALIAS): the conversion stays, no token was written
    handle = PageSet.of(past)
    unconverted = np.arange(P) != 4
    np.testing.assert_array_equal(past[unconverted], original[unconverted])
    assert handle.formats[:, 4].tolist() == [3, 3] and np.isnan(past[4]).all()
    handle.audit()
    sess.run(dict(feeds, seqlens=np.array([8], np.int32)))  # token 8 goes to page 5: the conversion stays
    assert handle.formats[:, 4].tolist() == [3, 3] and np.isnan(past[4]).all()
    converted = past.copy()
    with pytest.raises(InputError, match="page 4"):
        sess.run(
            dict(
                feeds,
                blocks=np.zeros(0, np.int64),
                ks=np.zeros((0, H), np.float32),
                kz=np.zeros((0, H), np.int8),
                vs=np.zeros((0, H), np.float32),
                vz=np.zeros((0, H), np.int8),
            )
        )
    np.testing.assert_array_equal(past, converted)
    assert handle.formats[:, 4].tolist() == [3, 3]
    # PagedCacheUpdate on a one-plane page tensor with a converted page
    cache = rng.standard_normal((P, H, BS, D)).astype(np.float32)
    PageSet.attach(cache).convert(np.array([2]), [PlaneTarget("float16")])
    update = onnxkv.Session(update_model(cache_shape=(P, H, BS, D)), threads=1)
    before = cache.copy()
    new = rng.standard_normal((1, H, 2, D)).astype(np.float32)
    with pytest.raises(
        InputError,
        match="PagedCacheUpdate node 'update': a new token goes to page 2 of cache 'past', "
        "which QuantizePagedCache converted to float16",
    ):
        update.run({"past": cache, "table": np.array([[1, 2]]), "new": new, "pos": np.array(3)})
    np.testing.assert_array_equal(cache, before)
    update.run({"past": cache, "table": np.array([[1, 0]]), "new": new, "pos": np.array(2)})  # native pages: fine
    np.testing.assert_array_equal(cache[1, :, 2:], new[0])


def test_a_state_storage_is_never_converted_from_outside_the_state():
    cfg = PagedConfig(key_format="int8")
    sess = onnxkv.Session(build_paged_model(cfg), threads=1)
    outside = onnxkv.Session(quantize_model(attend=False, cache_shape=list(cfg.past_shape)), threads=1)
    with sess.new_state() as state:
        hidden = np.random.default_rng(10).standard_normal((1, 8, cfg.hidden_size)).astype(np.float32)
        state.run(
            {
                "hidden": hidden,
                "block_table": np.arange(cfg.max_blocks, dtype=np.int32)[None],
                "seqlens_k": np.zeros(1, np.int32),
            }
        )
        storage = state.values["past.0"]
        storage.flags.writeable = True  # a caller forcing its view of the state's storage writable
        before = storage.copy()
        with pytest.raises(
            InputError, match="QuantizePagedCache node 'quantize': cache 'past' is storage bound to a state"
        ):
            outside.run(_feeds(np.random.default_rng(11), past=storage))
        np.testing.assert_array_equal(storage, before)
        assert PageSet.of(storage) is None


def test_out_of_memory_in_a_state_publishes_nothing_and_the_step_can_be_retried():
    cfg = PagedConfig(key_format="int8", value_format="int8")
    sess = onnxkv.Session(build_paged_model(cfg), threads=1)
    page = 64 + H * BS * D  # an int8 page: header granule + codes
    arena = ArenaAllocator(int(np.prod(cfg.past_shape)) * 4 + 3 * page)  # the cache and 3 of the 4 payloads
    rng = np.random.default_rng(12)
    table = np.arange(cfg.max_blocks, dtype=np.int32)[None]
    with sess.new_state(allocator=arena) as state:
        state.run(
            {
                "hidden": rng.standard_normal((1, 8, cfg.hidden_size)).astype(np.float32),
                "block_table": table,
                "seqlens_k": np.zeros(1, np.int32),
            }
        )
        storage = state.values["past.0"]
        before, live = storage.copy(), arena.stats().live
        one = {name: np.full((2, H), 0.05, np.float32) for name in ("key_scale.0", "value_scale.0")}
        one.update({name: np.zeros((2, H), np.int8) for name in ("key_zero_point.0", "value_zero_point.0")})
        step = {
            "hidden": rng.standard_normal((1, 1, cfg.hidden_size)).astype(np.float32),
            "block_table": table,
            "seqlens_k": np.array([8], np.int32),
        }
        with pytest.raises(OutOfMemory, match=f"{page} bytes"):
            state.run({**step, "quantize_blocks": np.array([0, 1], np.int32), **one})
        np.testing.assert_array_equal(storage, before)
        assert not PageSet.of(storage).any_converted and arena.stats().live == live
        state.run(
            {**step, "quantize_blocks": np.array([1], np.int32), **{name: value[:1] for name, value in one.items()}}
        )
        assert PageSet.of(storage).formats[:, 1].tolist() == [3, 3] and arena.stats().live == live + 2 * page
        assert state.committed_bytes == storage.nbytes + 2 * page


# -- in a state: the paged decoder with QuantizePagedCache nodes ----------------------------------------------------


@pytest.mark.parametrize(
    "config, in_place",
    [
        ({"key_format": "int8", "value_format": "int4", "key_channel_scales": True}, True),
        ({"key_format": "int8", "value_format": "int8", "key_channel_zero_points": True}, True),
        ({"key_format": "uint4", "num_kv_heads": 1, "block_size": 1, "max_blocks": 14}, False),  # 32-byte page halves
    ],
    ids=["aligned-int8-int4", "aligned-channel-zp-int8", "small-pages-uint4"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_decoder_state_reads_mixed_pages_like_dense_attention(monkeypatch, config, in_place, threads):
    calls = []
    kernel = paged_ops._kernels.paged_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("k_formats"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(paged_ops._kernels, "paged_attention", spy)
    cfg = PagedConfig(num_layers=2, num_pages=30, **config)
    weights = paged_weights(cfg, seed=3)
    sess = onnxkv.Session(build_paged_model(cfg, weights), threads=threads)
    rng = np.random.default_rng(9)
    batch, bs, hkv = 2, cfg.block_size, cfg.num_kv_heads
    table = shuffled_table(rng, batch, cfg.max_blocks, cfg.num_pages).astype(np.int32)
    logical = [[np.zeros((0, 2, hkv, cfg.head_size)) for _ in range(batch)] for _ in range(cfg.num_layers)]
    seqlens = np.zeros(batch, np.int32)
    with sess.new_state() as state:
        hidden = rng.standard_normal((batch, 9, cfg.hidden_size)).astype(np.float32)
        state.run({"hidden": hidden, "block_table": table, "seqlens_k": seqlens})
        reference_decoder(weights, hidden, logical, seqlens, cfg)
        seqlens = seqlens + 9
        storage = [state.values[f"past.{i}"] for i in range(cfg.num_layers)]  # views of the page tensors
        assert all(PageSet.of(a) is None for a in storage)
        slots = [slot_addresses(a) for a in storage]
        full = table[:, : 9 // bs].reshape(-1)  # every full page of both rows
        feeds = {"quantize_blocks": full.astype(np.int32)}
        for i, pages in enumerate(storage):
            for plane, name, fmt in ((0, "key", cfg.key_format), (1, "value", cfg.value_format)):
                if fmt is not None:
                    channel = name == "key" and cfg.key_channel_scales
                    czp = name == "key" and cfg.key_channel_zero_points
                    feeds[f"{name}_scale.{i}"], feeds[f"{name}_zero_point.{i}"] = (
                        channel_zp_feed(pages[full, plane], fmt) if czp else params(pages[full, plane], fmt, channel)
                    )
        allocator_before = state.allocator.stats().live
        for step in range(3):  # the first decode step converts the pages, then its attention reads them
            hidden = rng.standard_normal((batch, 1, cfg.hidden_size)).astype(np.float32)
            quantize = feeds if step == 0 else {}
            out = state.run({"hidden": hidden, "block_table": table, "seqlens_k": seqlens, **quantize})
            if step == 0:
                for i, pages in enumerate(storage):  # the quantized K/V replace the logical float values
                    handle = PageSet.of(pages)
                    assert handle is not None and np.shares_memory(state.values[f"past.{i}"], pages)
                    assert handle.headers[0] == ("channel-zp" if cfg.key_channel_zero_points else "float32")
                    keep = np.setdiff1d(np.arange(cfg.num_pages), full)
                    np.testing.assert_array_equal(handle.ptrs[:, keep], slots[i][:, keep])
                    assert (handle.ptrs[0, full] != slots[i][0, full]).all()
                    for row in range(batch):
                        logical[i][row] = logical_kv(handle, table, row, int(seqlens[row]), bs).astype(np.float64)
                assert state.allocator.stats().live - allocator_before == sum(
                    PageSet.of(a).payload_bytes for a in storage
                )
            want = reference_decoder(weights, hidden, logical, seqlens, cfg)
            np.testing.assert_allclose(out["output"], want, rtol=1e-5, atol=1e-5)
            seqlens = seqlens + 1
    if in_place:
        assert calls and all(f is not None for f in calls[-2 * 3 :])  # per-page formats through the kernel
    else:
        assert not calls


def test_paged_config_key_channel_zero_points():
    with pytest.raises(ValueError, match="PagedConfig: key_channel_zero_points needs a key_format"):
        PagedConfig(key_channel_zero_points=True)
    with pytest.raises(ValueError, match="key_channel_scales and key_channel_zero_points are mutually exclusive"):
        PagedConfig(key_format="int8", key_channel_scales=True, key_channel_zero_points=True)
    cfg = PagedConfig(num_layers=2, key_format="int8", key_channel_zero_points=True)
    model = build_paged_model(cfg, paged_weights(cfg, seed=1))
    nodes = [n for n in model.graph.node if n.op_type == "QuantizePagedCache"]
    assert len(nodes) == 2 and all(
        [(a.name, a.i) for a in n.attribute] == [("key_channel_zero_points", 1)] for n in nodes
    )
    key_scale = next(i for i in model.graph.input if i.name == "key_scale.0")
    assert len(key_scale.type.tensor_type.shape.dim) == 3  # [N, kv_heads, head_size]
