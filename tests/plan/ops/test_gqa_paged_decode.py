"""The fused batched decode of GroupQueryAttention on paged caches (_gqa_paged_decode.paged_decode): one
kernel call per layer for one token per row, or a few tokens per row of one length, bit for bit the general
path -- logits, every page byte, the rows' lengths and the event log's cache counters -- for rows of
different lengths, forked rows sharing a partly filled page (copy-on-write), a speculative tree's runs and
a failed run; and the cases it leaves to the general path."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.plan.ops import _gqa_paged_decode, attention_gqa
from onnxkv.zoo import embedded

PAGED = onnxkv.CacheConfig("paged", block_size=16)
COUNTERS = ("allocations", "allocated_bytes", "append_copied_bytes", "cow_copied_bytes", "prefix_copied_bytes")


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(str(embedded.embedded_model_dir()), threads=2, events=True)


@pytest.fixture
def taken(monkeypatch):
    """Counts the calls the fused path served: {"n": calls}."""
    count = {"n": 0}
    real = _gqa_paged_decode.paged_decode

    def counted(op, inputs, rt):
        out = real(op, inputs, rt)
        count["n"] += out is not None
        return out

    monkeypatch.setattr(attention_gqa, "paged_decode", counted)
    return count


def _batch(session, prompts, cache=PAGED):
    """One paged state holding a row per prompt (each run alone, then moved in); a builder for its feeds."""
    batch = session.new_state(cache=cache).sibling()
    builder = None
    for p in prompts:
        ids = np.array(embedded.encode(p), np.int64)
        builder = FeedBuilder(session.plan.inputs, session.model, ids[None], np.array([ids.size]), 0, False)
        st = batch.sibling()
        st.run(builder.first()[0], [])
        batch.append_rows(st)
    return batch, builder


def _decode(session, batch, builder, steps: int) -> tuple[list, list]:
    """``steps`` greedy decode steps of every row; the logits of each and the cache_write counters."""
    name, logits, counters = session.model.io.logits, [], []
    tokens = np.full(batch.batch, 10)
    for _ in range(steps):
        session.events.clear()
        out = batch.run(builder.ragged(tokens, batch.lengths), [name])[name][:, -1]
        logits.append(out.copy())
        counters.append([tuple(getattr(e, c) for c in COUNTERS) for e in session.events if e.action == "cache_write"])
        tokens = out.argmax(-1)
    return logits, counters


def _general(monkeypatch):
    monkeypatch.setattr(attention_gqa, "paged_decode", lambda op, inputs, rt: None)


PROMPTS = ["def f(x):\n    return x", "import sys\n", "class Stack:\n    def push(self, item):\n        self"]


def test_rows_of_different_lengths_equal_the_general_path(session, taken, monkeypatch):
    batch, builder = _batch(session, PROMPTS)
    got, got_counts = _decode(session, batch, builder, 20)  # crosses page ends of every row
    values, lengths = batch.values, batch.lengths
    layers = len(session.model.convention.layers)
    assert taken["n"] == 20 * layers
    _general(monkeypatch)
    ref, ref_counts = _decode(session, *_batch(session, PROMPTS), 20)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)
    assert got_counts == ref_counts
    ref_batch = _batch(session, PROMPTS)[0]
    _decode(session, ref_batch, builder, 20)
    np.testing.assert_array_equal(lengths, ref_batch.lengths)
    for key, arr in values.items():
        np.testing.assert_array_equal(arr, ref_batch.values[key])
    batch.pool.audit()


def test_forked_rows_copy_the_shared_page_on_write(session, taken, monkeypatch):
    """Two rows forked from one (their partly filled last page shared): each writes its own copy."""

    def forked():
        st, builder = _batch(session, PROMPTS[:1])
        st.reorder(np.array([0, 0]))
        return st, builder

    st, builder = forked()
    got, got_counts = _decode(session, st, builder, 3)
    assert taken["n"] > 0 and any(c[3] > 0 for step in got_counts for c in step)  # copy-on-write counted
    _general(monkeypatch)
    ref_st, _ = forked()
    ref, ref_counts = _decode(session, ref_st, builder, 3)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)
    assert got_counts == ref_counts
    for key, arr in st.values.items():
        np.testing.assert_array_equal(arr, ref_st.values[key])
    st.pool.audit()


def _verify(session, state, builder, chunks) -> tuple[list, list]:
    """Runs of ``chunks`` (int [B, S] each) after the state's rows; the logits of each and its cache_write
    counters."""
    name, logits, counters = session.model.io.logits, [], []
    for chunk in chunks:
        session.events.clear()
        logits.append(state.run(builder.next(chunk, None), [name])[name].copy())
        counters.append([tuple(getattr(e, c) for c in COUNTERS) for e in session.events if e.action == "cache_write"])
    return logits, counters


def test_several_tokens_per_row_equal_the_general_path(session, taken, monkeypatch):
    """A speculative tree's runs (two rows forked from one, S tokens each, their shared page copied by one
    row); a run of more than FUSED_TOKENS tokens per row is left to the general path."""
    rng = np.random.default_rng(4)
    chunks = [rng.integers(1, 90, (2, n)) for n in (4, 3, 7, 17)]

    def forked():
        st, builder = _batch(session, PROMPTS[:1])
        st.reorder(np.array([0, 0]))
        builder.select_rows(np.array([0, 0]))
        return st, builder

    st, builder = forked()
    got, got_counts = _verify(session, st, builder, chunks)
    assert taken["n"] == 3 * len(session.model.convention.layers)
    _general(monkeypatch)
    ref_st, ref_builder = forked()
    ref, ref_counts = _verify(session, ref_st, ref_builder, chunks)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)
    assert got_counts == ref_counts
    np.testing.assert_array_equal(st.lengths, ref_st.lengths)
    for key, arr in st.values.items():
        np.testing.assert_array_equal(arr, ref_st.values[key])
    st.pool.audit()


def test_a_failed_run_leaves_the_state_as_it_was(session, monkeypatch):
    """The fused path wrote three layers' pages, then the run raised: the state and pool are as before."""
    batch, builder = _batch(session, PROMPTS)
    before = {k: v.copy() for k, v in batch.values.items()}
    lengths, live = batch.lengths.copy(), batch.pool.live_pages
    real = _gqa_paged_decode.paged_decode
    calls = {"n": 0}

    def failing(op, inputs, rt):
        out = real(op, inputs, rt)
        calls["n"] += out is not None
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return out

    monkeypatch.setattr(attention_gqa, "paged_decode", failing)
    with pytest.raises(RuntimeError, match="injected"):
        batch.run(builder.ragged(np.full(3, 10), batch.lengths), [])
    np.testing.assert_array_equal(batch.lengths, lengths)
    assert batch.pool.live_pages == live
    for k, v in batch.values.items():
        np.testing.assert_array_equal(v, before[k])
    batch.pool.audit()


def test_quantized_pages_take_the_general_path(session, taken):
    batch, builder = _batch(session, PROMPTS, onnxkv.CacheConfig("paged", block_size=16, kv_format="int8"))
    _decode(session, batch, builder, 18)
    assert taken["n"] == 0
    batch.pool.audit()


@pytest.fixture(scope="module")
def session_f16():
    """The embedded model as ONNX Runtime's float16 converter writes it (float32 inputs and outputs)."""
    pytest.importorskip("onnxruntime")
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(embedded.embedded_model_dir() / "model.onnx"))
    return onnxkv.Session(convert_float_to_float16(model, keep_io_types=True), threads=2, events=True)


@pytest.mark.parametrize(
    "model, kv_format", [("float32", "fp16"), ("float32", "bf16"), ("float16", None), ("float16", "bf16")],
    ids=["f32-fp16-pages", "f32-bf16-pages", "f16", "f16-bf16-pages"],
)  # fmt: skip
def test_narrow_pages_and_float16_files_equal_the_general_path(request, model, kv_format, taken, monkeypatch):
    """float16 or bfloat16 pages (kv_format stores every page so) and a float16 file's tokens take the fused
    call: logits, every page and the cache counters as the general path's, rows of different lengths."""
    session = request.getfixturevalue("session" if model == "float32" else "session_f16")
    cache = onnxkv.CacheConfig("paged", block_size=16, kv_format=kv_format)
    batch, builder = _batch(session, PROMPTS, cache)
    got, got_counts = _decode(session, batch, builder, 18)
    values = batch.values
    assert taken["n"] == 18 * len(session.model.convention.layers)
    _general(monkeypatch)
    ref_batch, ref_builder = _batch(session, PROMPTS, cache)
    ref, ref_counts = _decode(session, ref_batch, ref_builder, 18)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)
    assert got_counts == ref_counts
    for key, arr in values.items():
        np.testing.assert_array_equal(arr, ref_batch.values[key])
    batch.pool.audit()
