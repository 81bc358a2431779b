"""Engine.run on graph forms the engine does not batch (one state per request): once every request decodes,
each one's remaining steps run in C on its own state (onnxkv/engine/alone.py), its tokens generate's alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from state_steps import count_decode_steps

import onnxkv
from onnxkv.zoo.concat import build_concat_model
from onnxkv.zoo.config import MICRO


@pytest.fixture(scope="module")
def concat_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("concat") / "model.onnx"
    onnx.save(build_concat_model(MICRO, seed=3), path)
    return str(path)


def _alone(session, r, **sampling) -> list[int]:
    out = onnxkv.generate(
        session, r.prompt[None], r.max_new_tokens, eos_token_id=r.eos, prefill_chunk=r.chunk, **sampling
    )
    return out.tokens[0].tolist()


SAMPLING = [{}, {"do_sample": True, "temperature": 0.8, "top_k": 9, "seed": 4}, {}, {"do_sample": True, "seed": 7}]


def test_each_request_decodes_its_remaining_steps_in_one_call(concat_path, monkeypatch):
    """Four requests of different lengths, greedy and sampled, one with an end id it reaches: each decodes
    in one call after the prompts, and stops at its end id or its last token."""
    session = onnxkv.Session(concat_path, threads=1)
    probe = onnxkv.Engine(session)
    free = probe.add_request(np.arange(5, 21) % MICRO.vocab_size, 20, eos_token_id=[])
    probe.run()
    eos = [free.tokens[6]]  # ends request 0 at its seventh token, inside its call
    ran = count_decode_steps(monkeypatch)
    engine = onnxkv.Engine(session)
    assert not engine.batched and "in C on its own state" in engine.describe()["batching"]
    prompts = [np.arange(5, 21), np.arange(3, 40), np.arange(1, 4), np.arange(9, 30)]
    requests = [
        engine.add_request(p % MICRO.vocab_size, n, eos_token_id=e, **kw)
        for p, n, e, kw in zip(prompts, (20, 25, 14, 30), (eos, [], [], []), SAMPLING, strict=True)
    ]
    engine.run()
    monkeypatch.undo()
    assert requests[0].finished == "eos" and requests[0].tokens == free.tokens[:7]
    assert [r.finished for r in requests[1:]] == ["length"] * 3
    for r, kw in zip(requests, SAMPLING, strict=True):
        assert r.tokens == _alone(session, r, **kw), r
    assert sorted(ran) == [6, 13, 24, 29]  # each request's steps after its first token, in one call
    assert engine.steps == 1 + 29  # the prompts' step, then the longest call's steps


def test_a_state_that_cannot_loop_steps_one_by_one(concat_path, monkeypatch):
    """With the event log on, a state runs no loop: its request is not tried again and steps one by one,
    with the same tokens."""
    session = onnxkv.Session(concat_path, threads=1, events=True)
    ran = count_decode_steps(monkeypatch)
    engine = onnxkv.Engine(session)
    requests = [engine.add_request(np.arange(2, 2 + n) % MICRO.vocab_size, 9, eos_token_id=[]) for n in (4, 11)]
    engine.run()
    monkeypatch.undo()
    assert ran == [0, 0] and engine.steps == 9
    later = engine.add_request(np.arange(3, 9) % MICRO.vocab_size, 4, eos_token_id=[])
    engine.run()
    assert engine._unlooped == {later.id}  # the ids of requests that finished before are let go
    plain = onnxkv.Session(concat_path, threads=1)
    for r in requests:
        assert r.tokens == _alone(plain, r)
