"""Persistent states with in-place caches: parity with the tensor path,
counted costs, atomic publication, isolation and every error case."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from deprecations import warns_deprecated

import onnxkv
from onnxkv import CacheCapacityError, CacheConfig
from onnxkv.errors import Cancelled, InputError, StateError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.runtime.state import Cancellation
from onnxkv.zoo.builders import MICRO, build_model

FAMILIES = ["gqa", "attention", "concat", "tensorscatter"]
KV_ROW = MICRO.num_kv_heads * MICRO.head_size * 4  # bytes of one position of K (or V), one sequence


@pytest.fixture(scope="module", params=FAMILIES)
def session(request):
    return onnxkv.Session(build_model(request.param, MICRO, seed=21), threads=1, events=True)


def _builders(session, prompt, in_place):
    lengths = np.full(prompt.shape[0], prompt.shape[1])
    return FeedBuilder(session.plan.inputs, session.model, prompt, lengths, 0, thread_cache=not in_place)


def _drive(session, prompt, steps, state=None):
    """Logits of prefill + ``steps`` greedy steps, and the final presents (tensor path) or state values."""
    model = session.model
    b = _builders(session, prompt, state is not None)
    feeds, _ = b.first()
    fetch = [model.io.logits] + ([] if state is not None else model.convention.present_outputs)
    run = state.run if state is not None else session.run
    logits = []
    out = run(feeds, fetch)
    for _ in range(steps):
        logits.append(out[model.io.logits][:, -1].copy())
        tok = np.argmax(out[model.io.logits][:, -1], axis=-1).astype(np.int64)
        feeds = b.next(tok, out)
        out = run(feeds, fetch)
    logits.append(out[model.io.logits][:, -1].copy())
    return logits, out, b


def test_in_place_matches_tensor_path(session):
    prompt = np.random.default_rng(0).integers(0, MICRO.vocab_size, (2, 7))
    want, tensor_out, _ = _drive(session, prompt, 16)
    state = session.new_state(cache=CacheConfig(initial_capacity=4))
    got, _, _ = _drive(session, prompt, 16, state)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)
    conv = session.model.convention
    assert state.length == 7 + 16
    for layer in conv.layers:
        for past, present in ((layer.past_key, layer.present_key), (layer.past_value, layer.present_value)):
            # the valid positions; a static cache's present also holds its zeros up to the capacity
            np.testing.assert_array_equal(state.values[past], tensor_out[present][:, :, : state.length])
            assert not tensor_out[present][:, :, state.length :].any()
    state.close()


def test_counted_costs_over_64_decode_steps(session):
    batch = 2
    prompt = np.random.default_rng(1).integers(0, MICRO.vocab_size, (batch, 5))
    static = session.model.convention.kind == "tensor_scatter"
    state = session.new_state(cache=CacheConfig(initial_capacity=8))
    session.events.clear()
    _drive(session, prompt, 64, state)
    by_step: dict[int, list] = {}
    for e in session.events:
        if e.action == "cache_write":
            by_step.setdefault(e.step, []).append(e)
    steps = sorted(by_step)
    assert len(steps) == 65
    growths = 0
    for i, s in enumerate(steps[1:], start=1):
        valid_before = 5 + i - 1  # positions in the cache before decode step i
        for e in by_step[s]:
            assert e.append_copied_bytes == batch * KV_ROW  # one token of K or V for every sequence
            if e.allocations:
                # exactly one copy of the valid prefix per growth
                growths += 1
                assert e.allocations == 1 and e.prefix_copied_bytes == batch * KV_ROW * valid_before
            else:
                assert e.prefix_copied_bytes == 0 and e.allocated_bytes == 0
        assert sum(e.append_copied_bytes for e in by_step[s]) == MICRO.num_layers * 2 * batch * KV_ROW
    # capacity 8 -> 16 -> 32 -> 64 -> 128 for 5 + 64 positions: 4 growths of each of the 4 cache values
    assert growths == (0 if static else 4 * 2 * MICRO.num_layers)
    assert state.committed_bytes == sum(c.nbytes for c in state._caches.values())
    state.close()


def test_fixed_capacity_overflow_is_an_error_and_state_unchanged():
    sess = onnxkv.Session(build_model("concat", MICRO), threads=1)
    state = sess.new_state(cache=CacheConfig(capacity=6))
    prompt = np.array([[1, 2, 3, 4, 5]])
    b = _builders(sess, prompt, True)
    feeds, _ = b.first()
    out = state.run(feeds)
    feeds = b.next(np.array([7]), out)
    state.run(feeds)  # 6 positions: fits exactly
    before = {k: v.copy() for k, v in state.values.items()}
    feeds = b.next(np.array([8]), out)
    with pytest.raises(CacheCapacityError, match="fixed capacity is 6"):
        state.run(feeds)
    assert state.length == 6
    for k, v in state.values.items():
        np.testing.assert_array_equal(v, before[k])


def test_failed_run_leaves_state_byte_identical_and_retryable():
    sess = onnxkv.Session(build_model("gqa", MICRO), threads=1)
    prompt = np.array([[3, 1, 4, 1]])
    ref_state = sess.new_state()
    ref, _, _ = _drive(sess, prompt, 2, ref_state)

    state = sess.new_state()
    b = _builders(sess, prompt, True)
    feeds, _ = b.first()
    out = state.run(feeds)
    tok = np.argmax(out["logits"][:, -1], axis=-1)
    good = b.next(tok, out)
    bad = dict(good, input_ids=np.array([[MICRO.vocab_size + 5]]))  # token id out of the vocabulary
    before = {k: v.copy() for k, v in state.values.items()}
    with pytest.raises(InputError, match="token ids"):
        state.run(bad)
    assert state.length == 4
    for k, v in state.values.items():
        np.testing.assert_array_equal(v, before[k])
    out = state.run(good)  # retry succeeds as if nothing had happened
    np.testing.assert_array_equal(out["logits"][:, -1], ref[1])


def test_cancellation_publishes_nothing():
    sess = onnxkv.Session(build_model("attention", MICRO), threads=1)
    state = sess.new_state()
    b = _builders(sess, np.array([[1, 2, 3]]), True)
    feeds, _ = b.first()
    token = Cancellation()
    token.cancel()
    with pytest.raises(Cancelled, match="cancelled"):
        state.run(feeds, cancel=token)
    assert state.length == 0
    state.run(feeds, cancel=Cancellation())
    assert state.length == 3


def test_overlapping_calls_are_rejected():
    sess_holder = {}

    class Reentrant(onnxkv.SystemAllocator):
        def allocate(self, nbytes, alignment=64):
            st = sess_holder.get("state")
            if st is not None and not sess_holder.get("tried"):
                sess_holder["tried"] = True
                with pytest.raises(StateError, match="must not overlap"):
                    st.run(sess_holder["feeds"])
            return super().allocate(nbytes, alignment)

    sess = onnxkv.Session(build_model("concat", MICRO), threads=1, allocator=Reentrant())
    state = sess.new_state()
    feeds, _ = _builders(sess, np.array([[1, 2]]), True).first()
    sess_holder.update(state=state, feeds=feeds)
    state.run(feeds)
    assert sess_holder["tried"] and state.length == 2


def test_bound_inputs_closed_state_and_bad_arguments():
    sess = onnxkv.Session(build_model("concat", MICRO), threads=1)
    state = sess.new_state()
    feeds, _ = _builders(sess, np.array([[1, 2]]), True).first()
    with pytest.raises(StateError, match="bound to the state"):
        state.run(dict(feeds, **{"past_key_values.0.key": np.zeros((1, 2, 0, 16), np.float32)}))
    state.close()
    with pytest.raises(StateError, match="closed"):
        state.run(feeds)
    with pytest.raises(onnxkv.InputError, match="capacity"):
        sess.new_state(cache=CacheConfig(capacity=0))
    s2 = sess.new_state()
    s2.run(feeds)
    feeds3, _ = _builders(sess, np.array([[1, 2], [3, 4]]), True).first()
    with pytest.raises(onnxkv.InputError, match="batch size 2"):
        s2.run(feeds3)


def test_states_are_isolated_and_values_read_only():
    sess = onnxkv.Session(build_model("gqa", MICRO), threads=1)
    a, b = sess.new_state(), sess.new_state()
    fa, _ = _builders(sess, np.array([[1, 2, 3]]), True).first()
    fb, _ = _builders(sess, np.array([[9, 8, 7]]), True).first()
    a.run(fa)
    snap = {k: v.copy() for k, v in a.values.items()}
    b.run(fb)
    for k in snap:
        np.testing.assert_array_equal(a.values[k], snap[k])
        assert not np.shares_memory(a._caches[k].buffer, b._caches[k].buffer)
    v = next(iter(a.values.values()))
    with pytest.raises(ValueError):
        v[...] = 0


def test_reset_from_initial_continues_like_the_tensor_path():
    sess = onnxkv.Session(build_model("attention", MICRO), threads=1)
    prompt = np.array([[5, 6, 7, 8]])
    _, out, builder = _drive(sess, prompt, 0)
    conv = sess.model.convention
    initial = {}
    for layer in conv.layers:
        initial[layer.past_key] = out[layer.present_key]
        initial[layer.past_value] = out[layer.present_value]
    tok = np.argmax(out["logits"][:, -1], axis=-1)
    feeds = builder.next(tok, out)
    want = sess.run(feeds)["logits"]
    state = sess.new_state(initial=initial)
    assert state.length == 4
    got = state.run({k: v for k, v in feeds.items() if k not in conv.past_inputs})["logits"]
    np.testing.assert_array_equal(got, want)
    state.reset()
    assert state.length == 0 and state.committed_bytes == 0


def test_present_is_exported_only_when_asked_and_counted():
    sess = onnxkv.Session(build_model("concat", MICRO), threads=1, events=True)
    state = sess.new_state()
    feeds, _ = _builders(sess, np.array([[1, 2, 3]]), True).first()
    out = state.run(feeds)
    assert set(out) == {"logits"}
    b = _builders(sess, np.array([[1, 2, 3]]), True)
    b.first()
    out2 = state.run(b.next(np.array([4]), out), ["logits", "present.0.key"])
    pk = out2["present.0.key"]
    assert pk.shape == (1, MICRO.num_kv_heads, 4, MICRO.head_size)
    np.testing.assert_array_equal(pk, state.values["past_key_values.0.key"])
    assert not np.shares_memory(pk, state._caches["past_key_values.0.key"].buffer)
    exports = [e for e in sess.events if e.action == "export"]
    assert len(exports) == 1 and exports[0].prefix_copied_bytes == pk.nbytes


def test_concurrent_states_on_one_session():
    sess = onnxkv.Session(build_model("concat", MICRO), threads=1)
    prompts = [np.array([[i + 1, i + 2, i + 3]]) for i in range(4)]
    want = [onnxkv.generate(sess, p, 6, eos_token_id=[], cache="tensor").tokens for p in prompts]
    got = [None] * 4

    def work(i):
        got[i] = onnxkv.generate(sess, prompts[i], 6, eos_token_id=[]).tokens

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


@pytest.mark.parametrize("cache_dtype,tol", [("float16", 2e-2), ("bfloat16", 1e-1)])
def test_narrow_cache_storage_halves_the_bytes_and_stays_close(cache_dtype, tol):
    sess = onnxkv.Session(build_model("gqa", MICRO, seed=5), threads=1, events=True)
    prompt = np.random.default_rng(3).integers(0, MICRO.vocab_size, (2, 9))
    want, _, _ = _drive(sess, prompt, 12)
    wide = sess.new_state(cache=CacheConfig(initial_capacity=32))
    _drive(sess, prompt, 12, wide)
    fmt = {"float16": "fp16", "bfloat16": "bf16"}[cache_dtype]
    narrow = sess.new_state(cache=CacheConfig(initial_capacity=32, kv_format=fmt))
    sess.events.clear()
    got, _, _ = _drive(sess, prompt, 12, narrow)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=tol, rtol=0)
    assert narrow.committed_bytes * 2 == wide.committed_bytes
    stored = next(iter(narrow.values.values()))
    assert stored.dtype == (np.float16 if cache_dtype == "float16" else np.uint16)
    writes = [e for e in sess.events if e.action == "cache_write" and e.step == max(x.step for x in sess.events)]
    assert all(e.append_copied_bytes == 2 * MICRO.num_kv_heads * MICRO.head_size * 2 for e in writes)
    # an exported present comes back in the model's type
    b = _builders(sess, prompt, True)
    s3 = sess.new_state(cache=CacheConfig(kv_format=fmt))
    f, _ = b.first()
    out = s3.run(f, ["logits", "present.0.key"])
    assert out["present.0.key"].dtype == np.float32 and out["present.0.key"].shape[2] == 9


def test_narrow_cache_needs_a_gqa_model():
    sess = onnxkv.Session(build_model("concat", MICRO), threads=1)
    with pytest.raises(
        onnxkv.InputError, match=r"cache_dtype='float16' \(kv_format='fp16'\) needs a GroupQueryAttention"
    ):
        sess.new_state(cache=CacheConfig(kv_format="fp16"))
    gqa = onnxkv.Session(build_model("gqa", MICRO), threads=1)
    with (
        warns_deprecated(__file__, "cache_dtype= is deprecated"),
        pytest.raises(onnxkv.InputError, match="cache_dtype"),
    ):
        gqa.new_state(cache_dtype="int8")  # State's own check, through the deprecated keyword
    with pytest.raises(onnxkv.InputError, match="kv_format='int8' .page formats. needs kind='paged'"):
        CacheConfig(kv_format="int8")


def test_truncate_rolls_back_and_replays_identically(session):
    prompt = np.random.default_rng(5).integers(0, MICRO.vocab_size, (1, 7))
    state = session.new_state()
    b = _builders(session, prompt, True)
    feeds, _ = b.first()
    logits = session.model.io.logits
    out = state.run(feeds, [logits])
    if session.model.convention.kind == "tensor_scatter":
        with pytest.raises(StateError, match="static"):
            state.truncate(3)
        state.close()
        return
    f1 = b.next(np.array([11]), out)
    first = state.run(f1, [logits])[logits].copy()
    assert state.length == 8
    state.truncate(7)
    assert state.length == 7
    again = state.run(f1, [logits])[logits]
    np.testing.assert_array_equal(first, again)
    with pytest.raises(onnxkv.InputError, match="truncate"):
        state.truncate(9)
    with pytest.raises(onnxkv.InputError, match="truncate"):
        state.truncate(-1)
    state.close()


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_a_run_of_an_empty_batch_is_refused_before_any_cache_is_made(session, cache):
    prompt = np.zeros((0, 3), np.int64)
    feeds, _ = _builders(session, np.zeros((1, 3), np.int64), True).first()
    empty = {k: v[:0] if np.ndim(v) >= 1 and np.shape(v)[0] == 1 else v for k, v in feeds.items()}
    empty[session.model.io.input_ids] = prompt
    with session.new_state(cache=cache) as st:
        with pytest.raises(InputError, match="a batch of 0 rows; a state runs at least one row"):
            st.run(empty)
        scalar = {**feeds, session.model.io.input_ids: 65}  # no batch axis at all: it used to be an IndexError
        with pytest.raises(
            InputError, match=r"State.run: 'input_ids' must be an array \[batch, length\], got shape \(\)"
        ):
            st.run(scalar)
        assert st.length == 0 and st.batch == 0 and st.committed_bytes == 0
        out = st.run(feeds)  # the state is as new
        assert st.length == 3 and out
