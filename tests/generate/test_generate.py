"""onnxkv.generate: greedy/sampled decoding, EOS and padding, argument errors."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv import InputError
from onnxkv.generate.sampling import SamplingConfig, probabilities, select_next
from onnxkv.zoo.builders import MICRO, build_model


@pytest.fixture(scope="module", params=["gqa", "attention", "concat", "tensorscatter"])
def session(request):
    return onnxkv.Session(build_model(request.param, MICRO, seed=11), threads=1)


def test_left_padded_batch_equals_rows_alone(session):
    rows = [[5, 9, 2, 7, 1, 8], [4, 4, 6]]
    L = max(map(len, rows))
    ids = np.array([[0] * (L - len(r)) + r for r in rows])
    mask = np.array([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    batch = onnxkv.generate(session, ids, 12, attention_mask=mask, eos_token_id=[])
    for b, r in enumerate(rows):
        alone = onnxkv.generate(session, np.array([r]), 12, eos_token_id=[])
        np.testing.assert_array_equal(batch.tokens[b], alone.tokens[0])


def test_sampling_is_repeatable_with_a_seed(session):
    ids = np.array([[1, 2, 3]])
    a = onnxkv.generate(session, ids, 10, do_sample=True, temperature=1.0, top_k=20, top_p=0.9, seed=7, eos_token_id=[])
    b = onnxkv.generate(session, ids, 10, do_sample=True, temperature=1.0, top_k=20, top_p=0.9, seed=7, eos_token_id=[])
    np.testing.assert_array_equal(a.tokens, b.tokens)
    c = [
        onnxkv.generate(session, ids, 10, do_sample=True, temperature=5.0, seed=s, eos_token_id=[]).tokens
        for s in range(4)
    ]
    assert any(not np.array_equal(c[0], x) for x in c[1:])


def test_eos_stops_rows_and_pads_them(session):
    ids = np.array([[1, 2, 3], [3, 2, 1]])
    free = onnxkv.generate(session, ids, 8, eos_token_id=[])
    eos = int(free.tokens[0, 2])  # make row 0's third token the EOS
    res = onnxkv.generate(session, ids, 8, eos_token_id=eos, pad_token_id=0)
    assert res.finished[0]
    np.testing.assert_array_equal(res.tokens[0, :3], free.tokens[0, :3])
    assert (res.tokens[0, 3:] == 0).all()
    assert res.sequences.shape == (2, 3 + res.tokens.shape[1])


def test_generation_stops_when_every_row_ended(session):
    ids = np.array([[1, 2, 3]])
    first = int(onnxkv.generate(session, ids, 1).tokens[0, 0])
    res = onnxkv.generate(session, ids, 20, eos_token_id=first)
    assert res.tokens.shape == (1, 1) and res.finished.all()


def test_result_reports_timing(session):
    res = onnxkv.generate(session, np.array([[1, 2]]), 5, eos_token_id=[])
    assert res.new_tokens == 5 and len(res.step_seconds) == 4
    assert res.tokens_per_second > 0 and res.prefill_seconds > 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -3}, "seed"),
        ({"eos_token_id": MICRO.vocab_size}, "outside the vocabulary"),
        ({"pad_token_id": -1}, "pad_token_id"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 10_000}, "max_length"),
    ],
)
def test_bad_arguments(kwargs, match):
    sess = onnxkv.Session(build_model("gqa", MICRO), threads=1)
    sess.model.max_length = MICRO.max_length  # as a genai_config.json would set it
    args = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(InputError, match=match):
        onnxkv.generate(sess, np.array([[1, 2]]), **args)


def test_bad_prompts():
    sess = onnxkv.Session(build_model("concat", MICRO), threads=1)
    with pytest.raises(InputError, match="integers"):
        onnxkv.generate(sess, np.array([[1.0, 2.0]]), 2)
    with pytest.raises(InputError, match="right-padded"):
        onnxkv.generate(sess, np.array([[1, 2, 0]]), 2, attention_mask=np.array([[1, 1, 0]]))
    with pytest.raises(InputError, match="no tokens"):
        onnxkv.generate(sess, np.array([[1, 2]]), 2, attention_mask=np.array([[0, 0]]))
    with pytest.raises(InputError, match=r"\[0, 97\)"):
        onnxkv.generate(sess, np.array([[1, 500]]), 2)
    with pytest.raises(InputError, match="shape"):
        onnxkv.generate(sess, np.array([[1, 2]]), 2, attention_mask=np.array([[1, 1, 1]]))


def test_sampling_filters():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [[0.625, 0.375, 0, 0]])
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    np.testing.assert_allclose(p, [[0.625, 0.375, 0, 0]])
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.3))
    np.testing.assert_allclose(p, [[1, 0, 0, 0]])
    assert select_next(logits, SamplingConfig()).tolist() == [0]
    draws = [int(select_next(logits, SamplingConfig(1.0, seed=s))[0]) for s in range(200)]
    assert abs(draws.count(0) / 200 - 0.5) < 0.12


def test_chunked_prefill_gives_the_same_tokens(session):
    prompt = np.random.default_rng(7).integers(3, MICRO.vocab_size, (1, 45))
    whole = onnxkv.generate(session, prompt, 10, eos_token_id=[], prefill_chunk=None)
    for chunk in (16, 44):
        chunked = onnxkv.generate(session, prompt, 10, eos_token_id=[], prefill_chunk=chunk)
        np.testing.assert_array_equal(chunked.tokens, whole.tokens)
    with pytest.raises(InputError, match="prefill_chunk"):
        onnxkv.generate(session, prompt, 2, prefill_chunk=0)


def test_paged_cache_gives_the_same_tokens(session):
    rows = [[5, 9, 2, 7, 1, 8], [4, 4, 6]]
    L = max(map(len, rows))
    ids = np.array([[0] * (L - len(r)) + r for r in rows])
    mask = np.array([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    want = onnxkv.generate(session, ids, 20, attention_mask=mask, eos_token_id=[])
    got = onnxkv.generate(
        session, ids, 20, attention_mask=mask, eos_token_id=[], cache=onnxkv.CacheConfig("paged", block_size=4)
    )
    np.testing.assert_array_equal(got.tokens, want.tokens)
    with pytest.raises(
        InputError, match="cache must be a CacheConfig, one of 'contiguous', 'paged', 'tensor' or None, got 'pages'"
    ):
        onnxkv.generate(session, ids, 2, cache="pages")


@pytest.mark.parametrize("new", [1, 2, 3, 40, 300])
def test_decode_steps_run_in_c_give_the_tokens_callbacks_and_timings_of_steps_run_one_by_one(new, monkeypatch):
    """Greedy generation of one sequence runs its decode steps as one call into C (State.decode_steps)
    after the steps that record it; 300 tokens pass the initial capacity (272): the cache grows in between."""
    from onnxkv.zoo import embedded

    path = str(embedded.embedded_model_dir())
    ids = np.array([embedded.encode("The ")])
    seen = {}
    results = {}
    for compiled in (False, True):
        sess = onnxkv.Session(path, threads=1, compiled_steps=compiled)
        runs = []
        real = sess.plan.run
        monkeypatch.setattr(sess.plan, "run", lambda *a, **k: runs.append(1) or real(*a, **k))
        calls = seen[compiled] = []
        for callback in (None, lambda step, tok: calls.append((step, tok.dtype, tok.tolist()))):
            results[compiled, callback is None] = onnxkv.generate(sess, ids, new, eos_token_id=[], callback=callback)
        if compiled and new == 300:  # prefill, two steps recording, 1 growing the cache, 1 recording again
            assert len(runs) <= 2 * 6 + 300 // 16
    for plain in (True, False):
        a, b = results[False, plain], results[True, plain]
        np.testing.assert_array_equal(a.sequences, b.sequences)
        assert len(a.step_seconds) == len(b.step_seconds) == new - 1
    assert seen[False] == seen[True] == [(s, np.dtype(np.int64), [int(t)]) for s, t in enumerate(a.tokens[0])]


def test_decode_steps_in_c_stop_at_an_end_of_sequence_id():
    from onnxkv.zoo import embedded

    path = str(embedded.embedded_model_dir())
    ids = np.array([embedded.encode("The ")])
    free = onnxkv.generate(onnxkv.Session(path, threads=1, compiled_steps=False), ids, 30, eos_token_id=[]).tokens[0]
    eos = int(free[20])
    stop = free.tolist().index(eos) + 1
    for compiled in (False, True):
        got = onnxkv.generate(onnxkv.Session(path, threads=1, compiled_steps=compiled), ids, 30, eos_token_id=eos)
        assert got.tokens[0].tolist() == free[:stop].tolist() and got.finished.tolist() == [True]


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(top_k=20), dict(temperature=0.9, top_p=0.9),
                                dict(temperature=1.2, top_k=40, top_p=0.95)])  # fmt: skip
@pytest.mark.parametrize("new", [2, 40, 300])
def test_sampled_steps_run_in_c_draw_the_tokens_of_steps_run_one_by_one(kw, new):
    """The compiled loop draws with the sampling kernel and numbers of the same generator, which it leaves
    where the steps one by one would have: across chunks (a callback), cache growth and the steps in
    Python between them, the tokens are the same."""
    from onnxkv.zoo import embedded

    path = str(embedded.embedded_model_dir())
    ids = np.array([embedded.encode("The ")])
    got = {}
    for compiled in (False, True):
        sess = onnxkv.Session(path, threads=1, compiled_steps=compiled)
        for callback in (None, lambda step, tok: None):
            got[compiled, callback is None] = onnxkv.generate(
                sess, ids, new, do_sample=True, seed=5, eos_token_id=[], callback=callback, **kw
            ).tokens
    for plain in (True, False):
        np.testing.assert_array_equal(got[False, plain], got[True, plain])
    assert len(set(got[True, True][0].tolist())) > 1


def test_a_top_k_past_int64_draws_on_every_cache_as_no_top_k():
    """top_k=2**70 passed generate's check, then the compiled loop refused it naming State.decode_steps (a
    fuzzing helper found it); any top_k past the vocabulary keeps every id, on every cache kind."""
    from onnxkv.zoo import embedded

    sess = onnxkv.Session(str(embedded.embedded_model_dir()), threads=1)
    ids = np.array([embedded.encode("The ")])
    want = onnxkv.generate(sess, ids, 12, do_sample=True, seed=3, eos_token_id=[], cache="tensor").tokens
    for top_k in (2**63, 2**64, 2**70):
        for cache in ("contiguous", "paged", "tensor"):
            got = onnxkv.generate(sess, ids, 12, do_sample=True, top_k=top_k, seed=3, eos_token_id=[], cache=cache)
            np.testing.assert_array_equal(got.tokens, want, err_msg=f"top_k={top_k} cache={cache}")
