"""A failed or cancelled ``State.run`` leaves the state byte-identical, whichever node it stopped after.

For every model family (contiguous and paged states of the builders and the
embedded model, and states of contract-declared bindings: a ``CacheUpdate``
graph and ``onnxkv.zoo.paged`` with and without ``QuantizePagedCache``),
a run is made to fail right after node ``k`` (the real kernel runs, then an
error is raised) and to be cancelled by a token that fires on its ``k``-th
check, for every ``k``.  After each: values (the whole storage of static
caches and declared values), lengths, ``committed_bytes``, page tables, page
formats and reference counts are what they were, the pool audit passes, and
finally the step run uninterrupted gives what an untouched state gives.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from faults import CancelOnCheck, failing_after, node_by_node
from onnx import TensorProto, helper

import onnxkv
from onnxkv import CacheConfig
from onnxkv.cache.page_set import PageSet
from onnxkv.errors import Cancelled, OperatorError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.model.contract import Access, OutputAlias, set_access, set_output_alias, set_persistent_bindings
from onnxkv.zoo import embedded
from onnxkv.zoo.builders import MICRO, build_model
from onnxkv.zoo.paged import PagedConfig, build_paged_model

FAMILIES = ["gqa", "attention", "concat", "tensorscatter", "embedded"]


def snapshot(states) -> list[dict]:
    """Everything a failed run must leave as it was, for each state (and its pool, audited)."""
    out = []
    for st in states:
        snap = {
            "lengths": st.lengths.tolist(),
            "length": st.length,
            "committed": st.committed_bytes,
            "steps": st.steps,
            "values": {k: v.tobytes() for k, v in st.values.items()},
        }
        if st._static and st._caches:  # a static cache's whole storage is what the model reads
            snap["storage"] = {
                k: (c.gather(st._static_capacity) if st.paged else c.buffer).tobytes() for k, c in st._caches.items()
            }
        if st.page_tables is not None:
            t = st.page_tables
            snap["table"] = (t.tobytes(), t.shape, st.lengths.tolist(), st.first_positions.tolist())
        if st.pool is not None:  # reference counts and formats of live ids (the id table may have grown)
            st.pool.audit()
            refs = st.pool.core.refs()
            live = np.flatnonzero(refs)
            snap["pool"] = (
                st.pool.live_pages,
                st.pool.committed_bytes,
                live.tolist(),
                refs[live].tolist(),
                [f[live].tolist() for f in st.pool.formats],
            )
        for name, arr in st.values.items():  # pages QuantizePagedCache converted (none: every page native)
            handle = PageSet.of(arr)
            if handle is not None:
                handle.audit()
                if handle.any_converted:
                    snap[name] = (handle.formats.tobytes(), handle.ptrs.tobytes(), handle.payload_bytes)
        out.append(snap)
    return out


def assert_every_stop_leaves_states_unchanged(session, state, feeds, watched=(), staged=True):
    """Fail ``state.run(feeds)`` after every node and cancel it before every node, and (``staged``: a state
    whose store stages a run until it commits, not declared values written in place) refuse the finished
    run in ``before_commit``; nothing may change."""
    plan = session.plan
    states = [state, *watched]
    before = snapshot(states)
    for k in range(len(plan.nodes)):
        with failing_after(plan, k), pytest.raises(OperatorError, match=f"injected failure after node {k}"):
            state.run(feeds)
        assert snapshot(states) == before, f"failure after node {k} ({plan.nodes[k].op_type}) changed a state"
        token = CancelOnCheck(k)
        with node_by_node(plan), pytest.raises(Cancelled):
            state.run(feeds, cancel=token)
        assert token.checks == k + 1
        assert snapshot(states) == before, f"cancellation before node {k} ({plan.nodes[k].op_type}) changed a state"
    if not staged:
        return
    seen = []

    def refuse(out):  # the outputs are made; the run is not committed yet
        seen.append(sorted(out))
        raise MemoryError("before_commit")

    with pytest.raises(MemoryError, match="before_commit"):
        state.run(feeds, before_commit=refuse)
    assert seen and snapshot(states) == before, "a before_commit that raised left the run committed"


@functools.cache
def family_session(family: str, events: bool = False) -> onnxkv.Session:
    model = embedded.embedded_model_dir() if family == "embedded" else build_model(family, MICRO, seed=7)
    return onnxkv.Session(model, threads=1, events=events)


def steps(session, prompt):
    """Feeds of a prefill of ``prompt`` and of two decode steps (tokens fixed, not sampled)."""
    b = FeedBuilder(
        session.plan.inputs, session.model, prompt, np.full(len(prompt), prompt.shape[1]), 0, thread_cache=False
    )
    first, _ = b.first()
    return [first, b.next(np.arange(3, 3 + len(prompt)), {}), b.next(np.arange(5, 5 + len(prompt)), {})]


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize(
    "family, events", [(f, False) for f in FAMILIES] + [("gqa", True)], ids=FAMILIES + ["gqa-events"]
)
def test_failed_and_cancelled_runs_leave_the_state_byte_identical(family, events, cache):
    session = family_session(family, events)
    prompt = np.random.default_rng(3).integers(1, 90, (2, 5))
    feeds = steps(session, prompt)
    make = functools.partial(
        session.new_state,
        cache=CacheConfig(cache, block_size=4) if cache == "paged" else CacheConfig(cache, initial_capacity=6),
    )
    reference = make()
    want = [reference.run(f) for f in feeds]

    state = make()
    assert_every_stop_leaves_states_unchanged(session, state, feeds[0])  # a first run: nothing held after it
    assert state.committed_bytes == 0 and state.length == 0
    state.run(feeds[0])
    assert state.length == 5  # a static cache too: the positions written, not its capacity
    watched = []
    if cache == "paged":  # a fork and a checkpoint share every page: a failed run must not touch them
        watched = state.fork(1)
        checkpoint = state.checkpoint()
    # the first decode step grows the contiguous caches from 6 positions: the growth is undone too
    assert_every_stop_leaves_states_unchanged(session, state, feeds[1], watched)
    for f, w in zip(feeds[1:], want[1:]):
        got = state.run(f)
        assert got.keys() == w.keys()
        for name in w:
            np.testing.assert_array_equal(got[name], w[name])
    for name, v in reference.values.items():
        np.testing.assert_array_equal(state.values[name], v)
    if family == "tensorscatter":  # the whole static storage: zeros past the written positions, forked or not
        assert snapshot([state])[0]["storage"] == snapshot([reference])[0]["storage"]
    if cache == "paged":
        state.restore(checkpoint)
        assert state.length == 5
        checkpoint.release()
        state.pool.audit()
    for st in (state, reference, *watched):
        st.close()


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_a_static_cache_rewriting_committed_slots_is_restored(cache):
    """TensorScatter writing below the valid length (a rewind) overwrites committed slots: they come back."""
    session = family_session("tensorscatter")
    prompt = np.random.default_rng(4).integers(1, 90, (1, 6))
    state = session.new_state(cache=CacheConfig(cache, block_size=4) if cache == "paged" else CacheConfig(cache))
    state.run(steps(session, prompt)[0])
    cap = MICRO.max_length
    rewind = {
        "input_ids": np.array([[7, 8]]),
        "attention_mask": (np.arange(cap) < 4).astype(np.int64)[None],
        "position_ids": np.array([[2, 3]]),
        "write_indices": np.array([2]),
    }
    assert_every_stop_leaves_states_unchanged(session, state, rewind)
    assert state.length == 6
    state.run(rewind)
    assert state.length == 6 and state.lengths.tolist() == [6]  # the high-water mark stays
    state.close()


def jump(session, to: int, tokens: int = 1) -> dict:
    """Feeds writing ``tokens`` tokens from slot ``to`` of a static cache (the slots before it may be skipped)."""
    cap = session.model.convention.capacity
    return {
        "input_ids": np.arange(9, 9 + tokens)[None],
        "position_ids": np.arange(to, to + tokens)[None],
        "attention_mask": (np.arange(cap) < to + tokens).astype(np.int64)[None],
        "write_indices": np.array([to]),
    }


@pytest.mark.parametrize("origin, length", [("fork", 6), ("load", 6), ("load", 5)])
def test_static_slots_never_written_read_as_zeros(origin, length):
    """A write past a static cache's length leaves the skipped slots zero, also in a page copied for a fork, a
    page a loaded cache did not hold and the rest of a loaded partial page (all from recycled, dirty memory)."""
    session = family_session("tensorscatter")
    feeds = steps(session, np.random.default_rng(8).integers(1, 90, (1, length)))
    state = session.new_state(cache=CacheConfig("paged", block_size=2))
    reference = session.new_state()
    for st in (state, reference):
        st.run(feeds[0])
    if origin == "fork":
        other, keeper = state.fork(2)
        other.run(jump(session, length, tokens=6))  # dirt in its copies of the slots after the prompt
        other.close()  # its pages go back to the pool, dirt included
        to = 9  # block 4: a shared page the run copies into recycled memory
    else:
        saved = state.save_cache()
        (other,) = state.fork(1)
        other.run(jump(session, 0, tokens=14))  # dirt in its copies of slots 0..13
        other.close()  # its pages go back to the pool, dirt included
        state.load_cache(saved)  # pages from recycled memory: the prompt's blocks (the last one partly) saved
        keeper = None
        to = 9  # block 4: a fresh page; slot 5 of the 5-token prompt: the rest of a loaded page
    got = state.run(jump(session, to))
    want = reference.run(jump(session, to))
    assert state.length == to + 1
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    # the paged attention kernel sums in its own order, so later layers' values match to rounding; every slot
    # the reference holds as zero (never written) is exactly zero in the paged state too
    paged, contiguous = snapshot([state])[0]["storage"], snapshot([reference])[0]["storage"]
    assert paged.keys() == contiguous.keys()
    for name in paged:
        a, b = (np.frombuffer(x[name], np.float32) for x in (paged, contiguous))
        np.testing.assert_array_equal(a == 0, b == 0)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for st in (state, keeper, reference):
        if st is not None:
            st.close()


# -- contract-declared bindings --------------------------------------------------------------------------------------

CAP, H, D = 8, 2, 4


def cache_update_model():
    """Two CacheUpdate nodes (per-row positions) on declared persistent caches, read by later nodes."""
    nodes = [
        helper.make_node("CacheUpdate", ["past_k", "new", "pos"], ["present_k"], domain="ai.onnxkv", name="k"),
        helper.make_node("Neg", ["new"], ["new_v"], name="neg"),
        helper.make_node("CacheUpdate", ["past_v", "new_v", "pos"], ["present_v"], domain="ai.onnxkv", name="v"),
        helper.make_node("Mul", ["present_k", "present_v"], ["product"], name="mul"),
        helper.make_node("ReduceSum", ["product"], ["total"], keepdims=0, name="sum"),
    ]
    cache = [2, H, CAP, D]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in ("past_k", "past_v")]
    inputs += [
        helper.make_tensor_value_info("new", TensorProto.FLOAT, [2, H, "S", D]),
        helper.make_tensor_value_info("pos", TensorProto.INT64, [2]),
    ]
    outputs = [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in ("present_k", "present_v")]
    m = helper.make_model(
        helper.make_graph(nodes, "declared", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnxkv", 1)],
    )
    for node in (m.graph.node[0], m.graph.node[2]):
        set_output_alias(node, [OutputAlias(0, 0)])
    for i in (0, 1):
        set_access(m.graph.input[i], Access.READ_WRITE)
    set_persistent_bindings(m.graph, {"past_k": "present_k", "past_v": "present_v"})
    return m


def paged_cache_update_model():
    """PagedCacheUpdate on a declared persistent page tensor [P, H, 2, D], read by a later node."""
    nodes = [
        helper.make_node(
            "PagedCacheUpdate",
            ["past", "table", "new", "pos"],
            ["present"],
            domain="ai.onnxkv",
            name="update",
            block_size=2,
        ),
        helper.make_node("ReduceSum", ["present"], ["total"], keepdims=0, name="sum"),
    ]
    pages = [6, H, 2, D]
    inputs = [
        helper.make_tensor_value_info("past", TensorProto.FLOAT, pages),
        helper.make_tensor_value_info("table", TensorProto.INT64, [2, 3]),
        helper.make_tensor_value_info("new", TensorProto.FLOAT, [2, H, "S", D]),
        helper.make_tensor_value_info("pos", TensorProto.INT64, [2]),
    ]
    outputs = [
        helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
        helper.make_tensor_value_info("present", TensorProto.FLOAT, pages),
    ]
    m = helper.make_model(
        helper.make_graph(nodes, "declared_pages", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnxkv", 1)],
    )
    set_output_alias(m.graph.node[0], [OutputAlias(0, 0)])
    set_access(m.graph.input[0], Access.READ_WRITE)
    set_persistent_bindings(m.graph, {"past": "present"})
    return m


def paged_cache_update_steps():
    table = np.array([[4, 0, 2], [1, 5, 3]])
    return [dict(f, table=table) for f in cache_update_steps()]


def cache_update_steps():
    rng = np.random.default_rng(5)
    new = [rng.standard_normal((2, H, s, D)).astype(np.float32) for s in (3, 1, 2)]
    # the third step rewrites committed positions (row 1 from 2): they must come back after a failure
    return [
        {"new": new[0], "pos": np.array([0, 0])},
        {"new": new[1], "pos": np.array([3, 3])},
        {"new": new[2], "pos": np.array([4, 2])},
    ]


def paged_steps(cfg, quantize):
    rng = np.random.default_rng(6)
    table = rng.permutation(cfg.num_pages)[: 2 * cfg.max_blocks].reshape(2, cfg.max_blocks).astype(np.int32)
    hidden = [rng.standard_normal((2, s, cfg.hidden_size)).astype(np.float32) for s in (9, 1, 1)]
    out, seqlens = [], np.zeros(2, np.int32)
    for h in hidden:
        out.append({"hidden": h, "block_table": table, "seqlens_k": seqlens})
        seqlens = seqlens + h.shape[1]
    if quantize:  # the first decode step converts both rows' full pages, then its attention reads them
        full = table[:, : 9 // cfg.block_size].reshape(-1)
        n = len(full)
        out[1] = dict(out[1], quantize_blocks=full)
        for i in range(cfg.num_layers):
            for plane in ("key", "value"):
                out[1][f"{plane}_scale.{i}"] = np.full((n, cfg.num_kv_heads), 0.05, np.float32)
                out[1][f"{plane}_zero_point.{i}"] = np.zeros((n, cfg.num_kv_heads), np.int8)
    return out


@pytest.mark.parametrize("model", ["cache-update", "paged-cache-update", "paged", "paged-quantize"])
@pytest.mark.parametrize("events", [False, True])
def test_declared_bindings_are_restored_after_every_node(model, events):
    if model == "cache-update":
        session = onnxkv.Session(cache_update_model(), threads=1, events=events)
        feeds = cache_update_steps()
    elif model == "paged-cache-update":
        session = onnxkv.Session(paged_cache_update_model(), threads=1, events=events)
        feeds = paged_cache_update_steps()
    else:
        quantize = model == "paged-quantize"
        cfg = PagedConfig(
            num_layers=2, num_pages=16, **({"key_format": "int8", "value_format": "int8"} if quantize else {})
        )
        session = onnxkv.Session(build_paged_model(cfg, seed=2), threads=1, events=events)
        feeds = paged_steps(cfg, quantize)
    reference = session.new_state()
    want = [reference.run(f) for f in feeds]

    state = session.new_state()
    assert_every_stop_leaves_states_unchanged(session, state, feeds[0], staged=False)
    assert state.committed_bytes == 0
    state.run(feeds[0])
    storage = dict(state.values)  # views of the declared values' storage
    for f, w in zip(feeds[1:], want[1:]):
        assert_every_stop_leaves_states_unchanged(session, state, f, staged=False)
        got = state.run(f)
        for name in w:
            np.testing.assert_array_equal(got[name], w[name])
    assert all(np.shares_memory(state.values[name], arr) for name, arr in storage.items())  # written in place
    for name, v in reference.values.items():
        assert state.values[name].tobytes() == v.tobytes()
    if model == "paged-quantize":
        assert all(PageSet.of(arr).any_converted for arr in storage.values())
    state.close()
    reference.close()
