"""The compiled generation loop (onnxkv.plan.step_loop, State.decode_steps): greedy decode steps run in C
leave the tokens, logits and caches of the same steps run one by one; anything else runs nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnxkv
import onnxkv.plan.step_loop as step_loop
from onnxkv import CacheConfig
from onnxkv.errors import InputError, StateError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.step_loop import DecodeNames
from onnxkv.zoo import embedded
from onnxkv.zoo.attention23 import build_attention_model
from onnxkv.zoo.builders import MICRO, build_model

DATA = Path(__file__).parents[1] / "data" / "arch"


def _start(session, state, prompt, warm):
    """Prefill ``prompt`` and feed ``warm`` greedy tokens one by one; return (builder, feeds of the next token,
    tokens so far)."""
    name = session.model.io.logits
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array([prompt.shape[1]]), 0, thread_cache=False)
    feeds, _ = b.first()
    out = state.run(feeds, [name])
    chosen = []
    for _ in range(warm + 1):
        tok = np.argmax(out[name][:, -1], axis=-1).astype(np.int64)
        chosen.append(int(tok[0]))
        feeds = b.next(tok, out)
        if len(chosen) <= warm:
            out = state.run(feeds, [name])
    return b, feeds, chosen


def _one_by_one(session, state, b, feeds, count, eos=()):
    name = session.model.io.logits
    tokens = []
    for _ in range(count):
        out = state.run(feeds, [name])
        tok = np.argmax(out[name][:, -1], axis=-1).astype(np.int64)
        tokens.append(int(tok[0]))
        if tokens[-1] in eos:
            break
        feeds = b.next(tok, out)
    return tokens, feeds


def _io(session):
    io = session.model.io
    return {"names": DecodeNames(io.input_ids, io.attention_mask, io.logits, io.position_ids)}


def _models():
    return {
        "embedded": str(embedded.embedded_model_dir()),
        "gqa": build_model("gqa", MICRO, seed=21),
        # opset-23 Attention graphs: the loop writes the masks of their ExportMask node (bool, or a float bias)
        "attention": build_model("attention", MICRO, seed=22),
        "attention_bias": build_attention_model(MICRO, None, 23, mask_bias=-1e4),
        "concat": build_model("concat", MICRO, seed=22),  # past -> Concat -> present, masks from an ExportMask
        # torch.onnx.export files: the token embedding, then the ExportMask node, then the rest; windows of 8
        "mistral_torch": str(DATA / "mistral" / "torch"),
        "gemma2_torch": str(DATA / "gemma2" / "torch"),  # two masks: full and windowed layers
    }


@pytest.mark.parametrize(
    "which", ["embedded", "gqa", "attention", "attention_bias", "concat", "mistral_torch", "gemma2_torch"]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_steps_in_one_call_equal_the_steps_one_by_one(which, threads):
    model = _models()[which]
    prompt = np.array([[1, 7, 9, 4, 12, 3]])
    count = 20
    ref = onnxkv.Session(model, threads=threads, compiled_steps=False)
    sess = onnxkv.Session(model, threads=threads)
    with ref.new_state() as rs, sess.new_state() as st:
        rb, rfeeds, rchosen = _start(ref, rs, prompt, 2)
        want, rfeeds = _one_by_one(ref, rs, rb, rfeeds, count)
        b, feeds, chosen = _start(sess, st, prompt, 2)
        assert chosen == rchosen
        before = st.steps
        run = st.decode_steps(feeds, count, **_io(sess))
        assert run is not None and run.steps == count and not run.refused
        assert run.tokens.tolist() == want
        assert run.seconds.shape == (count,) and (run.seconds > 0).all()
        assert st.steps == before + count and st.length == rs.length
        for name, value in rs.values.items():
            np.testing.assert_array_equal(st.values[name], value)
        # the next step, through State.run, continues where the loop left off
        b.next(run.tokens[None, :-1], None)
        feeds = b.next(run.tokens[-1:], None)
        name = sess.model.io.logits
        np.testing.assert_array_equal(st.run(feeds, [name])[name], rs.run(rfeeds, [name])[name])


@pytest.mark.parametrize("block_size", [1, 3, 4, 16, 128])
def test_paged_decode_steps_run_to_the_end_of_a_page_and_equal_the_steps_one_by_one(block_size):
    """On a paged cache a call runs at most to the end of the page holding its 64th position (the pages are
    staged before the loop); no page is held past the length."""
    model = _models()["embedded"]
    prompt = np.array([[1, 7, 9, 4, 12, 3]])
    cache = CacheConfig("paged", block_size=block_size)
    ref = onnxkv.Session(model, threads=1, compiled_steps=False)
    sess = onnxkv.Session(model, threads=1)
    with ref.new_state(cache=cache) as rs, sess.new_state(cache=cache) as st:
        rb, rfeeds, _ = _start(ref, rs, prompt, 2)
        want, _ = _one_by_one(ref, rs, rb, rfeeds, 90)
        b, feeds, _ = _start(sess, st, prompt, 2)
        got = []
        while len(got) < 90:
            length = st.length
            run = st.decode_steps(feeds, 90 - len(got), **_io(sess))
            end = ((length + step_loop.PAGED_LOOP_POSITIONS - 1) // block_size + 1) * block_size
            assert run is not None and run.steps == min(end - length, 90 - len(got))
            assert st.length == length + run.steps
            got += run.tokens.tolist()
            pages = st._store.committed_table("tables")
            assert int((pages >= 0).sum()) == -(-st.length // block_size)  # every page holds a token
            b.next(run.tokens[None, :-1], None)
            feeds = b.next(run.tokens[-1:], None)
        assert got == want
        for name, value in rs.values.items():
            np.testing.assert_array_equal(st.values[name], value)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_paged_loop_stopped_by_an_end_of_sequence_id_holds_no_page_past_it(block_size):
    model = _models()["embedded"]
    prompt = np.array([[1, 7, 9, 4]])
    cache = CacheConfig("paged", block_size=block_size)
    sess = onnxkv.Session(model, threads=1)
    with sess.new_state(cache=cache) as st:
        b, feeds, _ = _start(sess, st, prompt, 2)
        free = st.fork()[0]
        free_run = free.decode_steps(feeds, 30, **_io(sess))
        free.close()
        eos = [free_run.tokens[9]]
        stop = free_run.tokens.tolist().index(eos[0]) + 1
        run = st.decode_steps(feeds, 30, eos=eos, **_io(sess))
        assert run.tokens.tolist() == free_run.tokens[:stop].tolist() and st.length == 6 + stop
        pages = st._store.committed_table("tables")
        assert int((pages >= 0).sum()) == -(-st.length // block_size)
        st._store.pool.audit()


@pytest.mark.parametrize("which", ["embedded", "concat", "mistral_torch"])
def test_paged_decode_steps_copy_a_shared_page_before_writing_it(which):
    """A fork shares the pages: the loop's first write into the shared last page copies it for this state,
    and the other state's pages keep their bytes (a GroupQueryAttention step's fused calls, or an export's
    page-row and masked calls)."""
    model = _models()[which]
    sess = onnxkv.Session(model, threads=1)
    with sess.new_state(cache=CacheConfig("paged", block_size=16)) as st:
        b, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4, 12]]), 2)
        st.run(feeds)  # a recorded decode step
        feeds = b.next(np.array([5]), None)
        (other,) = st.fork()
        kept = {n: v.copy() for n, v in other.values.items()}
        run = st.decode_steps(feeds, 6, **_io(sess))
        assert run is not None and run.steps == 6
        assert st.length == other.length + 6
        for n, v in other.values.items():
            np.testing.assert_array_equal(v, kept[n])
            np.testing.assert_array_equal(st.values[n][:, :, : other.length], v)
        other.close()


def test_the_loop_stops_after_an_end_of_sequence_id_and_where_the_cache_is_full():
    model = _models()["embedded"]
    prompt = np.array([[1, 7, 9, 4]])
    ref = onnxkv.Session(model, threads=1, compiled_steps=False)
    sess = onnxkv.Session(model, threads=1)
    with ref.new_state() as rs:
        rb, rfeeds, _ = _start(ref, rs, prompt, 1)
        free, _ = _one_by_one(ref, rs, rb, rfeeds, 12)
    eos = [free[6]]
    stop = free.index(free[6]) + 1
    with sess.new_state() as st:
        _, feeds, _ = _start(sess, st, prompt, 1)
        run = st.decode_steps(feeds, 12, eos=eos, **_io(sess))
        assert run.tokens.tolist() == free[:stop] and st.length == 4 + 1 + stop
    with sess.new_state(cache=CacheConfig("contiguous", initial_capacity=10)) as st:
        # a step recorded with these caches (the one recorded above has other capacities: it fails its check)
        _, feeds, _ = _start(sess, st, prompt, 2)  # 6 positions cached, room for 4
        run = st.decode_steps(feeds, 12, **_io(sess))
        assert run.tokens.tolist() == free[1:5] and st.length == 10
        assert st.decode_steps(feeds, 12, **_io(sess)) is None  # full: State.run grows it


def test_nothing_runs_where_the_loop_cannot_replay_the_step():
    model = _models()["embedded"]
    prompt = np.array([[1, 7, 9, 4]])
    sess = onnxkv.Session(model, threads=1)
    with sess.new_state() as st:
        _, feeds, _ = _start(sess, st, prompt, 0)  # the first decode step: none recorded yet
        assert st.decode_steps(feeds, 5, **_io(sess)) is None and st.length == 4 and st.steps == 1
    with sess.new_state(cache=CacheConfig("paged", block_size=4, kv_format="int8")) as st:  # a format selector
        _, feeds, _ = _start(sess, st, prompt, 3)
        length = st.length
        assert st.decode_steps(feeds, 5, **_io(sess)) is None and st.length == length
    logged = onnxkv.Session(model, threads=1, events=True)
    with logged.new_state() as st:
        _, feeds, _ = _start(logged, st, prompt, 3)
        assert st.decode_steps(feeds, 5, **_io(logged)) is None and st.length == 7
    static = onnxkv.Session(build_model("tensorscatter", MICRO, seed=22), threads=1)  # a static cache's writes
    with static.new_state() as st:
        _, feeds, _ = _start(static, st, prompt, 3)
        assert st.decode_steps(feeds, 5, **_io(static)) is None


@pytest.mark.parametrize("which", ["embedded", "mistral_torch"])
def test_a_token_id_outside_the_vocabulary_is_refused_as_state_run_refuses_it(which):
    """A first token id past the vocabulary, or negative (which the loop's embedding Gather would have taken
    from the end of the table: a fuzzing helper found four steps committed for -1), raises as State.run does,
    with nothing run."""
    sess = onnxkv.Session(_models()[which], threads=1)
    with sess.new_state() as st:
        b, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4]]), 3)
        values = {n: v.copy() for n, v in st.values.items()}
        for bad in (sess.token_limit + 5, -1, -sess.token_limit):
            feeds[sess.model.io.input_ids] = np.array([[bad]], np.int64)
            with pytest.raises(InputError, match=f"State.decode_steps: input 'input_ids' holds token ids from {bad}"):
                st.decode_steps(feeds, 5, **_io(sess))
            with pytest.raises(InputError, match="token ids"):
                st.run(feeds)
            assert st.length == 7 and st.steps == 4
            for n, v in values.items():
                np.testing.assert_array_equal(st.values[n], v)


def test_a_failed_loop_leaves_the_state_as_it_was(monkeypatch):
    model = _models()["embedded"]
    prompt = np.array([[1, 7, 9, 4]])
    ref = onnxkv.Session(model, threads=1, compiled_steps=False)
    sess = onnxkv.Session(model, threads=1)
    real = step_loop.decode_steps

    def fails(*args, **kwargs):
        real(*args, **kwargs)  # the steps write their cache rows, then a call runs out of memory
        raise MemoryError("decode_steps: call 3 of step 4 could not allocate its workspace")

    with ref.new_state() as rs, sess.new_state() as st:
        rb, rfeeds, _ = _start(ref, rs, prompt, 2)
        want, _ = _one_by_one(ref, rs, rb, rfeeds, 6)
        b, feeds, _ = _start(sess, st, prompt, 2)
        monkeypatch.setattr(step_loop, "decode_steps", fails)
        with pytest.raises(MemoryError, match="step 4"):
            st.decode_steps(feeds, 6, **_io(sess))
        assert st.length == 6 and st.steps == 3
        # a second state whose only run made its caches (the prefill) replays the step the first recorded
        with sess.new_state() as fresh:
            _, ffeeds, _ = _start(sess, fresh, prompt, 0)
            with pytest.raises(MemoryError, match="step 4"):
                fresh.decode_steps(ffeeds, 6, **_io(sess))
            assert fresh.length == 4 and fresh.steps == 1 and len(fresh.values) == len(st.values)
        monkeypatch.setattr(step_loop, "decode_steps", real)
        got, _ = _one_by_one(sess, st, b, feeds, 6)
        assert got == want


def _padded_start(session, state, prompt, lengths, warm):
    """Prefill a right-padded batch (rows of ``lengths`` tokens) and feed ``warm`` greedy steps one by one;
    return (builder, feeds of the next step)."""
    name = session.model.io.logits
    b = FeedBuilder(session.plan.inputs, session.model, prompt, np.array(lengths), 0, thread_cache=False)
    feeds, read = b.first()
    out = state.run(feeds, [name], logits_at=read)
    for step in range(warm + 1):
        tok = np.argmax(out[name][:, -1], axis=-1).astype(np.int64)
        feeds = b.next(tok, out)
        if step < warm:
            out = state.run(feeds, [name])
    return b, feeds


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_a_padded_batch_loops_over_its_padding_and_a_failure_restores_every_byte(monkeypatch, cache):
    """Rows of a right-padded batch (GroupQueryAttention) at their own lengths: on contiguous caches they
    write over their padding, below the caches' committed length, then past the longest row; on pages
    each row holds its own tokens only.  The loop's tokens and caches equal the steps one by one, and a
    loop that fails after its steps wrote leaves every cache byte and length as it was."""
    model = _models()["gqa"]
    prompt = np.random.default_rng(8).integers(1, MICRO.vocab_size, (3, 7))
    lengths = [7, 3, 5]
    ref = onnxkv.Session(model, threads=2, compiled_steps=False)
    sess = onnxkv.Session(model, threads=2)
    name = sess.model.io.logits
    real = step_loop.decode_steps

    def fails(*args, **kwargs):
        real(*args, **kwargs)
        raise MemoryError("decode_steps: call 3 of step 4 could not allocate its workspace")

    with ref.new_state(cache=CacheConfig(cache)) as rs, sess.new_state(cache=CacheConfig(cache)) as st:
        rb, rfeeds = _padded_start(ref, rs, prompt, lengths, 2)
        want = []
        for _ in range(8):
            out = rs.run(rfeeds, [name])
            want.append(np.argmax(out[name][:, -1], axis=-1).astype(np.int64))
            rfeeds = rb.next(want[-1], out)
        b, feeds = _padded_start(sess, st, prompt, lengths, 2)
        before = {n: v.copy() for n, v in st.values.items()}
        rows = st.lengths.copy()
        monkeypatch.setattr(step_loop, "decode_steps", fails)
        with pytest.raises(MemoryError, match="step 4"):
            st.decode_steps(feeds, 8, **_io(sess))
        np.testing.assert_array_equal(st.lengths, rows)
        for n, v in before.items():
            np.testing.assert_array_equal(st.values[n], v, err_msg=n)
        monkeypatch.setattr(step_loop, "decode_steps", real)
        run = st.decode_steps(feeds, 8, **_io(sess))
        assert run is not None and run.steps == 8
        np.testing.assert_array_equal(run.tokens, np.stack(want))
        np.testing.assert_array_equal(st.lengths, rs.lengths)
        for n, v in rs.values.items():
            np.testing.assert_array_equal(st.values[n], v, err_msg=n)


def test_bad_arguments_are_refused():
    sess = onnxkv.Session(_models()["embedded"], threads=1)
    with sess.new_state() as st:
        _, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4]]), 2)
        for count in (0, -1, 2.5, True):
            with pytest.raises(InputError, match=f"count must be an int >= 1, got {count!r}"):
                st.decode_steps(feeds, count, **_io(sess))
        past = sess.bindings[0].past
        with pytest.raises(StateError, match="bound to the state's caches"):
            st.decode_steps({**feeds, past: np.zeros(1)}, 3, **_io(sess))
    st.close()
    with pytest.raises(StateError, match="closed"):
        st.decode_steps(feeds, 3, **_io(sess))


def test_draws_that_do_not_fit_are_refused():
    from onnxkv.plan.step_loop import Draws

    sess = onnxkv.Session(_models()["embedded"], threads=1)
    with sess.new_state() as st:
        _, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4]]), 2)
        for uniforms in (np.full(2, 0.5), np.full(5, 0.5, np.float32), [0.5] * 5):
            with pytest.raises(InputError, match="draws.uniforms must be float64"):
                st.decode_steps(feeds, 5, draws=Draws(1.0, 0, 1.0, uniforms), **_io(sess))
        for bad, at in ((np.full(5, 1.5), 0), (np.array([0.5] * 4 + [1.0]), 4), (np.full(5, np.nan), 0),
                        (np.array([0.5, -0.1, 0.5, 0.5, 0.5]), 1)):  # fmt: skip
            with pytest.raises(InputError, match=rf"draws.uniforms must be numbers in \[0, 1\), got uniforms\[{at}\]"):
                st.decode_steps(feeds, 5, draws=Draws(1.0, 0, 1.0, bad), **_io(sess))
        with pytest.raises(InputError, match="draws must be a Draws or None, got tuple"):
            st.decode_steps(feeds, 5, draws=(1.0, 0, 1.0, np.full(5, 0.5)), **_io(sess))
        u = np.full(5, 0.5)
        for draws, match in (
            (Draws(0.0, 0, 1.0, u), "draws.temperature must be a finite number > 0, got 0.0"),
            (Draws(float("nan"), 0, 1.0, u), "draws.temperature"),
            (Draws(1.0, -1, 1.0, u), "draws.top_k must be an int >= 0"),
            (Draws(1.0, 2.5, 1.0, u), "draws.top_k"),
            (Draws(1.0, 0, 0.0, u), r"draws.top_p must be a number in \(0, 1\], got 0.0"),
        ):
            with pytest.raises(InputError, match=match):
                st.decode_steps(feeds, 5, draws=draws, **_io(sess))
        assert st.length == 6


def test_a_top_k_beyond_the_vocabulary_keeps_every_id():
    """top_k of 2**63 (past int64) draws as top_k 0 (every id) does; it used to raise OverflowError."""
    from onnxkv.plan.step_loop import Draws

    sess = onnxkv.Session(_models()["embedded"], threads=1)
    runs = {}
    for k in (0, 2**63):
        with sess.new_state() as st:
            _, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4]]), 2)
            draws = Draws(1.0, k, 1.0, np.random.default_rng(3).random(5))
            runs[k] = st.decode_steps(feeds, 5, draws=draws, **_io(sess)).tokens.tolist()
    assert runs[0] == runs[2**63]


def test_strided_uniforms_draw_as_contiguous_ones():
    """Uniforms given as a strided float64 view passed the checks and then made the kernel raise NumPy's
    ValueError (not C-contiguous); they draw as the same numbers contiguous do (found by a fuzzing helper)."""
    from onnxkv.plan.step_loop import Draws

    sess = onnxkv.Session(_models()["embedded"], threads=1)
    u = np.random.default_rng(5).random(10)
    runs = []
    for uniforms in (u[::2], np.ascontiguousarray(u[::2])):
        with sess.new_state() as st:
            _, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4]]), 2)
            runs.append(st.decode_steps(feeds, 5, draws=Draws(1.0, 0, 1.0, uniforms), **_io(sess)).tokens.tolist())
    assert runs[0] == runs[1] and len(runs[0]) == 5


def test_names_and_eos_that_do_not_fit_are_refused():
    sess = onnxkv.Session(_models()["embedded"], threads=1)
    io = sess.model.io
    with sess.new_state() as st:
        _, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4]]), 2)
        for names, match in (
            (None, "names must be a DecodeNames, got None"),
            (DecodeNames("nope", io.attention_mask, io.logits), r"names.token 'nope' is not a value"),
            (DecodeNames(io.input_ids, io.attention_mask, "scores"), r"names.logits 'scores'"),
            (DecodeNames(io.input_ids, io.attention_mask, io.logits, 3), r"names.position 3"),
        ):
            with pytest.raises(InputError, match=match):
                st.decode_steps(feeds, 3, names=names)
        # a 0-d array, None, a row that is a 0-d array, a generator (a check would use it up), mixed rows
        hostile = (np.array(5), None, [np.array(3)], (t for t in [3]), [1, [2]], np.zeros((1, 1, 1), np.int64))
        for eos in ([2**63], "ab", [1.0], [True], [-1], *hostile):
            with pytest.raises(InputError, match="eos must be token ids"):
                st.decode_steps(feeds, 3, eos=eos, **_io(sess))
        assert st.length == 6


@pytest.mark.parametrize("which", ["attention", "attention_bias", "concat", "mistral_torch", "gemma2_torch"])
@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.9, "top_k": 20, "seed": 4}])
@pytest.mark.parametrize("padded", [False, True], ids=["one-row", "left-padded"])
def test_attention_graphs_generate_in_the_loop_the_tokens_of_steps_one_by_one(which, sampling, padded, monkeypatch):
    """The decode step of an opset-23 Attention graph, a Concat export or a torch export holds an ExportMask
    node (Python) before the segment of the other nodes (a torch export: and the token embedding's segment
    before it); the loop writes the node's masks itself, windows and rows' left padding included, with the
    tokens of a session that runs every node in Python, with and without a callback."""
    import onnxkv.runtime.stores.contiguous as contiguous

    model = _models()[which]
    prompt = np.array([[1, 7, 9, 4, 12, 3], [0, 0, 0, 5, 8, 2]]) if padded else np.array([[1, 7, 9, 4, 12, 3]])
    mask = {"attention_mask": (prompt != 0).astype(np.int64)} if padded else {}
    ran = []

    def counted(*args, loop=contiguous.run_steps, **kwargs):
        run = loop(*args, **kwargs)
        ran.append(run is not None)
        return run

    monkeypatch.setattr(contiguous, "run_steps", counted)
    got = {}
    for compiled in (False, True):
        sess = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        for callback in (None, lambda step, tok: None):
            got[compiled, callback is None] = onnxkv.generate(
                sess, prompt, 100, eos_token_id=[], callback=callback, cache="contiguous", **sampling, **mask
            ).tokens
    # a finite bias (-1e4) hiding the padding is no range the kernel takes: those steps run node by node
    assert any(ran) != (padded and which == "attention_bias")
    for plain in (True, False):
        np.testing.assert_array_equal(got[False, plain], got[True, plain])


@pytest.mark.parametrize("which", ["attention", "concat", "mistral_torch", "gemma2_torch"])
@pytest.mark.parametrize("cache", ["contiguous", CacheConfig("paged", block_size=4)], ids=["contiguous", "paged"])
def test_a_left_padded_batch_of_an_export_graph_loops_as_its_steps_one_by_one(which, cache):
    """Rows of different lengths, left-padded (zeros first in each row's mask): the loop writes the masks of
    the ExportMask node with each row's padding hidden (windows included), with the tokens, caches and next
    logits of the steps run node by node."""
    model = _models()[which]
    prompt = np.array([[1, 7, 9, 4, 12, 3], [0, 0, 0, 5, 8, 2], [0, 0, 11, 6, 10, 13]])
    lengths = np.array([6, 3, 4])
    name, count = "logits", 30
    got = {}
    for compiled in (False, True):
        sess = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        name = sess.model.io.logits
        with sess.new_state(cache=cache) as st:
            b = FeedBuilder(sess.plan.inputs, sess.model, prompt, lengths, 0, thread_cache=False)
            out = st.run(b.first()[0], [name])
            for _ in range(3):  # the steps that record the compiled step
                out = st.run(b.next(out[name][:, -1].argmax(-1), out), [name])
            feeds = b.next(out[name][:, -1].argmax(-1), out)
            if compiled:
                run = st.decode_steps(feeds, count, **_io(sess))
                assert run is not None and run.steps >= 9 and not run.refused  # a paged call: up to its pages
                tokens = run.tokens.T.tolist()
                b.next(run.tokens[:-1].T, None)
                feeds = b.next(run.tokens[-1], None)
            else:
                rows = []
                for _ in range(count):
                    out = st.run(feeds, [name])
                    rows.append(out[name][:, -1].argmax(-1))
                    feeds = b.next(rows[-1], out)
                tokens = np.stack(rows, axis=1).tolist()
            got[compiled] = (tokens, {n: v.copy() for n, v in st.values.items()}, st.run(feeds, [name])[name].copy())
    steps = len(got[True][0][0])
    assert [row[:steps] for row in got[False][0]] == got[True][0]
    if steps == count:
        for n, value in got[False][1].items():
            np.testing.assert_array_equal(got[True][1][n], value)
        np.testing.assert_array_equal(got[True][2], got[False][2])
