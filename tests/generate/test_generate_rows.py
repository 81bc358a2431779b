"""generate over B prompt rows of one length: the decode steps of the batch run back to back in C
(State.decode_steps over B rows), with the tokens, the random stream, the ended rows' pad ids and the
callback of the steps run one by one (a session without compiled steps), on contiguous and paged caches."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuzzing import examples
from state_steps import count_decode_steps

import onnxkv
from onnxkv import CacheConfig
from onnxkv.zoo import embedded
from onnxkv.zoo.builders import MICRO, build_model


def _models():
    return {"embedded": str(embedded.embedded_model_dir()), "gqa": build_model("gqa", MICRO, seed=23)}


@pytest.fixture
def loops(monkeypatch):
    """The steps each State.decode_steps call ran (0 when it declined)."""
    return count_decode_steps(monkeypatch)


def _generate(model, compiled: bool, prompt, **kwargs):
    calls = []
    session = onnxkv.Session(model, threads=2, compiled_steps=compiled)
    onnxkv.generate(session, prompt, **{**kwargs, "max_new_tokens": 3})  # records the decode step
    res = onnxkv.generate(session, prompt, callback=lambda step, tok: calls.append((step, tok.tolist())), **kwargs)
    return res, calls


@pytest.mark.parametrize("which", ["embedded", "gqa"])
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 5}],
                         ids=["greedy", "sampled"])  # fmt: skip
def test_rows_decoded_in_one_call_equal_the_steps_one_by_one(which, cache, sampling, loops):
    model = _models()[which]
    vocab = 200 if which == "embedded" else MICRO.vocab_size
    prompt = np.random.default_rng(3).integers(1, vocab, (3, 6))
    kwargs = dict(max_new_tokens=40, eos_token_id=[], cache=CacheConfig(cache), **sampling)
    want, want_calls = _generate(model, False, prompt, **kwargs)
    loops.clear()
    got, got_calls = _generate(model, True, prompt, **kwargs)
    np.testing.assert_array_equal(got.sequences, want.sequences)
    assert got_calls == want_calls
    assert sum(loops) >= 30  # the steps ran in C, a few calls of up to CALLBACK_EVERY steps


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_rows_that_end_take_the_pad_id_and_the_loop_stops_when_every_row_ended(cache, loops):
    """Rows end at different steps (an end-of-sequence id each chooses at its own step); ended rows feed and
    return the pad id, as the steps one by one do, and the generation stops once all have ended."""
    model = _models()["embedded"]
    prompt = np.random.default_rng(4).integers(1, 200, (3, 5))
    free, _ = _generate(model, False, prompt, max_new_tokens=30, eos_token_id=[], cache=CacheConfig(cache))
    # an id row 0 chooses early, another row 1 chooses later; row 2 may never end
    eos = [int(free.tokens[0, 3]), int(free.tokens[1, 9])]
    kwargs = dict(max_new_tokens=30, eos_token_id=eos, pad_token_id=7, cache=CacheConfig(cache))
    want, want_calls = _generate(model, False, prompt, **kwargs)
    loops.clear()
    got, got_calls = _generate(model, True, prompt, **kwargs)
    np.testing.assert_array_equal(got.sequences, want.sequences)
    np.testing.assert_array_equal(got.finished, want.finished)
    assert got_calls == want_calls
    assert (got.tokens[0, 4:] == 7).all() or not got.finished[0]
    assert sum(loops) > 0


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.9, "top_k": 30, "seed": 2}],
                         ids=["greedy", "sampled"])  # fmt: skip
def test_a_padded_batch_decodes_in_one_call(cache, sampling, loops):
    """A padded batch of a GroupQueryAttention graph (rows right-padded, each row's mask ones first): the
    loop takes its steps, with the tokens and callbacks of the steps one by one -- on contiguous caches
    each row writes over its own padding until it passes the longest row, on pages each row holds its own
    tokens only and is written at its own length."""
    model = _models()["gqa"]
    prompt = np.random.default_rng(5).integers(1, MICRO.vocab_size, (3, 6))
    mask = np.array([[1] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]])
    kwargs = dict(max_new_tokens=24, eos_token_id=[], attention_mask=mask, cache=CacheConfig(cache), **sampling)
    want, want_calls = _generate(model, False, prompt, **kwargs)
    loops.clear()
    got, got_calls = _generate(model, True, prompt, **kwargs)
    np.testing.assert_array_equal(got.sequences, want.sequences)
    assert got_calls == want_calls
    assert sum(loops) >= 20


def test_random_batches_equal_the_steps_one_by_one():
    """Random batches (1-5 rows, padded or not; contiguous caches of any initial capacity, pages of 1-16
    tokens, or tensors; greedy or sampled; ending ids; a sliding window): generate with compiled steps and
    its loop gives the sequences, ended rows and callbacks of a session without compiled steps."""
    windowed = build_model("gqa", MICRO, seed=29)
    for node in windowed.graph.node:
        if node.op_type == "GroupQueryAttention":
            node.attribute.append(onnx.helper.make_attribute("local_window_size", 5))
    models = {**_models(), "window": windowed}
    sessions = {(k, c): onnxkv.Session(m, threads=2, compiled_steps=c) for k, m in models.items() for c in (0, 1)}
    seed = 17
    rng = np.random.default_rng(seed)
    for case in range(examples(12)):
        name = str(rng.choice(list(models)))
        vocab = 200 if name == "embedded" else MICRO.vocab_size
        rows, length = int(rng.integers(1, 6)), int(rng.integers(1, 14))
        prompt = rng.integers(1, vocab, (rows, length))
        mask = np.ones((rows, length), np.int64)
        if rng.random() < 0.4:
            for r in range(rows):
                mask[r, : int(rng.integers(0, length))] = 0
        kind = str(rng.choice(["contiguous", "paged", "tensor"]))
        cache = {
            "contiguous": CacheConfig("contiguous", initial_capacity=int(rng.integers(1, 40))),
            "paged": CacheConfig("paged", block_size=int(rng.choice([1, 2, 4, 16]))),
            "tensor": "tensor",
        }[kind]
        kwargs = dict(max_new_tokens=int(rng.integers(1, 40)), attention_mask=mask, cache=cache)
        if rng.random() < 0.5:
            kwargs.update(do_sample=True, temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(0, 30)),
                          seed=int(rng.integers(0, 99)))  # fmt: skip
        kwargs["eos_token_id"] = [int(x) for x in rng.integers(1, vocab, int(rng.integers(0, 3)))]
        runs = []
        for compiled in (0, 1):
            calls: list = []
            res = onnxkv.generate(sessions[name, compiled], prompt, callback=lambda s, t: calls.append((s, t.tolist())),
                                  **kwargs)  # fmt: skip
            runs.append((res.sequences, res.finished, calls))
        where = f"seed {seed}, case {case}: {name}, {rows} rows of {length}, {kind}"
        np.testing.assert_array_equal(runs[1][0], runs[0][0], err_msg=where)
        np.testing.assert_array_equal(runs[1][1], runs[0][1], err_msg=where)
        assert runs[1][2] == runs[0][2], where
