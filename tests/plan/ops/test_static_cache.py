"""The static-cache form in paged states (onnxkv.plan.ops._page_readers): the TensorScatter nodes hand their
readers placeholders and each layer's Attention reads the caches' pages, so a decode step copies no past; the
results equal a contiguous state's (to the paged kernel's summation order), and a row whose visible keys lie in
blocks it never wrote falls back to gathered copies (zeros there)."""

from __future__ import annotations

import numpy as np
import pytest
from static_feeds import static_feeds

import onnxkv
from onnxkv import CacheConfig
from onnxkv.plan.ops._page_readers import read_pages
from onnxkv.plan.ops.attention_onnx import Attention24
from onnxkv.plan.ops.tensor_scatter import TensorScatter
from onnxkv.zoo.builders import MICRO, build_model

C = MICRO.max_length


@pytest.fixture(scope="module")
def model():
    return build_model("tensorscatter", MICRO, seed=8)


def _feeds(tokens, write_indices, shown):
    return static_feeds(C, tokens, write_indices, shown)


def test_every_scatter_hands_its_attention_the_pages(model):
    session = onnxkv.Session(model, threads=1)
    kernels = session.plan.kernels
    scatters = [k for k in kernels if isinstance(k, TensorScatter)]
    attentions = [k for k in kernels if isinstance(k, Attention24)]
    assert len(scatters) == 2 * MICRO.num_layers and len(attentions) == MICRO.num_layers
    assert all(k.pages_read for k in scatters) and all(k.pages_given for k in attentions)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_decode_steps_copy_no_past_and_equal_a_contiguous_state(model, block_size):
    session = onnxkv.Session(model, threads=1, events=True)
    name = session.model.io.logits
    prompt = ([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]], [0, 0], [5, 5])
    steps = [([[20 + i], [40 + i]], [5 + i, 5 + i], [6 + i, 6 + i]) for i in range(6)]
    got = {}
    for cache in ("contiguous", CacheConfig("paged", block_size=block_size)):
        with session.new_state(cache=cache) as state:
            state.run(_feeds(*prompt), [name])
            first = len(session.events.events)
            got[str(cache)] = [state.run(_feeds(*run), [name])[name].copy() for run in steps]
            copied = sum(e.prefix_copied_bytes for e in session.events.events[first:])
            assert copied == 0, f"{cache}: decode steps copied {copied} bytes of the past"
    plain, paged = got.values()
    for a, b in zip(plain, paged, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_rows_at_their_own_positions_on_pages_equal_a_contiguous_state(model):
    """Row 1 jumps to slot 9 (blocks of 4) and shows every slot up to it: a state's static pages cover the
    whole capacity from its first run, so the attention reads the pages (the slots never written are zeros)."""
    session = onnxkv.Session(model, threads=1, events=True)
    name = session.model.io.logits
    runs = [([[5, 6, 7], [8, 9, 10]], [0, 0], [3, 3]), ([[11], [12]], [3, 9], [4, 10])]
    got = []
    for cache in ("contiguous", CacheConfig("paged", block_size=4)):
        with session.new_state(cache=cache) as state:
            got.append([state.run(_feeds(*run), [name])[name].copy() for run in runs])
            last = session.events.events[-1].step
            assert sum(e.prefix_copied_bytes for e in session.events.events if e.step == last) == 0
    for a, b in zip(*got, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


class _Plane:
    """A paged plane as read_pages reads it: tables, block size, gather."""

    def __init__(self, tables, values):
        self.tables, self.block_size, self.values = np.asarray(tables, np.int32), 4, values

    def gather(self, length):
        return self.values[:, :, :length].copy()


class _Run:
    def __init__(self, caches):
        self.caches, self.counted = caches, []

    def count(self, **counters):
        self.counted.append(counters)


def test_blocks_without_a_page_are_read_from_gathered_copies():
    values = np.arange(2 * 1 * 12 * 2, dtype=np.float32).reshape(2, 1, 12, 2)
    whole = {"k": _Plane([[0, 1, 2], [3, 4, 5]], values), "v": _Plane([[0, 1, 2], [3, 4, 5]], values)}
    holed = {"k": _Plane([[0, 1, 2], [3, -1, 5]], values), "v": _Plane([[0, 1, 2], [3, -1, 5]], values)}
    seen = (None, np.array([[8], [9]]), -1)
    kv_len = np.array([9, 10])
    run = _Run(whole)
    keys, values_read, paged = read_pages(run, ("k", "v"), seen, kv_len, 12)
    assert paged and keys is whole["k"] and values_read is whole["v"] and not run.counted
    run = _Run(holed)
    keys, _, paged = read_pages(run, ("k", "v"), seen, kv_len, 12)
    assert not paged and isinstance(keys, np.ndarray) and keys.shape == (2, 1, 12, 2)
    assert run.counted == [
        {"allocations": 2, "allocated_bytes": 2 * keys.nbytes, "prefix_copied_bytes": 2 * keys.nbytes}
    ]
    # a row starting past the hole (kv_start) reads the pages; no ranges (the dense path) gathers
    assert read_pages(_Run(holed), ("k", "v"), (np.array([0, 8]), seen[1], -1), kv_len, 12)[2]
    assert not read_pages(_Run(whole), ("k", "v"), None, kv_len, 12)[2]
    assert not read_pages(_Run(whole), ("k", "v"), seen, np.array([9, 13]), 12)[2]  # past the tables


def test_beam_search_on_paged_static_caches_equals_tensor_caches(model):
    session = onnxkv.Session(model, threads=1)
    prompt = np.random.default_rng(2).integers(1, MICRO.vocab_size, (2, 6))
    want = onnxkv.beam_search(session, prompt, 3, 10, cache="tensor").sequences
    np.testing.assert_array_equal(onnxkv.beam_search(session, prompt, 3, 10, cache="paged").sequences, want)


def test_a_paged_static_decode_step_stages_no_page_and_a_failed_one_puts_back_what_it_rewrote(model, monkeypatch):
    """Every row writes a position of a page it holds alone (a static state holds its whole capacity from its
    first run): the write takes the decode fast path, keeping the committed bytes it replaces for the undo."""
    import onnxkv.cache.paged as paged

    staged = []
    original = paged.PagedCache._stage_pages
    monkeypatch.setattr(paged.PagedCache, "_stage_pages", lambda self, *a: staged.append(1) or original(self, *a))
    session = onnxkv.Session(model, threads=1)
    name = session.model.io.logits
    with session.new_state(cache=CacheConfig("paged", block_size=4)) as state:
        state.run(_feeds([[5, 6, 7, 8, 9]], [0], [5]), [name])
        staged.clear()
        state.run(_feeds([[10]], [5], [6]), [name])
        assert not staged
        before = {n: np.array(v) for n, v in state.values.items()}, state.length

        def fail(outputs):
            raise RuntimeError("refused by the caller")

        with pytest.raises(RuntimeError, match="refused"):
            state.run(_feeds([[11]], [2], [6]), [name], before_commit=fail)  # rewrites committed slot 2
        assert not staged and state.length == before[1]
        for n, v in state.values.items():
            np.testing.assert_array_equal(v, before[0][n])


def test_a_layer_whose_present_has_another_reader_reads_gathered_copies_of_both(model):
    """An Identity also reads layer 0's present key: that TensorScatter must hand over a copy, so layer 0's
    Attention reads both K and V from copies (its value TensorScatter too), the other layers their pages."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.node.append(onnx.helper.make_node("Identity", ["present.0.key"], ["extra_key"], name="extra"))
    m.graph.output.append(onnx.helper.make_tensor_value_info("extra_key", onnx.TensorProto.FLOAT, None))
    session = onnxkv.Session(m, threads=1)
    scatters = {k.bound_past: k.pages_read for k in session.plan.kernels if isinstance(k, TensorScatter)}
    assert not scatters["past_key_values.0.key"] and not scatters["past_key_values.0.value"]
    assert scatters["past_key_values.1.key"] and scatters["past_key_values.1.value"]
    name = session.model.io.logits
    runs = [([[5, 6, 7, 8]], [0], [4]), ([[9]], [4], [5]), ([[10]], [5], [6])]
    got = []
    for cache in ("contiguous", CacheConfig("paged", block_size=4)):
        with session.new_state(cache=cache) as state:
            got.append([state.run(_feeds(*run), [name])[name].copy() for run in runs])
    for a, b in zip(*got, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
