"""The compiled step and generation loop of the export graph forms in a paged state: an opset-23 Attention
graph, a ``past -> Concat -> present`` export and ``torch.onnx.export`` files.  Their decode steps write each
layer's rows into the pages and read them back through the paged kernel (``_record.KIND_PAGE_ROWS``,
``KIND_MASKED_PAGED``), with the tokens, logits and cache bytes of the same steps run node by node; the
Concats hand their MaskedAttention placeholders, so no step copies the past."""

from __future__ import annotations

import numpy as np
import pytest
from test_step_loop import _io, _models, _one_by_one, _start

import onnxkv
import onnxkv.runtime.stores.paged as paged_store
from onnxkv import CacheConfig
from onnxkv.cache.paged import PagedPlane

FAMILIES = ["attention", "concat", "mistral_torch", "gemma2_torch"]


@pytest.mark.parametrize("which", FAMILIES)
@pytest.mark.parametrize("block_size, threads", [(1, 1), (4, 2), (16, 1)])
def test_paged_decode_steps_in_one_call_equal_the_steps_one_by_one(which, block_size, threads):
    model = _models()[which]
    prompt = np.array([[1, 7, 9, 4, 12, 3]])
    count = 70
    cache = CacheConfig("paged", block_size=block_size)
    ref = onnxkv.Session(model, threads=threads, compiled_steps=False)
    sess = onnxkv.Session(model, threads=threads)
    with ref.new_state(cache=cache) as rs, sess.new_state(cache=cache) as st:
        rb, rfeeds, rchosen = _start(ref, rs, prompt, 2)
        want, rfeeds = _one_by_one(ref, rs, rb, rfeeds, count)
        b, feeds, chosen = _start(sess, st, prompt, 2)
        assert chosen == rchosen
        got = []
        while len(got) < count:  # a call runs to the end of the pages staged before it
            run = st.decode_steps(feeds, count - len(got), **_io(sess))
            assert run is not None and run.steps >= 1 and not run.refused
            got += run.tokens.tolist()
            b.next(run.tokens[None, :-1], None)
            feeds = b.next(run.tokens[-1:], None)
        assert got == want
        assert st.length == rs.length
        for name, value in rs.values.items():
            np.testing.assert_array_equal(st.values[name], value)
        st._store.pool.audit()
        name = sess.model.io.logits  # the next step, through State.run (a replay), continues where the loop left
        np.testing.assert_array_equal(st.run(feeds, [name])[name], rs.run(rfeeds, [name])[name])


@pytest.mark.parametrize("which", FAMILIES)
def test_a_paged_decode_step_replays_every_node_but_the_mask_and_copies_no_past(which):
    """Recorded on a paged state, a decode step is the ExportMask node (Python) and one segment of every
    other node; the event log of node-by-node steps counts no copied past (the Concats' placeholders)."""
    from onnxkv.plan.compiled_step import Segment

    model = _models()[which]
    for compiled in (True, False):
        sess = onnxkv.Session(model, threads=1, compiled_steps=compiled, events=True)
        with sess.new_state(cache=CacheConfig("paged", block_size=4)) as st:
            b, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4, 12, 3]]), 1)
            first = len(sess.events.events)
            for _ in range(4):
                out = st.run(feeds, [sess.model.io.logits])
                feeds = b.next(out[sess.model.io.logits][:, -1].argmax(-1), out)
            copied = sum(e.prefix_copied_bytes for e in sess.events.events[first:])
            assert copied == 0, f"{which}: decode steps copied {copied} bytes of the past"
    steps = [s for s in sess.plan.steps.idle if s.caches[0][0]] if sess.plan.steps else []
    assert not steps  # the uncompiled session records none
    sess = onnxkv.Session(model, threads=1)
    with sess.new_state(cache=CacheConfig("paged", block_size=4)) as st:
        b, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4, 12, 3]]), 3)
    (step,) = [s for s in sess.plan.steps.idle if s.caches[0][0] and s.signature[0][1] == (1, 1)]
    kinds = [type(i) is Segment or sess.plan.kernels[i].op_type for i in step.items]
    assert kinds.count(True) >= 1 and [k for k in kinds if k is not True] == ["ExportMask"]


def test_quantized_pages_decode_through_the_python_path_with_the_same_tokens(monkeypatch):
    """Pages converted to int8 have no replay (the calls read native pages only): the steps run node by node
    and read the quantized pages through the paged kernel, as a session without compiled steps does."""
    gathered = []
    real = PagedPlane.gather
    monkeypatch.setattr(PagedPlane, "gather", lambda self, *a: gathered.append(self.name) or real(self, *a))
    model = _models()["concat"]
    cache = CacheConfig("paged", block_size=4, kv_format="int8")
    got = []
    for compiled in (True, False):
        sess = onnxkv.Session(model, threads=1, compiled_steps=compiled)
        got.append(onnxkv.generate(sess, np.array([[1, 7, 9, 4, 12, 3]]), 24, eos_token_id=[], cache=cache).tokens)
    np.testing.assert_array_equal(*got)
    assert not gathered


def test_a_loop_that_fails_leaves_the_paged_state_as_it_was(monkeypatch):
    """A loop whose call cannot allocate its workspace raises MemoryError: the state keeps its length, its
    pages and its values, and the next step runs."""
    import onnxkv.plan.step_loop as step_loop

    sess = onnxkv.Session(_models()["mistral_torch"], threads=1)
    with sess.new_state(cache=CacheConfig("paged", block_size=4)) as st:
        b, feeds, _ = _start(sess, st, np.array([[1, 7, 9, 4, 12, 3]]), 2)
        length, kept = st.length, {n: v.copy() for n, v in st.values.items()}

        def failing(*args, **kwargs):
            raise MemoryError("decode_steps: a call of step 0 could not allocate its workspace")

        monkeypatch.setattr(step_loop, "decode_steps", failing)
        with pytest.raises(MemoryError):
            st.decode_steps(feeds, 5, **_io(sess))
        monkeypatch.undo()
        assert st.length == length
        for n, v in st.values.items():
            np.testing.assert_array_equal(v, kept[n])
        st._store.pool.audit()
        run = st.decode_steps(feeds, 5, **_io(sess))
        assert run is not None and run.steps == 5


def test_generate_on_paged_caches_takes_the_loop_for_every_export_form(monkeypatch):
    ran = []
    real = paged_store.run_steps

    def counted(*args, **kwargs):
        run = real(*args, **kwargs)
        ran.append(run is not None)
        return run

    monkeypatch.setattr(paged_store, "run_steps", counted)
    for which in FAMILIES:
        ran.clear()
        tokens = {}
        for compiled in (True, False):
            sess = onnxkv.Session(_models()[which], threads=1, compiled_steps=compiled)
            tokens[compiled] = onnxkv.generate(
                sess, np.array([[1, 7, 9, 4, 12, 3]]), 40, eos_token_id=[], cache="paged"
            ).tokens
        np.testing.assert_array_equal(tokens[True], tokens[False])
        assert any(ran), which
