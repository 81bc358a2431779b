"""Paged states with per-page formats: policies, quantize_pages, conversion back on writes."""

from __future__ import annotations

import numpy as np
import pytest
from deprecations import warns_deprecated

import onnxkv
from onnxkv import CacheConfig
from onnxkv.alloc import ArenaAllocator
from onnxkv.cache import formats, serialize
from onnxkv.cache.policy import POLICIES
from onnxkv.errors import InputError, OutOfMemory
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import MICRO, build_model

FAMILIES = ["gqa", "attention", "concat"]
CODES = {"float32": 1, "float16": 10, "int8": 3, "int4": 22}


@pytest.fixture(scope="module", params=FAMILIES)
def session(request):
    return onnxkv.Session(build_model(request.param, MICRO, seed=21), threads=1, events=True)


def _run(session, state, prompt, steps):
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([prompt.shape[1]]), 0, thread_cache=False)
    feeds, _ = b.first()
    out = state.run(feeds, ["logits"])
    got = [out["logits"][0, -1].copy()]
    for i in range(steps):
        out = state.run(b.next(np.array([(7 * i + 3) % MICRO.vocab_size]), out), ["logits"])
        got.append(out["logits"][0, -1].copy())
    return np.array(got), b, out


def _formats(state, plane=0):
    t = state.page_tables
    return state.pool.formats[plane][t[t >= 0]].tolist()


@pytest.mark.parametrize("policy,tol", [("fp16", 2e-3), ("int8-head", 5e-2), ("int4", 0.6)])
def test_policies_convert_full_pages_and_stay_close(session, policy, tol):
    prompt = np.random.default_rng(0).integers(0, MICRO.vocab_size, (1, 18))
    with session.new_state(cache=CacheConfig("paged", block_size=4)) as ref:
        want, _, _ = _run(session, ref, prompt, 11)
        native_bytes = ref.committed_bytes
    with session.new_state(cache=CacheConfig("paged", block_size=4, kv_format=POLICIES[policy])) as st:
        got, _, _ = _run(session, st, prompt, 11)
        fmts = _formats(st)
        assert fmts[:-1] == [CODES[{"fp16": "float16", "int8-head": "int8"}.get(policy, policy)]] * (len(fmts) - 1)
        assert fmts[-1] == CODES["float32"]  # 29 tokens: the partly filled last page stays native
        assert st.committed_bytes < native_bytes
        assert any(e.action == "quantize" for e in session.events)
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)


@pytest.mark.parametrize("policy, key_fmt, header", [("int8", "int8", "channel-zp"), ("int8-kivi", "uint8", "compact")])
def test_int8_policies_give_keys_per_channel_layouts(session, policy, key_fmt, header):
    prompt = np.random.default_rng(4).integers(0, MICRO.vocab_size, (1, 18))
    with session.new_state(cache=CacheConfig("paged", block_size=4)) as ref:
        want, _, _ = _run(session, ref, prompt, 11)
    with session.new_state(cache=CacheConfig("paged", block_size=4, kv_format=POLICIES[policy])) as st:
        got, _, _ = _run(session, st, prompt, 11)
        keys = [i for i, p in enumerate(st.pool.planes) if p.groups > 1]
        values = [i for i, p in enumerate(st.pool.planes) if p.groups == 1]
        assert keys and len(keys) == len(values)  # every key plane per channel, every value plane per head
        assert all(st.pool.planes[i].groups == st.pool.planes[i].head_size for i in keys)
        key_code = formats.page_format(key_fmt).code
        assert _formats(st, keys[0])[:-1] == [key_code] * (len(_formats(st, keys[0])) - 1)
        assert _formats(st, values[0])[:-1] == [CODES["int8"]] * (len(_formats(st, values[0])) - 1)
        # committed: per-channel key headers (compact or channel-zp), float32 value headers
        pool, t = st.pool, st.page_tables[0]
        full, last = t[:-1], t[-1]
        want_bytes = 0
        for i, spec in enumerate(pool.planes):
            fmt = key_fmt if spec.groups > 1 else "int8"
            page = formats.page_bytes(fmt, spec.heads, 4, spec.head_size, spec.groups, spec.header)
            assert (pool.sizes[i][full] == page).all()
            want_bytes += len(full) * page + pool.sizes[i][last]
        assert st.committed_bytes == want_bytes
        assert {pool.planes[i].header for i in keys} == {header}
        assert {pool.planes[i].header for i in values} == {"float32"}
    np.testing.assert_allclose(got, want, atol=5e-2, rtol=0)


def test_loading_parameters_a_compact_header_cannot_hold_changes_nothing(session):
    prompt = np.random.default_rng(8).integers(0, MICRO.vocab_size, (1, 13))
    # key_channel_scales without a kv_format (pages quantized by hand) has no CacheConfig spelling
    with warns_deprecated(__file__, "key_channel_scales= are deprecated"):
        st = session.new_state(cache="paged", block_size=4, key_channel_scales=True)
    with st:
        _run(session, st, prompt, 0)
        st.quantize_pages([0, 1], "uint8", "int8")
        snap = serialize.decode(st.save_cache())
        key = snap.sequences[0].blocks[0].key
        assert key.format == "uint8" and key.scale.size == key.data.shape[0] * snap.layers[0].head_size
        key.scale = key.scale.copy()
        key.scale[1] = np.nextafter(key.scale[1], np.float32(1))  # valid, but not S * 2^(-e/16)
        bad = serialize.encode(snap)
        before = {k: v.copy() for k, v in st.values.items()}
        committed = st.committed_bytes
        with pytest.raises(InputError, match="cannot hold it"):
            st.load_cache(bad)
        assert st.committed_bytes == committed
        for k, v in st.values.items():
            np.testing.assert_array_equal(v, before[k])


def test_selector_key_channel_scales_must_be_a_bool(session):
    class Selector:
        key_channel_scales = "yes"

        def __call__(self, layer, past_length, k, v):
            return "int8", "int8"

    with pytest.raises(InputError, match="key_channel_scales must be a bool, got 'yes'"):
        session.new_state(cache=CacheConfig("paged", kv_format=Selector()))


def test_residual_policy_keeps_recent_tokens_native(session):
    from onnxkv.cache.policy import ResidualPolicy

    prompt = np.random.default_rng(1).integers(0, MICRO.vocab_size, (1, 30))
    config = CacheConfig("paged", block_size=4, kv_format=ResidualPolicy("int8", "int8", 12))
    with session.new_state(cache=config) as st:
        _run(session, st, prompt, 3)  # 33 tokens: blocks wholly before 21 are int8
        t = st.page_tables[0]
        fmts = st.pool.formats[0][t].tolist()
        assert fmts[:5] == [CODES["int8"]] * 5 and set(fmts[5:]) == {CODES["float32"]}


@pytest.mark.parametrize("keep", [0, 3])
def test_keep_for_truncate_defers_conversions_to_the_next_run(session, keep):
    """Three tokens fed as one run fill block 4 (16..19); taking two back and feeding them one by one must
    give what one-by-one runs give, which read block 4 native until it is full.  Converted at once (keep 0),
    the truncate lands in an int8 page."""
    prompt = np.random.default_rng(11).integers(0, MICRO.vocab_size, (1, 18))
    tokens = np.array([5, 9, 2])
    config = CacheConfig("paged", block_size=4, kv_format="int8")
    with session.new_state(cache=config) as ref:
        b_ref = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([18]), 0, thread_cache=False)
        ref.run(b_ref.first()[0], [])
        want = [ref.run(b_ref.next(tokens[None, i : i + 1], None), ["logits"])["logits"][0, -1] for i in range(3)]
        want_bytes = ref.committed_bytes
    with session.new_state(cache=config) as st:
        st.keep_for_truncate(keep)
        assert st.conversion_cycle == (4, 0)
        b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([18]), 0, thread_cache=False)
        st.run(b.first()[0], [])
        st.run(b.next(tokens[None, :], None), [])
        t = st.page_tables[0]
        fmts = st.pool.formats[0][t[t >= 0]].tolist()
        # the prompt's blocks 0..3 were converted before the 3-token run; block 4 waits for the next run
        assert fmts[:4] == [CODES["int8"]] * 4
        assert fmts[4] == (CODES["float32"] if keep else CODES["int8"])
        st.truncate(19)
        b.rewind(19)
        got = [st.run(b.next(tokens[None, i : i + 1], None), ["logits"])["logits"][0, -1] for i in (1, 2)]
        if keep:
            np.testing.assert_array_equal(got, want[1:])
            assert st.committed_bytes == want_bytes
        else:
            assert not np.array_equal(got[0], want[1])


@pytest.mark.parametrize("residual", [0, 5])
@pytest.mark.parametrize("loader", ["same", "no kv_format"])
def test_a_saved_cache_carries_the_conversions_its_state_owes(session, residual, loader):
    """A state that keeps positions for a truncate owes its next run the conversion of the page its last
    run filled: the file carries it (with the selector's residual_tokens), so the state that loads it
    converts the same pages at its next run and continues bit for bit as the saving state does."""
    from onnxkv.cache.policy import ResidualPolicy

    prompt = np.random.default_rng(12).integers(0, MICRO.vocab_size, (1, 18))
    config = CacheConfig("paged", block_size=4, kv_format=ResidualPolicy("int8", "int4", residual))
    with session.new_state(cache=config) as st:
        st.keep_for_truncate(3)
        b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([18]), 0, thread_cache=False)
        st.run(b.first()[0], [])
        st.run(b.next(np.array([[5, 9, 2]]), None), [])  # fills block 4 (16..19): owed, not yet converted
        data = st.save_cache()
        snap = serialize.decode(data)
        owed = {(o.layer, o.role, o.format) for o in snap.owed}
        assert owed == {
            (layer, role, fmt)
            for layer in range(MICRO.num_layers)
            for role, fmt in (("key", "int8"), ("value", "int4"))
        }
        assert snap.owed_residual_tokens == residual
        steps = [b.next(np.array([[t]]), None) for t in (4, 7)]
        want = [st.run(f, ["logits"])["logits"].copy() for f in steps]
        want_formats = [st.pool.formats[i][st.page_tables[0][st.page_tables[0] >= 0]].tolist() for i in range(4)]
        want_bytes = st.committed_bytes
    back_config = config if loader == "same" else CacheConfig("paged", block_size=4)
    with session.new_state(cache=back_config) as back:
        back.load_cache(data)
        assert serialize.decode(back.save_cache()).owed == snap.owed  # owed still, until the next run
        got = [back.run(f, ["logits"])["logits"] for f in steps]
        t = back.page_tables[0]
        assert [back.pool.formats[i][t[t >= 0]].tolist() for i in range(4)] == want_formats
        assert back.committed_bytes == want_bytes
        assert serialize.decode(back.save_cache()).owed == []  # made by that run
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_state_that_owes_nothing_saves_no_owed_conversions(session):
    prompt = np.random.default_rng(13).integers(0, MICRO.vocab_size, (1, 18))
    with session.new_state(cache=CacheConfig("paged", block_size=4, kv_format="int8")) as st:
        _run(session, st, prompt, 3)
        snap = serialize.decode(st.save_cache())
        assert snap.owed == [] and snap.owed_residual_tokens == 0


def test_an_owed_conversion_the_pages_cannot_take_is_refused_before_the_load():
    import dataclasses

    six = dataclasses.replace(MICRO, head_size=6)  # int2 codes of 6 channels do not fill whole bytes
    session = onnxkv.Session(build_model("gqa", six, seed=3), threads=1)
    with session.new_state(cache=CacheConfig("paged", block_size=4, kv_format="int8")) as st:
        _run(session, st, np.arange(1, 11)[None], 0)
        snap = serialize.decode(st.save_cache())
        snap.owed = [serialize.OwedConversion(0, "key", "int2")]
        before, committed = {k: v.copy() for k, v in st.values.items()}, st.committed_bytes
        with pytest.raises(InputError, match=r"load_cache: owed conversion 0 \(past_key_values.0.key to int2\)"):
            st.load_cache(serialize.encode(snap))
        assert st.committed_bytes == committed and serialize.decode(st.save_cache()).owed == []
        for k, v in st.values.items():
            np.testing.assert_array_equal(v, before[k])


def test_conversion_cycle_names_block_size_and_residual_tokens(session):
    from onnxkv.cache.policy import ResidualPolicy

    assert session.new_state().conversion_cycle is None
    assert session.new_state(cache=CacheConfig("paged", block_size=8)).conversion_cycle is None
    residual = CacheConfig("paged", block_size=8, kv_format=ResidualPolicy("int8", "int8", 12))
    assert session.new_state(cache=residual).conversion_cycle == (8, 12)


def test_quantize_pages_replaces_only_the_selected_pages(session):
    prompt = np.random.default_rng(2).integers(0, MICRO.vocab_size, (1, 17))
    st = session.new_state(cache=CacheConfig("paged", block_size=4))
    _, b, out = _run(session, st, prompt, 0)
    pool, t = st.pool, st.page_tables[0]
    before_ptrs = [pool.ptrs[i][t].copy() for i in range(len(pool.planes))]
    fork = st.fork()[0]  # shares every page: selected pages must be copied for `st`, not changed under the fork
    fork_values = {k: v.copy() for k, v in fork.values.items()}
    session.events.clear()
    st.quantize_pages([1, 3], "int8", "int4")
    t2 = st.page_tables[0]
    assert (t2[[0, 2, 4]] == t[[0, 2, 4]]).all()  # unselected pages: same ids ...
    for i in range(len(pool.planes)):
        assert (pool.ptrs[i][t2[[0, 2, 4]]] == before_ptrs[i][[0, 2, 4]]).all()  # ... and same storage
    assert pool.formats[0][t2[1]] == CODES["int8"] and pool.formats[1][t2[1]] == CODES["int4"]
    assert (t2[[1, 3]] != t[[1, 3]]).all()  # shared: copied for this state
    for k, v in fork.values.items():
        np.testing.assert_array_equal(v, fork_values[k])
    (ev,) = [e for e in session.events if e.action == "quantize"]
    assert ev.extra["pages_converted"] == 2
    fork.close()
    st.close()


def test_quantize_pages_is_all_or_nothing(session):
    prompt = np.random.default_rng(3).integers(0, MICRO.vocab_size, (1, 12))
    st = session.new_state(cache=CacheConfig("paged", block_size=4))
    _run(session, st, prompt, 0)
    before = {k: v.copy() for k, v in st.values.items()}
    fmts = [f.copy() for f in st.pool.formats]
    with pytest.raises(InputError, match="full blocks"):
        st.quantize_pages([0, 3], "int8", "int8")
    with pytest.raises(InputError, match="int3"):
        st.quantize_pages([0], "int3", None)
    with pytest.raises(InputError, match="distinct"):
        st.quantize_pages([0, 0], "int8", None)
    for a, b in zip(fmts, st.pool.formats):
        np.testing.assert_array_equal(a, b)
    for k, v in st.values.items():
        np.testing.assert_array_equal(v, before[k])
    st.close()


def test_quantize_pages_out_of_memory_changes_nothing():
    s = onnxkv.Session(build_model("concat", MICRO, seed=4), threads=1)
    pool_bytes = 2 * MICRO.num_layers * 3 * MICRO.num_kv_heads * 4 * MICRO.head_size * 4
    st = s.new_state(allocator=ArenaAllocator(pool_bytes + 256), cache=CacheConfig("paged", block_size=4))
    prompt = np.random.default_rng(4).integers(0, MICRO.vocab_size, (1, 12))
    _run(s, st, prompt, 0)
    before = {k: v.copy() for k, v in st.values.items()}
    with pytest.raises(OutOfMemory):
        st.quantize_pages([0, 1, 2], "int8", "int8")
    assert set(np.concatenate(st.pool.formats).tolist()) == {CODES["float32"]}
    for k, v in st.values.items():
        np.testing.assert_array_equal(v, before[k])
    st.close()


def test_writing_into_a_converted_page_makes_a_native_copy(session):
    prompt = np.random.default_rng(5).integers(0, MICRO.vocab_size, (1, 16))
    paged = CacheConfig("paged", block_size=4)
    with session.new_state(cache=paged) as ref, session.new_state(cache=paged) as st:
        want, b_ref, out_ref = _run(session, ref, prompt, 0)
        _, b, out = _run(session, st, prompt, 0)
        st.quantize_pages([0, 1, 2, 3], "float16", "float16")
        st.truncate(14)
        ref.truncate(14)
        for builder in (b, b_ref):
            builder.rewind(14)
        f = b.next(np.array([9]), out)
        got = st.run(f, ["logits"])["logits"]
        exp = ref.run(b_ref.next(np.array([9]), out_ref), ["logits"])["logits"]
        np.testing.assert_allclose(got, exp, atol=2e-3)
        t = st.page_tables[0]
        assert st.pool.formats[0][t[3]] == CODES["float32"]  # the written page is native again


def test_kv_format_needs_a_paged_state(session):
    # State's own checks, reached through the deprecated keywords
    with warns_deprecated(__file__, "kv_format= is deprecated"), pytest.raises(InputError, match="cache='paged'"):
        session.new_state(kv_format="int8")
    with (
        warns_deprecated(__file__, "kv_format= is deprecated"),
        pytest.raises(InputError, match="kv_format must be one of"),
    ):
        session.new_state(cache="paged", kv_format="int9")
    # the same mistakes through CacheConfig
    with pytest.raises(InputError, match="kv_format='int8' .page formats. needs kind='paged'"):
        CacheConfig(kv_format="int8")
    with pytest.raises(InputError, match="kv_format must be None, one of .* got 'int9'"):
        CacheConfig("paged", kv_format="int9")


KEY_LAYOUTS = {"float32": {}, "compact": {"key_channel_scales": True}, "channel-zp": {"key_channel_zero_points": True}}


def _layout_state(session, options):
    """A paged state (no kv_format) whose key pages get the header ``options`` ask for.

    A key layout without a page format has no CacheConfig spelling, so the
    non-default layouts use the deprecated keywords."""
    if not options:
        return session.new_state(cache=CacheConfig("paged", block_size=4))
    with warns_deprecated(__file__, r"block_size=, key_channel_(scales|zero_points)= are deprecated"):
        return session.new_state(cache="paged", block_size=4, **options)


@pytest.mark.parametrize("header", list(KEY_LAYOUTS))
def test_mixed_format_cache_round_trips(session, header):
    prompt = np.random.default_rng(6).integers(0, MICRO.vocab_size, (1, 21))
    options = KEY_LAYOUTS[header]
    st = _layout_state(session, options)
    assert {p.header for p in st.pool.planes if p.name in dict(st._layer_pairs())} == {header}
    _, b, out = _run(session, st, prompt, 0)
    st.quantize_pages([0, 1], "int4", "uint8")
    st.quantize_pages([2], "float16", "int2")
    st.quantize_pages([3], "bfloat16", "int8")
    data = st.save_cache()
    feeds = b.next(np.array([4]), out)
    with _layout_state(session, options) as back:
        back.load_cache(data)
        for i in range(len(st.pool.planes)):
            t, t2 = st.page_tables[0], back.page_tables[0]
            assert st.pool.formats[i][t].tolist() == back.pool.formats[i][t2].tolist()
        for k, v in st.values.items():
            np.testing.assert_array_equal(back.values[k], v)
        np.testing.assert_array_equal(back.run(feeds, ["logits"])["logits"], st.run(feeds, ["logits"])["logits"])
    if header == "float32":
        for other_header, other_options in KEY_LAYOUTS.items():
            if other_options:
                with _layout_state(session, other_options) as other:
                    with pytest.raises(
                        InputError,
                        match=f"1 scale.s. per head, the state's plane has "
                        f"{MICRO.head_size} group.s. per head with "
                        f"'{other_header}' headers",
                    ):
                        other.load_cache(data)
    st.close()


def test_key_channel_zero_points_state_quantizes_keys_per_head_scale_per_channel_offset(session):
    """new_state(key_channel_zero_points=True): key planes get groups = head_size and channel-zp
    headers; quantize_pages chooses the parameters from each page (channel_zp_params) and every key
    reads back within half its head's scale, values within half their per-head scale."""
    prompt = np.random.default_rng(12).integers(0, MICRO.vocab_size, (1, 13))
    with _layout_state(session, {"key_channel_zero_points": True}) as st:
        _run(session, st, prompt, 0)
        pool, bs = st.pool, 4
        keys = {pool.plane_index[k] for k, _ in st._layer_pairs()}
        for i, spec in enumerate(pool.planes):
            want = ("channel-zp", spec.head_size) if i in keys else ("float32", 1)
            assert (spec.header, spec.groups) == want
        t = st.page_tables[0]
        floats = {i: [pool.read_page(i, int(p), bs) for p in t[:3]] for i in range(len(pool.planes))}
        before_ptrs = [pool.ptrs[i][t[[1, 3]]].copy() for i in range(len(pool.planes))]
        st.quantize_pages([0, 2], "int8", "int8")
        t2 = st.page_tables[0]
        assert (t2 == t).all()  # held by this state alone: converted in place
        for i, spec in enumerate(pool.planes):
            assert (pool.ptrs[i][t2[[1, 3]]] == before_ptrs[i]).all()  # unselected pages: same storage
            for blk in (0, 2):
                p = int(t2[blk])
                assert pool.formats[i][p] == CODES["int8"]
                x = floats[i][blk]
                scale, zp = formats.decode_header(pool.pages[i][p], "int8", spec.heads, spec.groups, spec.header)
                if i in keys:
                    ref_s, ref_z, header = formats.channel_zp_params(x, "int8")
                    np.testing.assert_array_equal(pool.pages[i][p][: header.size], header)
                    np.testing.assert_array_equal(scale, ref_s)
                    np.testing.assert_array_equal(zp, ref_z)
                    assert pool.sizes[i][p] == formats.page_bytes(
                        "int8", spec.heads, bs, spec.head_size, spec.head_size, "channel-zp"
                    )
                err = np.abs(pool.read_page(i, p, bs) - x)
                bound = np.broadcast_to(scale.reshape(spec.heads, 1, -1), x.shape) * np.float32(0.5) * (1 + 1e-5)
                assert (err <= bound).all(), (i, blk, float(err.max()))
                assert err.max() > 0  # really quantized


def test_key_channel_options_are_mutually_exclusive(session):
    with pytest.raises(
        InputError, match="new_state: key_channel_scales and key_channel_zero_points are mutually exclusive"
    ):
        with warns_deprecated(__file__, "key_channel_scales=, key_channel_zero_points= are deprecated"):
            session.new_state(cache="paged", key_channel_scales=True, key_channel_zero_points=True)
    with pytest.raises(
        InputError, match="new_state: key_channel_scales and key_channel_zero_points are mutually exclusive"
    ):
        with warns_deprecated(__file__, "kv_format=, key_channel_scales= are deprecated"):
            session.new_state(cache="paged", kv_format="int8", key_channel_scales=True)  # "int8": channel zero points
    with pytest.raises(InputError, match="new_state: key_channel_zero_points must be a bool, got 1"):
        with warns_deprecated(__file__, "key_channel_zero_points= is deprecated"):
            session.new_state(cache="paged", key_channel_zero_points=1)


def _state_bytes(st):
    return (
        {k: v.tobytes() for k, v in st.values.items()},
        st.page_tables.tobytes(),
        st.lengths.tolist(),
        st.steps,
        [f.tolist() for f in st.pool.formats],
        st.pool.live_pages,
    )


@pytest.mark.parametrize("result", ["raise", ("int3", None), (4, None), ["int8"]])
def test_a_failing_selector_fails_the_run_and_changes_nothing(session, result):
    prompt = np.random.default_rng(6).integers(0, MICRO.vocab_size, (1, 6))

    def selector(layer, past_length, k, v):
        if past_length < 6:
            return None, None
        if result == "raise":
            raise RuntimeError("selector broke")
        return result

    st = session.new_state(cache=CacheConfig("paged", block_size=4, kv_format=selector))
    _, b, out = _run(session, st, prompt, 0)
    before = _state_bytes(st)
    with pytest.raises((RuntimeError, InputError, ValueError, TypeError), match="selector|int3|format"):
        st.run(b.next(np.array([5]), out), ["logits"])
    assert _state_bytes(st) == before
    st.pool.audit()
    st.close()


class _Refusing(ArenaAllocator):
    """An arena that refuses every allocation once ``refuse`` is set."""

    refuse = False

    def allocate(self, nbytes, alignment=64):
        if self.refuse:
            raise OutOfMemory(f"test allocator: refusing {nbytes} bytes")
        return super().allocate(nbytes, alignment)


def test_a_conversion_the_allocator_refuses_fails_the_run_and_changes_nothing():
    s = onnxkv.Session(build_model("concat", MICRO, seed=4), threads=1)
    alloc = _Refusing(1 << 20)
    refusals = []

    def selector(layer, past_length, k, v):
        # the first run filling block 1 has its page; then the conversion's payloads are refused
        alloc.refuse = past_length == 7 and len(refusals) < 1
        return "int8", "int8"

    config = CacheConfig("paged", block_size=4, kv_format=selector)
    prompt = np.random.default_rng(4).integers(0, MICRO.vocab_size, (1, 7))
    with s.new_state(cache=config) as ref:
        want, _, _ = _run(s, ref, prompt, 3)
    st = s.new_state(cache=config, allocator=alloc)
    _, b, out = _run(s, st, prompt, 0)
    before = _state_bytes(st)
    with pytest.raises(OutOfMemory, match=r"State.run: converting full pages to the kv_format \(int8\).*refusing"):
        st.run(b.next(np.array([3]), out), ["logits"])
    refusals.append(alloc.refuse)
    alloc.refuse = False
    assert _state_bytes(st) == before
    st.pool.audit()
    b.rewind(st.length)
    got = [out["logits"][0, -1].copy()]
    for i in range(3):  # made again with the payloads granted: what the runs give untroubled
        out = st.run(b.next(np.array([(7 * i + 3) % MICRO.vocab_size]), out), ["logits"])
        got.append(out["logits"][0, -1].copy())
    np.testing.assert_array_equal(got, want)
    st.pool.audit()
    st.close()


def _steps(state, b, out, tokens):
    got = []
    for t in tokens:
        out = state.run(b.next(np.array([t]), out), ["logits"])
        got.append(out["logits"][0, -1].copy())
    return got, out


@pytest.mark.parametrize("keep", [0, 2])
def test_a_shared_page_with_no_page_to_copy_into_fails_the_run_and_changes_nothing(session, keep):
    """Converting pages a fork also holds copies them first.  In a full pool the run (keeping positions
    for a truncate: the next run, which owes the conversion) raises OutOfMemory and changes nothing;
    once the fork is gone the pages convert in place and the tokens are those of a state never forked."""
    prompt = np.random.default_rng(8).integers(0, MICRO.vocab_size, (1, 8))
    tokens = [5, 9, 2]

    def selector(layer, past_length, k, v):  # the prompt's pages stay native; every later run converts
        return ("int8", "int8") if past_length >= 8 else (None, None)

    config = CacheConfig("paged", block_size=4, kv_format=selector, max_pages=4)
    with session.new_state(cache=config) as ref:
        ref.keep_for_truncate(keep)
        _, b, out = _run(session, ref, prompt, 0)
        want, _ = _steps(ref, b, out, tokens)
    st = session.new_state(cache=config)
    st.keep_for_truncate(keep)
    _, b, out = _run(session, st, prompt, 0)  # two full native pages
    fork = st.fork()[0]
    done = 1 if keep else 0  # kept positions: the first step's conversion waits for the next run
    got, out = _steps(st, b, out, tokens[:done])
    before = _state_bytes(st)
    with pytest.raises(OutOfMemory, match=r"State.run: converting full pages to the kv_format \(int8\).*max_pages=4"):
        st.run(b.next(np.array([tokens[done]]), out), ["logits"])  # 3 pages live: none for 2 copies
    assert _state_bytes(st) == before
    st.pool.audit()
    b.rewind(st.length)
    fork.close()
    rest, _ = _steps(st, b, out, tokens[done:])
    np.testing.assert_array_equal(got + rest, want)
    assert st.pool.live_pages == 3
    st.pool.audit()
    st.close()


def test_forks_and_restores_owe_the_conversions_the_state_owed(session):
    """Keeping positions for a truncate, a run's conversions wait for the next run.  A fork made in
    between owes them too, and so does a restore of a checkpoint made then: each next run converts the
    pages first, as the state itself does (here the selector chooses nothing after the prompt)."""

    def selector(layer, past_length, k, v):
        return ("int8", "int8") if past_length == 0 else (None, None)

    config = CacheConfig("paged", block_size=4, kv_format=selector)
    prompt = np.random.default_rng(12).integers(0, MICRO.vocab_size, (1, 7))
    with session.new_state(cache=config) as st:
        st.keep_for_truncate(2)
        _, b, out = _run(session, st, prompt, 0)
        assert _formats(st) == [CODES["float32"]] * 2  # block 0 waits for the next run
        fork = st.fork()[0]
        mark = st.checkpoint()
        feed = b.next(np.array([5]), out)
        want = st.run(feed, ["logits"])["logits"]
        assert _formats(st)[0] == CODES["int8"]
        np.testing.assert_array_equal(fork.run(feed, ["logits"])["logits"], want)
        assert _formats(fork)[0] == CODES["int8"]
        st.restore(mark)
        np.testing.assert_array_equal(st.run(feed, ["logits"])["logits"], want)
        assert _formats(st)[0] == CODES["int8"]
        mark.release()
        fork.close()
        st.pool.audit()


def test_a_failed_run_takes_back_the_conversions_owed_to_it(session):
    """Keeping positions for a truncate, the conversions a run owes are published before the next run's
    queries read the pages; when that run fails (here: no pages for its own tokens) they are undone with
    it, so the truncate keep_for_truncate promised still lands in native pages."""
    prompt = np.random.default_rng(13).integers(0, MICRO.vocab_size, (1, 3))

    def started(max_pages):
        st = session.new_state(cache=CacheConfig("paged", block_size=4, kv_format="int8", max_pages=max_pages))
        st.keep_for_truncate(2)
        _, b, out = _run(session, st, prompt, 0)
        st.run(b.next(np.array([8]), out), [])  # fills page 0: its conversion is owed to the next run
        return st, b

    (st, b), (ref, b_ref) = started(2), started(None)
    before = _state_bytes(st)
    with pytest.raises(OutOfMemory, match="max_pages=2"):
        st.run(b.next(np.array([[1, 2, 3, 4, 5]]), None), ["logits"])  # needs 2 new pages, 1 free
    assert _state_bytes(st) == before and _formats(st) == [CODES["float32"]]
    st.pool.audit()
    for s, fb in ((st, b), (ref, b_ref)):
        s.truncate(2)
        fb.rewind(2)
    got = st.run(b.next(np.array([9]), None), ["logits"])["logits"]
    np.testing.assert_array_equal(got, ref.run(b_ref.next(np.array([9]), None), ["logits"])["logits"])
    st.close()
    ref.close()


def test_a_copy_made_to_convert_a_shared_page_keeps_its_other_planes_formats(session):
    """A conversion copies a page a fork shares; the copy's planes the conversion does not choose keep
    their formats byte for byte (not dequantized), so the state stays as one never forked."""

    def selector(layer, past_length, k, v):
        if past_length < 8:
            return "float16", None  # the prompt's keys
        return (None, "int8") if past_length < 12 else ("int8", None)  # then values; float16 keys stay

    config = CacheConfig("paged", block_size=4, kv_format=selector)
    prompt = np.random.default_rng(14).integers(0, MICRO.vocab_size, (1, 8))
    with session.new_state(cache=config) as st, session.new_state(cache=config) as ref:
        _, b, out = _run(session, st, prompt, 0)
        _, b_ref, out_ref = _run(session, ref, prompt, 0)
        fork = st.fork()[0]
        for tok in (3, 4, 1, 2, 7):  # the first converts the shared pages' values: copies for st
            out = st.run(b.next(np.array([tok]), out), ["logits"])
            out_ref = ref.run(b_ref.next(np.array([tok]), out_ref), ["logits"])
            np.testing.assert_array_equal(out["logits"], out_ref["logits"])
        for plane in range(len(st.pool.planes)):
            assert _formats(st, plane) == _formats(ref, plane)
        assert _formats(st, 0)[:2] == [CODES["float16"]] * 2 and st.committed_bytes == ref.committed_bytes
        fork.close()
        st.pool.audit()
