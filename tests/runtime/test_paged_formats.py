"""Paged states with per-page formats: policies, quantize_pages, conversion back on writes."""
from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.alloc import ArenaAllocator
from onnxkv.cache import formats, serialize
from onnxkv.errors import InputError, OutOfMemory
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.models.builders import MICRO, build_model

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
    t = state._paged.table.tables
    return state.pool.formats[plane][t[t >= 0]].tolist()


@pytest.mark.parametrize("policy,tol", [("fp16", 2e-3), ("int8-head", 5e-2), ("int4", 0.6)])
def test_policies_convert_full_pages_and_stay_close(session, policy, tol):
    prompt = np.random.default_rng(0).integers(0, MICRO.vocab_size, (1, 18))
    with session.new_state(cache="paged", block_size=4) as ref:
        want, _, _ = _run(session, ref, prompt, 11)
        native_bytes = ref.committed_bytes
    with session.new_state(cache="paged", block_size=4, kv_format=policy) as st:
        got, _, _ = _run(session, st, prompt, 11)
        fmts = _formats(st)
        assert fmts[:-1] == [CODES[{"fp16": "float16", "int8-head": "int8"}.get(policy, policy)]] * (len(fmts) - 1)
        assert fmts[-1] == CODES["float32"]  # 29 tokens: the partly filled last page stays native
        assert st.committed_bytes < native_bytes
        assert any(e.action == "quantize" for e in session.events)
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)


@pytest.mark.parametrize("policy", ["int8", "int8-kivi"])
def test_int8_policy_gives_keys_channel_scales(session, policy):
    prompt = np.random.default_rng(4).integers(0, MICRO.vocab_size, (1, 18))
    with session.new_state(cache="paged", block_size=4) as ref:
        want, _, _ = _run(session, ref, prompt, 11)
    with session.new_state(cache="paged", block_size=4, kv_format=policy) as st:
        got, _, _ = _run(session, st, prompt, 11)
        keys = [i for i, p in enumerate(st.pool.planes) if p.groups > 1]
        values = [i for i, p in enumerate(st.pool.planes) if p.groups == 1]
        assert keys and len(keys) == len(values)  # every key plane per channel, every value plane per head
        assert all(st.pool.planes[i].groups == st.pool.planes[i].head_size for i in keys)
        assert _formats(st, keys[0])[:-1] == [2] * (len(_formats(st, keys[0])) - 1)  # UINT8 keys
        assert _formats(st, values[0])[:-1] == [CODES["int8"]] * (len(_formats(st, values[0])) - 1)
        # committed: compact key headers (S per head, two bytes per channel), float32 value headers
        pool, t = st.pool, st._paged.table.tables[0]
        full, last = t[:-1], t[-1]
        want_bytes = 0
        for i, spec in enumerate(pool.planes):
            fmt = "uint8" if spec.groups > 1 else "int8"
            page = formats.page_bytes(fmt, spec.heads, 4, spec.head_size, spec.groups, spec.header)
            assert (pool.sizes[i][full] == page).all()
            want_bytes += len(full) * page + pool.sizes[i][last]
        assert st.committed_bytes == want_bytes
        assert pool.planes[keys[0]].header == "compact"
    np.testing.assert_allclose(got, want, atol=5e-2, rtol=0)


def test_loading_parameters_a_compact_header_cannot_hold_changes_nothing(session):
    prompt = np.random.default_rng(8).integers(0, MICRO.vocab_size, (1, 13))
    with session.new_state(cache="paged", block_size=4, key_channel_scales=True) as st:
        _run(session, st, prompt, 0)
        st.quantize_pages([0, 1], "uint8", "int8")
        snap = serialize.decode(st.save_cache())
        key = snap.sequences[0].blocks[0].key
        assert key.format == "uint8" and key.scale.size == key.data.shape[0] * snap.layers[0].head_size
        key.scale = key.scale.copy()
        key.scale[1] = np.nextafter(key.scale[1], np.float32(1))   # valid, but not S * 2^(-e/16)
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
        session.new_state(cache="paged", kv_format=Selector())


def test_residual_policy_keeps_recent_tokens_native(session):
    from onnxkv.cache.policy import ResidualPolicy
    prompt = np.random.default_rng(1).integers(0, MICRO.vocab_size, (1, 30))
    with session.new_state(cache="paged", block_size=4, kv_format=ResidualPolicy("int8", "int8", 12)) as st:
        _run(session, st, prompt, 3)  # 33 tokens: blocks wholly before 21 are int8
        t = st._paged.table.tables[0]
        fmts = st.pool.formats[0][t].tolist()
        assert fmts[:5] == [CODES["int8"]] * 5 and set(fmts[5:]) == {CODES["float32"]}


def test_quantize_pages_replaces_only_the_selected_pages(session):
    prompt = np.random.default_rng(2).integers(0, MICRO.vocab_size, (1, 17))
    st = session.new_state(cache="paged", block_size=4)
    _, b, out = _run(session, st, prompt, 0)
    pool, t = st.pool, st._paged.table.tables[0].copy()
    before_ptrs = [pool.ptrs[i][t].copy() for i in range(len(pool.planes))]
    fork = st.fork()[0]  # shares every page: selected pages must be copied for `st`, not changed under the fork
    fork_values = {k: v.copy() for k, v in fork.values.items()}
    session.events.clear()
    st.quantize_pages([1, 3], "int8", "int4")
    t2 = st._paged.table.tables[0]
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
    st = session.new_state(cache="paged", block_size=4)
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
    st = s.new_state(cache="paged", block_size=4, allocator=ArenaAllocator(pool_bytes + 256))
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
    with session.new_state(cache="paged", block_size=4) as ref, session.new_state(cache="paged", block_size=4) as st:
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
        t = st._paged.table.tables[0]
        assert st.pool.formats[0][t[3]] == CODES["float32"]  # the written page is native again


def test_kv_format_needs_a_paged_state(session):
    with pytest.raises(InputError, match="cache='paged'"):
        session.new_state(kv_format="int8")
    with pytest.raises(InputError, match="kv_format must be one of"):
        session.new_state(cache="paged", kv_format="int9")


@pytest.mark.parametrize("channel", [False, True])
def test_mixed_format_cache_round_trips(session, channel):
    prompt = np.random.default_rng(6).integers(0, MICRO.vocab_size, (1, 21))
    st = session.new_state(cache="paged", block_size=4, key_channel_scales=channel)
    _, b, out = _run(session, st, prompt, 0)
    st.quantize_pages([0, 1], "int4", "uint8")
    st.quantize_pages([2], "float16", "int2")
    st.quantize_pages([3], "bfloat16", "int8")
    data = st.save_cache()
    feeds = b.next(np.array([4]), out)
    with session.new_state(cache="paged", block_size=4, key_channel_scales=channel) as back:
        back.load_cache(data)
        for i in range(len(st.pool.planes)):
            t, t2 = st._paged.table.tables[0], back._paged.table.tables[0]
            assert st.pool.formats[i][t].tolist() == back.pool.formats[i][t2].tolist()
        for k, v in st.values.items():
            np.testing.assert_array_equal(back.values[k], v)
        np.testing.assert_array_equal(back.run(feeds, ["logits"])["logits"], st.run(feeds, ["logits"])["logits"])
    if not channel:
        with session.new_state(cache="paged", block_size=4, key_channel_scales=True) as other:
            with pytest.raises(InputError, match="scale"):
                other.load_cache(data)
    st.close()
