"""Session: statelessness, thread setting, events, show_config, token id checks, new_state's cache argument."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
from deprecations import warns_deprecated
from onnx import TensorProto, helper, numpy_helper
from state_steps import step_feeds

import onnxkv
from onnxkv import CacheConfig, InputError, KeyLayout, _kernels
from onnxkv._deprecation import OnnxkvDeprecationWarning
from onnxkv.zoo.builders import MICRO, build_model


def _feeds(batch=1, length=4):
    f = {
        "input_ids": np.arange(1, length + 1)[None].repeat(batch, 0).astype(np.int64),
        "attention_mask": np.ones((batch, length), np.int64),
        "position_ids": np.arange(length)[None].repeat(batch, 0).astype(np.int64),
    }
    for i in range(MICRO.num_layers):
        for kv in ("key", "value"):
            f[f"past_key_values.{i}.{kv}"] = np.zeros((batch, MICRO.num_kv_heads, 0, MICRO.head_size), np.float32)
    return f


def test_run_is_stateless_and_thread_count_does_not_change_results():
    m = build_model("concat", MICRO)
    one = onnxkv.Session(m, threads=1).run(_feeds(2))
    s2 = onnxkv.Session(m, threads=2)
    two_a, two_b = s2.run(_feeds(2)), s2.run(_feeds(2))
    for k in one:
        np.testing.assert_allclose(one[k], two_a[k], atol=1e-5)
        np.testing.assert_array_equal(two_a[k], two_b[k])


def test_threads_apply_during_run_and_are_restored():
    from threadpoolctl import threadpool_info

    before = _kernels.get_num_threads()
    seen = {}

    class Spy(onnxkv.SystemAllocator):
        def allocate(self, nbytes, alignment=64):
            seen["omp"] = _kernels.get_num_threads()
            seen["blas"] = [i["num_threads"] for i in threadpool_info()]
            return super().allocate(nbytes, alignment)

    sess = onnxkv.Session(build_model("concat", MICRO), threads=1, allocator=Spy())
    sess.run(_feeds())
    assert seen["omp"] == 1 and all(n == 1 for n in seen["blas"])
    assert _kernels.get_num_threads() == before
    with pytest.raises(InputError, match="threads"):
        onnxkv.Session(build_model("concat", MICRO), threads=0)


def test_event_log_counts_tensor_path_cache_copies_and_exports_json(tmp_path):
    sess = onnxkv.Session(build_model("concat", MICRO), threads=1, events=True)
    res = onnxkv.generate(sess, np.array([[1, 2, 3, 4]]), 3, eos_token_id=[], cache="tensor")
    assert res.tokens.shape == (1, 3)
    log = sess.events
    assert log.steps() == [0, 1, 2]
    assert sum(1 for e in log if e.step == 0) == len(sess.plan.nodes)
    kv_row = MICRO.num_kv_heads * MICRO.head_size * 4  # one token of K (or V) in bytes, batch 1
    layers = MICRO.num_layers
    t0, t2 = log.totals(0), log.totals(2)
    assert t0["prefix_copied_bytes"] == 0 and t0["append_copied_bytes"] == 2 * layers * 4 * kv_row
    # Step 2 feeds a past of 5 tokens: the tensor path copies it all again (the cost an in-place state avoids).
    assert t2["prefix_copied_bytes"] == 2 * layers * 5 * kv_row and t2["append_copied_bytes"] == 2 * layers * kv_row
    assert t2["allocations"] > 0 and t2["allocated_bytes"] > 0
    data = json.loads(log.to_json(str(tmp_path / "ev.json")))
    assert (
        len(data["events"]) == len(log) and data["totals"]["prefix_copied_bytes"] == log.totals()["prefix_copied_bytes"]
    )
    assert json.loads((tmp_path / "ev.json").read_text()) == data
    table = log.summary()
    assert table.splitlines()[0].split()[0] == "step" and len(table.splitlines()) == 4


def test_events_off_records_nothing():
    sess = onnxkv.Session(build_model("concat", MICRO), threads=1)
    sess.run(_feeds())
    assert len(sess.events) == 0


def test_show_config_prints_versions_openmp_threads_and_kernel_levels():
    buf = io.StringIO()
    onnxkv.show_config(file=buf)
    text = buf.getvalue()
    for key in (
        "onnxkv:",
        "openmp:",
        "threads:",
        "simd:",
        "simd_levels:",
        "amx:",
        "kernels:\n",
        "\n  paged_attention: ",
        "\n  matmul_nbits_int8: ",
    ):
        assert key in text
    cfg = onnxkv.config()
    assert cfg["simd"] == onnxkv.kernels.current_settings().simd == cfg["simd_levels"][-1]
    assert cfg["kernels"] == onnxkv.kernels.kernel_levels()


def test_repr_names_the_convention():
    assert "concat" in repr(onnxkv.Session(build_model("concat", MICRO), threads=1))


# -- token ids ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gqa", "concat"])
@pytest.mark.parametrize("bad", [-1, -MICRO.vocab_size, MICRO.vocab_size, 1 << 40])
def test_token_ids_outside_the_vocabulary_are_rejected_by_run_and_state_run(family, bad):
    sess = onnxkv.Session(build_model(family, MICRO), threads=1)
    feeds = _feeds()
    feeds["input_ids"] = np.array([[1, bad, 2, 3]])
    with pytest.raises(
        InputError,
        match=rf"input 'input_ids' holds token ids from {min(bad, 1)} to {max(bad, 3)}; "
        rf"expected ids in \[0, {MICRO.vocab_size}\)",
    ):
        sess.run(feeds)
    state = sess.new_state()
    state_feeds = {k: v for k, v in feeds.items() if not k.startswith("past")}
    with pytest.raises(InputError, match="token ids"):
        state.run(state_feeds)
    assert state.length == 0 and sess._step == 0


def test_token_limit_comes_from_the_embedding_table_when_the_vocabulary_is_unknown():
    emb = numpy_helper.from_array(np.arange(10, dtype=np.float32).reshape(5, 2), "emb")
    g = helper.make_graph(
        [helper.make_node("Gather", ["emb", "input_ids"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", "h"])],
        [emb],
    )
    sess = onnxkv.Session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), threads=1)
    assert sess.model.vocab_size is None and sess.token_limit == 5
    np.testing.assert_array_equal(sess.run({"input_ids": np.array([[4]], np.int32)})["logits"], [[[8, 9]]])
    for bad in (5, -1, -5):
        with pytest.raises(InputError, match=r"expected ids in \[0, 5\)"):
            sess.run({"input_ids": np.array([[0, bad]], np.int32)})


@pytest.mark.parametrize("size", [2, 32])  # a decode step's few ids, and a prefill's
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint64])
def test_ids_of_every_integer_width_are_checked(size, dtype):
    sess = onnxkv.Session(build_model("gqa", MICRO), threads=1)
    for limit in (100, 300):  # below and above int8's largest value
        sess.token_limit = limit
        ok = np.full((1, size), min(limit - 1, np.iinfo(dtype).max), dtype)
        assert sess._check_token_ids(ok) is None
        bad = ok.copy()
        bad[0, -1] = -1 if np.dtype(dtype).kind == "i" else min(limit, np.iinfo(dtype).max)
        if bad[0, -1] < limit and bad[0, -1] >= 0:
            continue  # uint8 cannot hold an id of 300
        with pytest.raises(InputError, match=rf"expected ids in \[0, {limit}\)"):
            sess._check_token_ids(bad)


@pytest.mark.parametrize(
    "family, node", [("attention", "Attention"), ("concat", "MaskedAttention"), ("gqa", "GroupQueryAttention")]
)
def test_a_stateless_run_of_an_empty_batch_names_the_attention_node(family, node):
    s = onnxkv.Session(build_model(family, MICRO, seed=1), threads=1)
    feeds = {}
    for inp in s.model.proto.graph.input:
        if "past" in inp.name:
            feeds[inp.name] = np.zeros((0, MICRO.num_kv_heads, 0, MICRO.head_size), np.float32)
        else:
            feeds[inp.name] = np.zeros((0, 3), np.int64)
    with pytest.raises(InputError, match=f"{node} node .*the batch is empty"):
        s.run(feeds)


# -- new_state's cache argument ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gqa():
    return onnxkv.Session(build_model("gqa", MICRO, seed=2), threads=1)


def _drive(state, feeds) -> tuple[list[np.ndarray], int]:
    """The logits of every run of ``feeds`` on ``state`` and the bytes it holds after them."""
    with state:
        logits = [state.run(f, ["logits"])["logits"].copy() for f in feeds]
        return logits, state.committed_bytes


def test_new_state_takes_a_cache_config_or_a_kind(gqa):
    with warnings.catch_warnings():
        warnings.simplefilter("error", OnnxkvDeprecationWarning)
        with gqa.new_state(cache=CacheConfig("paged", block_size=4, max_pages=64)) as st:
            assert st.paged and st.pool.block_size == 4 and st.pool.max_pages == 64
        with gqa.new_state(cache="paged") as st:
            assert st.paged and st.pool.block_size == 16
        with gqa.new_state(cache=CacheConfig(capacity=24, kv_format="bf16")) as st:
            assert not st.paged and st.capacity == 24 and st.cache_dtype == "bfloat16"
        with gqa.new_state() as st:
            assert not st.paged and st.capacity is None and st.initial_capacity == 32


def test_new_state_rejects_tensor_kinds_mixed_spellings_and_unknown_keywords(gqa):
    with pytest.raises(
        InputError,
        match=r"^Session.new_state: cache must be a CacheConfig, one of 'contiguous', "
        r"'paged' or None, got 'tensor'",
    ):
        gqa.new_state(cache="tensor")
    with pytest.raises(InputError, match=r"^Session.new_state: cache kind 'tensor' is not supported here"):
        gqa.new_state(cache=CacheConfig("tensor"))
    with pytest.raises(
        InputError,
        match=r"^Session.new_state: block_size= cannot be combined with "
        r"cache=CacheConfig\(...\); put them in the CacheConfig",
    ):
        gqa.new_state(cache=CacheConfig("paged"), block_size=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'blocksize'"):
        gqa.new_state(blocksize=4)


LEGACY_STATE = [
    (dict(capacity=64), CacheConfig(capacity=64)),
    (dict(initial_capacity=8), CacheConfig(initial_capacity=8)),
    (dict(cache_dtype="float16"), CacheConfig(kv_format="fp16")),
    (dict(cache="paged", block_size=4), CacheConfig("paged", block_size=4)),
    (dict(cache="paged", block_size=4, max_pages=64), CacheConfig("paged", block_size=4, max_pages=64)),
    (dict(cache="paged", block_size=4, kv_format="int8"), CacheConfig("paged", block_size=4, kv_format="int8")),
    (
        dict(cache="paged", block_size=4, kv_format="int4", key_channel_scales=True),
        CacheConfig("paged", block_size=4, kv_format="int4", key_layout=KeyLayout.CHANNEL),
    ),
    (
        dict(cache="paged", block_size=4, kv_format="int8-head", key_channel_zero_points=True),
        CacheConfig("paged", block_size=4, kv_format="int8-head", key_layout=KeyLayout.CHANNEL_ZERO_POINT),
    ),
]


@pytest.mark.parametrize("legacy,config", LEGACY_STATE, ids=[str(k) for k, _ in LEGACY_STATE])
def test_deprecated_state_keywords_warn_and_match_their_cache_config(gqa, legacy, config):
    feeds = step_feeds(gqa, 9, 4)
    want, want_bytes = _drive(gqa.new_state(cache=config), feeds)
    names = ", ".join(k + "=" for k in legacy if k != "cache")
    with warns_deprecated(
        __file__,
        rf"^Session.new_state: {names} (is|are) deprecated; pass "
        r"cache=onnxkv.CacheConfig\(kind=..., ...\) instead \(",
    ):
        state = gqa.new_state(**legacy)
    assert state.capacity == config.capacity
    got, got_bytes = _drive(state, feeds)
    assert got_bytes == want_bytes
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_key_layouts_are_applied(gqa):
    feeds = step_feeds(gqa, 9, 4)
    runs = {
        layout: _drive(
            gqa.new_state(cache=CacheConfig("paged", block_size=4, kv_format="int4", key_layout=layout)), feeds
        )
        for layout in KeyLayout
    }
    assert runs[KeyLayout.HEAD][1] < runs[KeyLayout.CHANNEL][1]  # a scale per channel costs header bytes
    last = [logits[-1] for logits, _ in runs.values()]  # each layout rounds the keys its own way
    assert not any(np.array_equal(last[i], last[j]) for i in range(3) for j in range(i))
