"""State.run with ``segments``: rows of different lengths and token counts of one paged state in one run,
their tokens on one axis (how the engine runs decode rows and prompt chunks together).

Every row's logits and cache contents equal those of the row run alone, bit for bit, on every builder
architecture of tests/data/arch (windows, softcaps, int4 weights) and on opset-23 Attention graphs; bad
segments, and models that cannot take them, raise InputError with the state unchanged; a run that does not
fit the pool changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxkv
from onnxkv.errors import InputError, OutOfMemory
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import MICRO, build_model

DATA = Path(__file__).parents[1] / "data"
FOLDERS = sorted(str(p.relative_to(DATA)) for p in DATA.glob("arch/*/genai_*")) + ["genai_tiny_llama"]
PAGED = onnxkv.CacheConfig("paged", block_size=4)
#: In-memory models beside the folders: the builder's opset-23 Attention graph (its mask built in the graph).
ZOO = {"zoo:attention": lambda: build_model("attention", MICRO, seed=5)}


def _session(name: str) -> onnxkv.Session:
    return onnxkv.Session(ZOO[name]() if name in ZOO else str(DATA / name), threads=1)


def _ids(rng, session, n: int) -> np.ndarray:
    return rng.integers(1, min(session.token_limit or 100, 100), n)


def _prompt(session, state, ids: np.ndarray) -> FeedBuilder:
    """``state`` (empty) after one run of the prompt ``ids``; returns the run's builder."""
    b = FeedBuilder(session.plan.inputs, session.model, ids[None], np.array([ids.size]), 0, thread_cache=False)
    feeds, _ = b.first()
    state.run(feeds, [])
    return b


def _flat(session, tokens: np.ndarray, positions: np.ndarray) -> dict:
    io = session.model.io
    feeds = {io.input_ids: tokens[None], io.attention_mask: np.ones((1, tokens.size), np.int64)}
    if io.position_ids:
        feeds[io.position_ids] = positions[None]
    return feeds


def _batch(session, rng, lengths: list[int], cache=PAGED) -> tuple[onnxkv.State, FeedBuilder]:
    """A state of ``cache`` with rows holding prompts of ``lengths`` (0: an empty row)."""
    batch = session.new_state(cache=cache).sibling()
    builder = None
    for n in lengths:
        if n:
            st = batch.sibling()
            builder = _prompt(session, st, _ids(rng, session, n))
            batch.append_rows(st)
        else:
            batch.append_empty_rows(1)
    return batch, builder


@pytest.mark.parametrize(
    "counts",
    [[1, 6, 0, 11, 1], [5, 1, 5, 5, 0], [1, 13, 0, 13, 1]],
    # each longer segment a call of its own; three rows of 5 in one; two of 13 (the prefill unit's tiles)
    ids=["counts-apart", "equal-counts", "long-equal"],
)
@pytest.mark.parametrize(
    ("folder", "stored"),
    [(f, None) for f in FOLDERS + list(ZOO)]
    + [("genai_tiny_llama", f) for f in ("fp16", "bf16", "int8")]
    + [("zoo:attention", "int8")],  # float16 and bfloat16 caches are GroupQueryAttention's alone
)
def test_each_row_of_a_run_of_segments_is_the_row_run_alone(folder, stored, counts):
    session = _session(folder)
    assert session.takes_segments
    rng = np.random.default_rng(len(folder))
    lengths = [9, 14, 3, 0, 6]
    counts = np.array(counts)
    batch, builder = _batch(session, rng, lengths, onnxkv.CacheConfig("paged", block_size=4, kv_format=stored))
    alone = batch.fork(1)[0]
    tokens = _ids(rng, session, int(counts.sum()))
    positions = np.concatenate([np.arange(n, n + c) for n, c in zip(lengths, counts)])
    ends = (np.cumsum(counts) - 1)[counts > 0]
    name = session.model.io.logits
    out = batch.run(_flat(session, tokens, positions), [name], logits_at=ends[None], segments=counts)[name]
    assert out.shape[:2] == (1, ends.size)
    assert batch.lengths.tolist() == [n + c for n, c in zip(lengths, counts)]
    got = batch.values
    first = np.cumsum(counts) - counts
    for k, r in enumerate(np.flatnonzero(counts).tolist()):
        n, a = int(counts[r]), int(first[r])
        if lengths[r]:
            (own,) = alone.fork(1)
            own.keep_rows([r])
            ref = own.run(builder.ragged(tokens[None, a : a + n], np.array([lengths[r]])), [name], logits_at=[n - 1])
        else:
            own = batch.sibling()
            b = FeedBuilder(session.plan.inputs, session.model, tokens[None, a : a + n], np.array([n]), 0, False)
            ref = own.run(b.first()[0], [name], logits_at=[n - 1])
        np.testing.assert_array_equal(out[0, k], ref[name][0, -1])
        held = own.values
        for plane, values in got.items():
            np.testing.assert_array_equal(values[r, :, : lengths[r] + n], held[plane][0, :, : lengths[r] + n])
    batch.pool.audit()


@pytest.fixture(scope="module")
def tiny():
    return onnxkv.Session(str(DATA / "genai_tiny_llama"), threads=1)


@pytest.mark.parametrize(
    ("segments", "match"),
    [
        (np.array([1, 1]), "must be 3 integer token counts"),
        (np.array([1.0, 1.0, 1.0]), "must be 3 integer token counts"),
        (np.array([2, -1, 2]), "counts >= 0 summing to the 3"),
        (np.array([1, 1, 2]), "counts >= 0 summing to the 3"),
        (np.array([0, 0, 2**62]), "counts >= 0 summing to the 3"),
        (np.array([2**63 - 1, 2**63 - 1, 5], np.uint64), "counts >= 0 summing to the 3"),
    ],
)
def test_bad_segments_leave_the_state_as_it_was(tiny, segments, match):
    rng = np.random.default_rng(1)
    batch, _ = _batch(tiny, rng, [5, 7, 0])
    before = (batch.lengths.tolist(), batch.page_tables.tolist(), batch.pool.live_pages)
    with pytest.raises(InputError, match=match):
        batch.run(_flat(tiny, _ids(rng, tiny, 3), np.arange(3)), [], segments=segments)
    assert (batch.lengths.tolist(), batch.page_tables.tolist(), batch.pool.live_pages) == before
    with pytest.raises(InputError, match=r"fed as \[1, T\]"):
        feeds = _flat(tiny, _ids(rng, tiny, 4), np.arange(4))
        feeds = {k: v.reshape(2, 2) for k, v in feeds.items()}
        batch.run(feeds, [], segments=np.array([2, 2, 0]))
    assert (batch.lengths.tolist(), batch.page_tables.tolist(), batch.pool.live_pages) == before


def _attention_graph(seed: int = 8) -> onnx.ModelProto:
    return build_model("attention", MICRO, seed=seed)


def _with_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """``model`` with its value ``name`` also a graph output (through an Identity)."""
    model.graph.node.append(onnx.helper.make_node("Identity", [name], [name + "/seen"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info(name + "/seen", onnx.TensorProto.BOOL, None))
    return model


def test_models_whose_attention_does_not_take_segments_refuse_them(tiny):
    gqa = build_model("gqa", MICRO, seed=8)
    assert onnxkv.Session(gqa, threads=1).takes_segments
    positions = onnx.helper.make_node("Range", ["zero", "zero", "one"], ["unused"])  # any operator not token-wise
    gqa.graph.initializer.extend(
        onnx.numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", 0), ("one", 1))
    )
    gqa.graph.node.append(positions)
    assert not onnxkv.Session(gqa, threads=1).takes_segments
    # an Attention graph: its mask-building nodes (Range, LessOrEqual, And) may reach masks only
    assert onnxkv.Session(_attention_graph(), threads=1).takes_segments
    mask = next(n for n in _attention_graph().graph.node if n.op_type == "LessOrEqual").output[0]
    assert not onnxkv.Session(_with_output(_attention_graph(), mask), threads=1).takes_segments
    scores = _attention_graph()  # a node that returns its scores cannot take segments
    node = next(n for n in scores.graph.node if n.op_type == "Attention")
    node.output.append("scores")
    scores.graph.output.append(onnx.helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, None))
    attention = onnxkv.Session(scores, threads=1)
    assert not attention.takes_segments
    state = attention.new_state(cache=PAGED)
    with pytest.raises(InputError, match="takes_segments"):
        state.run(_flat(attention, np.array([3, 4]), np.arange(2)), [], segments=np.array([2]))
    contiguous = tiny.new_state()
    with pytest.raises(InputError, match="segments need a paged state"):
        contiguous.run(_flat(tiny, np.array([3, 4]), np.arange(2)), [], segments=np.array([2]))
    with pytest.raises(InputError, match="that holds rows"):
        tiny.new_state(cache=PAGED).run(_flat(tiny, np.array([3, 4]), np.arange(2)), [], segments=np.array([2]))


def test_an_attention_mask_other_than_causal_over_the_run_is_refused_with_nothing_written():
    """The graph's mask of a run of segments must be causal attention over its tokens (what an attention
    mask of ones gives): a padded one is refused by the first Attention node, before any write."""
    session = _session("zoo:attention")
    rng = np.random.default_rng(4)
    batch, _ = _batch(session, rng, [5, 0])
    before = (batch.lengths.tolist(), batch.page_tables.tolist(), batch.pool.live_pages, batch.values)
    feeds = _flat(session, _ids(rng, session, 4), np.r_[5, np.arange(3)])
    feeds[session.model.io.attention_mask][0, 1] = 0
    with pytest.raises(onnxkv.SegmentsRefused, match=r"Attention node .*causal attention over its 4 tokens"):
        batch.run(feeds, [], segments=np.array([1, 3]))
    assert (batch.lengths.tolist(), batch.page_tables.tolist(), batch.pool.live_pages) == before[:3]
    for name, values in batch.values.items():
        np.testing.assert_array_equal(values, before[3][name])
    feeds[session.model.io.attention_mask][0, 1] = 1
    batch.run(feeds, [], segments=np.array([1, 3]))
    assert batch.lengths.tolist() == [6, 3]
    batch.pool.audit()


def test_a_run_of_segments_that_does_not_fit_the_pool_changes_nothing(tiny):
    rng = np.random.default_rng(2)
    state = tiny.new_state(cache=onnxkv.CacheConfig("paged", block_size=4, max_pages=6))
    st = state.sibling()
    _prompt(tiny, st, _ids(rng, tiny, 8))
    state.append_rows(st)
    state.append_empty_rows(1)
    before = (state.lengths.tolist(), state.page_tables.tolist(), state.pool.live_pages, state.values)
    with pytest.raises(OutOfMemory):  # 2 pages held, 1 + 4 more needed: over 6
        state.run(_flat(tiny, _ids(rng, tiny, 17), np.r_[8, np.arange(16)]), [], segments=np.array([1, 16]))
    assert (state.lengths.tolist(), state.page_tables.tolist(), state.pool.live_pages) == before[:3]
    for name, values in state.values.items():
        np.testing.assert_array_equal(values, before[3][name])
    state.run(_flat(tiny, _ids(rng, tiny, 13), np.r_[8, np.arange(12)]), [], segments=np.array([1, 12]))
    assert state.lengths.tolist() == [9, 12]
    state.pool.audit()


def test_empty_rows_are_checked(tiny):
    state = tiny.new_state(cache=PAGED)
    for n in (0, -1, True, 1.0, 2**40):
        with pytest.raises(InputError, match="append_empty_rows: n must be an int"):
            state.append_empty_rows(n)
    state.append_empty_rows(2)
    assert state.batch == 2 and state.lengths.tolist() == [0, 0] and state.pool.live_pages == 0


def test_a_compiled_step_never_replays_a_run_of_segments(tiny, monkeypatch):
    rng = np.random.default_rng(3)
    state = tiny.new_state(cache=PAGED)
    builder = _prompt(tiny, state, _ids(rng, tiny, 6))
    for n in range(6, 9):  # decode steps of this shape: the plan records and replays a compiled step
        state.run(builder.ragged(_ids(rng, tiny, 1), np.array([n])), None)
    steps = tiny.plan.steps
    assert steps is not None

    def refuse(*args, **kwargs):
        raise AssertionError("a compiled step replayed a run of segments")

    monkeypatch.setattr(steps, "run", refuse)
    state.append_empty_rows(1)
    out = state.run(_flat(tiny, _ids(rng, tiny, 1), np.array([9])), None, segments=np.array([1, 0]))
    assert tiny.model.io.logits in out and state.lengths.tolist() == [10, 0]


@pytest.mark.parametrize("graph", ["attention", "gqa"])
def test_a_prompt_reads_native_pages_alike_whatever_other_pages_the_pool_converted(graph):
    """With int8 pages, the pool's planes list per-page formats once any page is converted, and the kernel
    then took another path through native pages too: a 12-token prompt gave other bits (1.4e-6) on a pool
    where an earlier state's full pages were quantized, and a run of segments differed from its row run
    alone after it.  A call whose pages are all native now reads them as an unconverted pool does."""
    session = onnxkv.Session(build_model(graph, MICRO, seed=5), threads=1)
    name = session.model.io.logits
    cache = onnxkv.CacheConfig("paged", block_size=4, kv_format="int8")
    tokens = np.random.default_rng(0).integers(1, 97, 12)

    def prompt(state):
        b = FeedBuilder(session.plan.inputs, session.model, tokens[None], np.array([tokens.size]), 0, False)
        return state.run(b.first()[0], [name])[name]

    first = session.new_state(cache=cache)
    fresh = prompt(first)
    assert any(first.pool.payloads.converted)  # its full pages were quantized after the run
    np.testing.assert_array_equal(prompt(first.sibling()), fresh)
