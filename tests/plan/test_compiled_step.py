"""Compiled steps (onnxkv.plan.compiled_step): replayed kernel calls give the node-by-node results bit for bit,
on every cache family, contiguous and paged caches, page formats, batches, and runs that change shape."""

from __future__ import annotations

import numpy as np
import pytest
from state_steps import compiled_kinds

import onnxkv
from onnxkv import CacheConfig
from onnxkv.alloc import SystemAllocator
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.compiled_step import Segment
from onnxkv.zoo.builders import MICRO, build_model

FAMILIES = ["gqa", "attention", "concat", "tensorscatter"]
CACHES = [
    CacheConfig("contiguous"),
    CacheConfig("paged", block_size=4),
    CacheConfig("paged", block_size=4, kv_format="int8"),
]


def _steps(session, state, prompt, tokens):
    """Logits of a prompt and then of each token of ``tokens`` [steps, B] fed one by one (copies)."""
    name = session.model.io.logits
    lengths = np.full(prompt.shape[0], prompt.shape[1])
    b = FeedBuilder(session.plan.inputs, session.model, prompt, lengths, 0, thread_cache=False)
    feeds, _ = b.first()
    out = state.run(feeds, [name])
    got = [out[name]]
    for t in tokens:
        out = state.run(b.next(np.asarray(t, np.int64), out), [name])
        got.append(out[name])
    return got


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.mark.parametrize("cache", CACHES, ids=["contiguous", "paged", "paged-int8"])
@pytest.mark.parametrize("batch", [1, 2])
def test_replayed_steps_equal_node_by_node_runs(family, cache, batch):
    if cache.kind == "paged" and cache.kv_format == "int8" and family != "gqa":
        pytest.skip("page formats: GroupQueryAttention models")
    model = build_model(family, MICRO, seed=5)
    rng = np.random.default_rng(batch)
    prompt = rng.integers(1, MICRO.vocab_size, (batch, 5))
    tokens = rng.integers(1, MICRO.vocab_size, (6, batch))
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        with session.new_state(cache=cache) as state:
            runs[compiled] = _steps(session, state, prompt, tokens)
        if compiled:
            step = session.plan.steps.idle[0]
            assert step.compiled_nodes > 0
            assert any(isinstance(item, Segment) for item in step.items)
    _assert_equal_runs(runs)


def _assert_equal_runs(runs: dict) -> None:
    """The node-by-node run's values (``runs[False]``) equal the replayed run's bit for bit."""
    for plain, replayed in zip(runs[False], runs[True], strict=True):
        np.testing.assert_array_equal(plain, replayed)


def test_tensor_runs_without_a_state_replay_too():
    model = build_model("gqa", MICRO, seed=6)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, MICRO.vocab_size, (1, 4))
    got = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        got[compiled] = onnxkv.generate(session, prompt, max_new_tokens=8, cache="tensor").tokens
    np.testing.assert_array_equal(got[False], got[True])


def test_returned_outputs_are_not_rewritten_by_the_next_replay():
    session = onnxkv.Session(build_model("gqa", MICRO, seed=7), threads=1)
    rng = np.random.default_rng(1)
    with session.new_state() as state:
        got = _steps(session, state, rng.integers(1, MICRO.vocab_size, (1, 4)), rng.integers(1, 50, (5, 1)))
    copies = [g.copy() for g in got]
    assert session.plan.steps.idle[0].owned_outputs  # the logits are the step's memory
    for g, c in zip(got, copies):
        np.testing.assert_array_equal(g, c)
    assert len({g.__array_interface__["data"][0] for g in got}) == len(got)


def test_a_run_of_other_shapes_falls_back_and_a_new_step_is_recorded():
    model = build_model("gqa", MICRO, seed=8)
    rng = np.random.default_rng(2)
    results = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        outs = []
        with session.new_state() as state:
            outs += _steps(session, state, rng.integers(1, 50, (1, 3)), [[4], [5], [6]])
        with session.new_state() as state:  # batch 2: every segment's check fails on the recorded step
            outs += _steps(session, state, rng.integers(1, 50, (2, 6)), [[1, 2], [3, 4], [5, 6]])
        results[compiled] = outs
        rng = np.random.default_rng(2)
    for plain, replayed in zip(results[False], results[True]):
        np.testing.assert_array_equal(plain, replayed)


def test_runs_with_an_event_log_or_a_callers_allocator_run_node_by_node():
    model = build_model("gqa", MICRO, seed=9)
    prompt = np.array([[3, 4, 5]])
    logged = onnxkv.Session(model, threads=1, events=True)
    onnxkv.generate(logged, prompt, max_new_tokens=4)
    assert logged.plan.steps.runs == 0 and not logged.plan.steps.idle
    assert len([e for e in logged.events if e.action == "execute"]) == 4 * len(
        logged.plan.nodes
    )  # the prompt and 3 steps
    assert onnxkv.Session(model, threads=1, allocator=SystemAllocator()).plan.steps is None
    assert onnxkv.Session(model, threads=1, compiled_steps=False).plan.steps is None


def test_every_packed_product_the_embedding_the_mask_lengths_and_the_attention_of_a_decode_step_are_compiled():
    """...and stay so: one step serves every token, whose attention mask grows by a column each."""
    session = onnxkv.Session(build_model("gqa", MICRO, seed=10), threads=1)
    onnxkv.generate(session, np.array([[3, 4, 5]]), max_new_tokens=12)
    kinds = ("MatMul", "PrologueMatMul", "Gather", "GroupQueryAttention", "MaskLengths")
    products = [k for k, op in enumerate(session.plan.kernels) if type(op).__name__ in kinds]
    assert products
    (step,) = session.plan.steps.idle
    compiled = {k for item in step.items if isinstance(item, Segment) for k in range(item.first, item.end)}
    assert compiled == set(products)
    assert not step.stale


def test_decode_attention_replays_through_cache_growth_and_new_states_without_a_new_recording(recordings):
    """The caches are resizable externals: a replay reads their capacity, so one recorded step serves a cache
    that grew (4 -> 8 -> 16) and new states of other capacities."""
    model = build_model("gqa", MICRO, seed=11)
    rng = np.random.default_rng(3)
    prompt, tokens = rng.integers(1, MICRO.vocab_size, (1, 3)), rng.integers(1, MICRO.vocab_size, (12, 1))
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        for capacity in (4, 7, 30):
            with session.new_state(cache=CacheConfig("contiguous", initial_capacity=capacity)) as state:
                runs[compiled, capacity] = _steps(session, state, prompt, tokens)
                assert state.length == 15  # grown 4 -> 8 -> 16, 7 -> 14 -> 28 while replaying
        if compiled:
            assert "GroupQueryAttention" in compiled_kinds(session)
            # the decode step is recorded once; so is the prompt (a first prompt into an empty cache is one
            # fused call): by the second state, and the third state's prompt replays it
            assert len(recordings) == 2
    for capacity in (4, 7, 30):
        _assert_equal_runs({c: runs[c, capacity] for c in (False, True)})


def test_states_taking_turns_on_one_session_replay_against_their_own_caches():
    model = build_model("gqa", MICRO, seed=12)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, MICRO.vocab_size, (1, n)) for n in (3, 7)]
    tokens = rng.integers(1, MICRO.vocab_size, (6, 1))
    name = None
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        name = session.model.io.logits
        states = [session.new_state() for _ in prompts]
        builders, outs, got = [], [], []
        for state, prompt in zip(states, prompts):
            b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([prompt.shape[1]]), 0, False)
            feeds, _ = b.first()
            builders.append(b)
            outs.append(state.run(feeds, [name]))
        for t in tokens:  # one step of each state in turn
            for i, state in enumerate(states):
                outs[i] = state.run(builders[i].next(np.asarray(t, np.int64), outs[i]), [name])
                got.append(outs[i][name].copy())
        for state in states:
            state.close()
        runs[compiled] = got
    _assert_equal_runs(runs)


def _hostile_mask(kind, length):
    if kind == "too-long":
        return np.ones((1, length + 3), np.int64)
    if kind == "hole":  # the committed length's sum, over one column more
        mask = np.ones((1, length + 2), np.int64)
        mask[0, 1] = 0
        return mask
    mask = np.ones((1, length + 1), np.int64)  # the int64 sum wraps round to the committed length
    mask[0, :2] = (np.iinfo(np.int64).max, 2)
    return mask


@pytest.mark.parametrize("cache", ["contiguous", CacheConfig("paged", block_size=4)], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kind", ["too-long", "hole", "wrapping"])
def test_a_mask_that_disagrees_with_the_cache_is_not_replayed_and_fails_as_node_by_node(kind, cache):
    model = build_model("gqa", MICRO, seed=13)
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, MICRO.vocab_size, (1, 4))
    outcomes = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        name = session.model.io.logits
        with session.new_state(cache=cache) as state:
            _steps(session, state, prompt, [[5], [6], [7]])
            length = state.length
            feeds = {"input_ids": np.array([[8]]), "attention_mask": _hostile_mask(kind, length)}
            try:
                state.run(feeds, [name])
                outcomes[compiled] = ("ran", state.length)
            except onnxkv.errors.OnnxkvError as e:
                outcomes[compiled] = (type(e).__name__, str(e), state.length)
            out = state.run({"input_ids": np.array([[9]]), "attention_mask": np.ones((1, state.length + 1), np.int64)})
            outcomes[compiled] += (out[name].copy(),)
    assert outcomes[False][:-1] == outcomes[True][:-1]
    np.testing.assert_array_equal(outcomes[False][-1], outcomes[True][-1])


def test_paged_decode_attention_is_compiled_and_one_step_serves_every_token():
    """The fused paged decode call is recorded: the whole decode step is one segment, and one recording
    serves every later token although the block tables gain a column and pages are staged per step."""
    session = onnxkv.Session(build_model("gqa", MICRO, seed=14), threads=1)
    onnxkv.generate(session, np.array([[3, 4, 5]]), max_new_tokens=12, cache=CacheConfig("paged", block_size=4))
    (step,) = session.plan.steps.idle
    assert "GroupQueryAttention" in compiled_kinds(session)
    assert [type(item) for item in step.items] == [Segment] and not step.stale
    effects = [effect for effect, _ in step.items[0].effects]  # one per layer: the first stages for all
    assert [e.leads for e in effects] == [True] + [False] * (len(effects) - 1) and len(effects) > 1
    assert effects[0].followers == effects[1:]


def _paged_runs(model, compiled, run):
    """``run(session)``'s result with and without compiled steps, and the compiled session."""
    session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
    return run(session), session


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_replays_equal_node_by_node_through_pool_growth(block_size):
    """Page addresses and block tables are ragged externals: the pool grows past its first 64 ids and the
    tables by a column every ``block_size`` tokens, and the step recorded at the start keeps replaying."""
    model = build_model("gqa", MICRO, seed=20)
    prompt = np.random.default_rng(11).integers(1, MICRO.vocab_size, (2, 5))
    cache = CacheConfig("paged", block_size=block_size)

    def run(session):
        return onnxkv.generate(session, prompt, max_new_tokens=40, cache=cache, do_sample=True, seed=3).tokens

    plain, _ = _paged_runs(model, False, run)
    replayed, session = _paged_runs(model, True, run)
    np.testing.assert_array_equal(plain, replayed)
    assert "GroupQueryAttention" in compiled_kinds(session)


def test_paged_replays_serve_engine_rows_of_different_lengths_and_forked_tables():
    """A batched engine step (rows of their own lengths and page tables) and beam search (tables forked and
    reordered: copy-on-write staged before each replayed write) give the node-by-node tokens."""
    model = build_model("gqa", MICRO, seed=21)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(1, MICRO.vocab_size, n) for n in (3, 9, 6)]

    def engine(session):
        eng = onnxkv.Engine(session, cache=CacheConfig("paged", block_size=4))
        requests = [eng.add_request(p, 14) for p in prompts]
        eng.step()
        eng.step()
        requests.append(eng.add_request(prompts[0][:2], 9))
        eng.run()
        return [r.tokens for r in requests]

    def beams(session):
        return onnxkv.beam_search(session, prompts[1][None], num_beams=3, max_new_tokens=12, cache="paged").sequences

    for run in (engine, beams):
        plain, _ = _paged_runs(model, False, run)
        replayed, session = _paged_runs(model, True, run)
        assert len(plain) == len(replayed)
        for a, b in zip(plain, replayed, strict=True):
            np.testing.assert_array_equal(a, b)
        assert "GroupQueryAttention" in compiled_kinds(session), run.__name__


def test_states_of_other_block_sizes_on_one_session_replay_their_own_steps():
    """A paged decode call addresses pages by its block size: states of block sizes 4 and 16 taking turns on
    one session each replay a step of their own (in State.run and in the compiled generation loop) and give
    the node-by-node tokens."""
    model = build_model("gqa", MICRO, seed=23)
    prompt = np.random.default_rng(14).integers(1, MICRO.vocab_size, (1, 5))
    caches = [CacheConfig("paged", block_size=4), CacheConfig("paged", block_size=16)]

    def run(session):
        got = []
        for _ in range(2):
            for cache in caches:
                got.append(onnxkv.generate(session, prompt, max_new_tokens=30, cache=cache).tokens)
                with session.new_state(cache=cache) as state:
                    got.extend(_steps(session, state, prompt, [[3], [4], [5], [6], [7]]))
        return got

    plain, _ = _paged_runs(model, False, run)
    replayed, session = _paged_runs(model, True, run)
    for a, b in zip(plain, replayed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert {step.caches[0][2] for step in session.plan.steps.idle} == {4, 16}


def test_a_paged_replay_refuses_a_bad_page_address_before_anything_runs():
    """Page addresses are checked in C on every replay (the block tables by the staging before it): a page the
    call would read whose address is not a page's is refused (replay None, nothing run, the step kept), and
    the node-by-node path refuses it too, naming it."""
    from onnxkv.plan.context import RunContext

    session = onnxkv.Session(build_model("gqa", MICRO, seed=22), threads=1)
    prompt = np.random.default_rng(13).integers(1, MICRO.vocab_size, (1, 6))
    with session.new_state(cache=CacheConfig("paged", block_size=4)) as state:
        b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([6]), 0, False)
        state.run(b.first()[0])
        for t in (5, 6):
            state.run(b.next(np.array([t]), None))
        (step,) = session.plan.steps.idle
        (seg,) = [it for it in step.items if isinstance(it, Segment)]
        caches = state._store.caches
        cache = next(iter(caches.values())).cache
        page = int(cache.table.tables[0, 0])  # block 0 holds keys the new token sees
        good = int(cache.payloads.ptrs[0, page])
        feeds = b.next(np.array([7]), None)
        slots = session.plan.bind_inputs(state._store.feeds(feeds), caches)
        for bad in (0, good + 4):
            cache.payloads.ptrs[0, page] = bad
            assert seg.replay(list(slots), RunContext(None, False, 0, caches)) is None
            cache.discard()
            with pytest.raises(onnxkv.errors.OnnxkvError, match="page"):
                state.run(feeds)
            cache.payloads.ptrs[0, page] = good
        assert state.length == 8
        state.run(feeds)
        assert state.length == 9 and session.plan.steps.idle == [step] and not step.stale


@pytest.mark.parametrize("accuracy_level", [4, 0], ids=["int8-activations", "float-activations"])
@pytest.mark.parametrize("batch", [1, 3])
def test_block_quantized_products_replay_with_the_node_by_node_results(tmp_path, accuracy_level, batch):
    """Every node of the decode step replays, at one row and at several rows of a paged state (sibling products
    then one kernel call per output)."""
    path = tmp_path / "int4.onnx"
    onnxkv.quantize_weights(build_model("gqa", MICRO, seed=15), path, bits=4, accuracy_level=accuracy_level)
    cache = CacheConfig("contiguous") if batch == 1 else CacheConfig("paged", block_size=4)
    kinds = _replays_equal_node_by_node(path, seed=6, batch=batch, cache=cache)
    assert {"MatMulNBits", "SiblingMatMulNBits"} & kinds and "GroupQueryAttention" in kinds
    session = onnxkv.Session(path, threads=1)
    with session.new_state(cache=cache) as state:
        _steps(session, state, np.ones((batch, 5), np.int64), np.ones((2, batch), np.int64))
    (step,) = session.plan.steps.idle
    assert step.compiled_nodes == len(session.plan._steps)


def _replays_equal_node_by_node(path, seed: int, batch: int = 1, cache: CacheConfig | None = None) -> set[str]:
    """A prompt and 6 tokens of ``batch`` rows through a state (``cache``) of the model at ``path``, node by
    node and replayed: equal bit for bit.  Returns the operators the compiled step recorded."""
    rng = np.random.default_rng(seed)
    prompt, tokens = rng.integers(1, MICRO.vocab_size, (batch, 5)), rng.integers(1, MICRO.vocab_size, (6, batch))
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(path, threads=1, compiled_steps=compiled)
        with session.new_state(cache=cache) as state:
            runs[compiled] = _steps(session, state, prompt, tokens)
    _assert_equal_runs(runs)
    return compiled_kinds(session)


@pytest.mark.parametrize("family", ["gqa", "concat"])
def test_dynamically_quantized_products_replay_with_the_node_by_node_results(tmp_path, family):
    """quantize_dynamic's DynamicQuantizeLinear / MatMulInteger / Cast / Mul chains, fused into
    DynamicQuantMatMul, are recorded and replayed with the node-by-node values."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    float_path, path = tmp_path / "float.onnx", tmp_path / "int8.onnx"
    onnx.save(build_model(family, MICRO, seed=15), str(float_path))
    quantize_dynamic(
        str(float_path),
        str(path),
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul"],
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    assert "DynamicQuantMatMul" in _replays_equal_node_by_node(path, seed=7)


def test_a_replay_cancelled_before_any_of_its_items_leaves_the_state_as_it_was():
    from faults import CancelOnCheck

    session = onnxkv.Session(build_model("gqa", MICRO, seed=16), threads=1)
    rng = np.random.default_rng(7)
    with session.new_state() as state:
        _steps(session, state, rng.integers(1, MICRO.vocab_size, (1, 4)), [[5], [6]])  # records, replays
        (step,) = session.plan.steps.idle
        items = len(step.items)
        feeds = {"input_ids": np.array([[7]]), "attention_mask": np.ones((1, state.length + 1), np.int64)}
        before = {n: np.array(v) for n, v in state.values.items()}, state.length
        for k in range(items):  # a compiled step checks before each item (a Python node or a segment)
            token = CancelOnCheck(k)
            with pytest.raises(onnxkv.errors.Cancelled):
                state.run(feeds, cancel=token)
            assert token.checks == k + 1
            assert state.length == before[1]
            for n, v in state.values.items():
                np.testing.assert_array_equal(v, before[0][n])
        state.run(feeds)
        assert state.length == before[1] + 1


def _verifications(session, state, prompt, chunks):
    """Logits of a prompt, then of each chunk of tokens fed at once, keeping ``keep`` of them (a speculative
    verification: the rest is truncated) -- ``chunks`` a list of (tokens, keep)."""
    name = session.model.io.logits
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([prompt.shape[1]]), 0, thread_cache=False)
    feeds, _ = b.first()
    got = [state.run(feeds, [name])[name]]
    for tokens, keep in chunks:
        got.append(state.run(b.next(np.array([tokens], np.int64), None), [name])[name])
        length = state.length - len(tokens) + keep
        state.truncate(length)
        b.rewind(length)
    return got


@pytest.mark.parametrize("cache", [None, CacheConfig("paged", block_size=4)], ids=["contiguous", "paged"])
@pytest.mark.parametrize("which", ["gqa", "embedded"])
def test_verifications_of_several_tokens_replay_the_fused_attention_bit_for_bit(which, cache):
    """Every node of a few-token run is compiled (the fused attention takes S tokens, on contiguous and on
    paged caches, pages crossed; the builder's packed QKV rows are strided), and a prompt as long as a
    verification does not leave a step with Python attention behind (its recording is transient)."""
    from onnxkv.zoo import embedded

    model = build_model("gqa", MICRO, seed=17) if which == "gqa" else str(embedded.embedded_model_dir())
    rng = np.random.default_rng(8)
    vocab = 90
    prompt = rng.integers(1, vocab, (1, 5))
    chunks = [(rng.integers(1, vocab, n).tolist(), keep) for n, keep in
              [(5, 2), (3, 3), (5, 5), (2, 1), (5, 1), (3, 2), (1, 1), (5, 4), (16, 9), (16, 16)]]  # fmt: skip
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        with session.new_state(cache=cache) as state:  # the session's first run: plain; the 5-token prompt then records
            _verifications(session, state, prompt[:, :3], [])
        for _ in range(2):  # the second prompt of length 5 finds the recorded 5-token step
            with session.new_state(cache=cache) as state:
                runs[compiled] = _verifications(session, state, prompt, chunks)
    _assert_equal_runs(runs)
    steps = session.plan.steps.idle
    assert {s.signature[0][1] for s in steps} >= {(1, 5), (1, 3), (1, 16)}
    for step in steps:
        assert step.compiled_nodes == len(session.plan.nodes), step.signature


def test_a_speculative_tree_verification_replays_whole_on_forked_page_tables():
    """The target's run of a tree (rows forked from one sequence, S tokens each) is one recorded segment on
    the forked tables, and the tree's tokens are greedy generation's with and without compiled steps."""
    from onnxkv.generate.speculative import speculative_generate

    model, draft = build_model("gqa", MICRO, seed=24), build_model("gqa", MICRO, seed=25)
    prompt = np.random.default_rng(13).integers(1, MICRO.vocab_size, (1, 6))
    want = onnxkv.generate(onnxkv.Session(model, threads=1), prompt, max_new_tokens=30, eos_token_id=[]).sequences
    for compiled in (False, True):
        target = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        got = speculative_generate(
            target, prompt, draft=onnxkv.Session(draft, threads=1), max_new_tokens=30, eos_token_id=[], tree=(2, 3)
        )
        np.testing.assert_array_equal(got.sequences, want)
    trees = [s for s in target.plan.steps.idle if s.signature and s.signature[0][1] == (2, 4)]
    assert trees and all([type(i) for i in s.items] == [Segment] for s in trees)
    assert "GroupQueryAttention" in compiled_kinds(target)


def test_steps_recorded_with_paged_caches_are_not_taken_by_contiguous_runs():
    """The same input shapes over another cache storage take other operator paths (paged and contiguous
    attention calls differ): each storage records and keeps its own step, and both replay every node."""
    session = onnxkv.Session(build_model("gqa", MICRO, seed=18), threads=1)
    rng = np.random.default_rng(9)
    prompt, tokens = rng.integers(1, MICRO.vocab_size, (1, 4)), rng.integers(1, MICRO.vocab_size, (4, 1))
    for cache in ("paged", "contiguous", "paged", "contiguous"):
        with session.new_state(cache=cache) as state:
            _steps(session, state, prompt, tokens)
    kinds = sorted({step.caches[0] for step in session.plan.steps.idle})
    assert kinds == [(False, "float32", None), (True, "float32", 16)]
    contiguous = [s for s in session.plan.steps.idle if not s.caches[0][0]]
    assert len(contiguous) == 2  # the decode step and the prompt's (one fused call into an empty cache)
    assert all(whole.compiled_nodes == len(session.plan.nodes) for whole in contiguous)
    paged = [s for s in session.plan.steps.idle if s.caches[0][0]]
    assert [whole.compiled_nodes == len(session.plan.nodes) for whole in paged] == [True]  # the decode step


def test_a_segment_tells_values_it_refuses_from_externals_unlike_its_recording():
    """replay: None when the calls refuse this run's values (the step stays: a full cache, which the Python
    path grows), False when the externals differ (a cache missing: the step is dropped)."""
    from onnxkv.plan.context import RunContext

    session = onnxkv.Session(build_model("gqa", MICRO, seed=19), threads=1)
    rng = np.random.default_rng(10)
    with session.new_state(cache=CacheConfig("contiguous", initial_capacity=6)) as state:
        b = FeedBuilder(session.plan.inputs, session.model, rng.integers(1, 90, (1, 4)), np.array([4]), 0, False)
        feeds, _ = b.first()
        state.run(feeds)
        for t in (5, 6):
            feeds = b.next(np.array([t]), None)
            state.run(feeds)
        (step,) = session.plan.steps.idle
        (seg,) = [it for it in step.items if isinstance(it, Segment)]
        caches = state._store.caches
        feeds = b.next(np.array([7]), None)
        slots = session.plan.bind_inputs(state._store.feeds(feeds), caches)
        assert state.length == 6  # full: the next token has no room
        assert seg.replay(list(slots), RunContext(None, False, 0, caches)) is None
        assert seg.replay(list(slots), RunContext(None, False, 0, {})) is False
        state.run(feeds)  # refused by the replay, grown by the Python path: the step stays
        assert state.length == 7 and session.plan.steps.idle == [step] and not step.stale


def test_a_node_recorded_then_kept_in_python_leaves_no_memory_a_later_segment_mistakes_for_its_input():
    """A GroupQueryAttention prompt node runs during the recording with the step's buffers, then stays a
    Python node.  Its output's buffer used to go back to the step's free lists after its last read and be
    handed to a later compiled node (the next layer's q projection, of the same size when the query width
    is not the hidden size); the segment reading the attention output then took that operand for its
    external's memory, wrote the run's value there on replay and left the exported array stale: a prompt
    run after a chunk of another length of past gave wrong logits (1.5 off) with no error."""
    from dataclasses import replace

    model = build_model("gqa", replace(MICRO, hidden_size=96), seed=1)  # q width 64, hidden 96
    compiled = onnxkv.Session(model, threads=1)
    plain = onnxkv.Session(model, threads=1, compiled_steps=False)
    ids = np.random.default_rng(0).integers(3, MICRO.vocab_size, (1, 22))
    h, d = MICRO.num_kv_heads, MICRO.head_size
    empty = {f"past_key_values.{i}.{w}": np.zeros((1, h, 0, d), np.float32) for i in range(2) for w in ("key", "value")}

    def feeds(x, past_len, past):
        return {"input_ids": x, "attention_mask": np.ones((1, past_len + x.shape[1]), np.int64), **past}

    prompt = feeds(ids[:, :11], 0, empty)
    names = ["logits"] + [f"present.{i}.{w}" for i in range(2) for w in ("key", "value")]
    first = compiled.run(prompt, names)
    past = {k.replace("present", "past_key_values"): v.copy() for k, v in first.items() if k != "logits"}
    chunk = feeds(ids[:, 11:], 11, past)
    np.testing.assert_array_equal(compiled.run(chunk, ["logits"])["logits"], plain.run(chunk, ["logits"])["logits"])
    for _ in range(2):  # replays of the step the chunk recorded
        np.testing.assert_array_equal(compiled.run(prompt, ["logits"])["logits"], first["logits"])
        np.testing.assert_array_equal(compiled.run(chunk, ["logits"])["logits"], plain.run(chunk, ["logits"])["logits"])
    assert compiled.plan.steps.idle and any(
        isinstance(item, Segment) for step in compiled.plan.steps.idle for item in step.items
    )


@pytest.mark.parametrize("batch", [2, 3])
def test_batched_contiguous_decode_attention_replays_through_cache_growth(batch, recordings):
    """A batch's decode steps on a contiguous cache replay their attention too (one fused call per layer for
    every row), through the cache's growth (4 -> 8 -> 16) and a new state, bit for bit the node-by-node run."""
    model = build_model("gqa", MICRO, seed=13)
    rng = np.random.default_rng(batch)
    prompt, tokens = rng.integers(1, MICRO.vocab_size, (batch, 3)), rng.integers(1, MICRO.vocab_size, (12, batch))
    runs = {}
    for compiled in (False, True):
        session = onnxkv.Session(model, threads=2, compiled_steps=compiled)
        for capacity in (4, 30):
            with session.new_state(cache=CacheConfig("contiguous", initial_capacity=capacity)) as state:
                runs[compiled, capacity] = _steps(session, state, prompt, tokens)
                assert state.length == 15
        if compiled:
            assert "GroupQueryAttention" in compiled_kinds(session)
            (step,) = [s for s in session.plan.steps.idle if s.compiled_nodes == len(session.plan.kernels)]
            assert not step.stale
    for capacity in (4, 30):
        _assert_equal_runs({c: runs[c, capacity] for c in (False, True)})
