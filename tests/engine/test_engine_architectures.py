"""The engine on the builder exports of tests/data/arch (sliding windows, softcap, tied and int4 weights) and
on opset-23 Attention graphs: prompts of different lengths arriving at different steps, their chunks and
the decode rows in one run of segments per step, each request's tokens those of ``generate`` alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnxkv
from onnxkv.zoo.attention23 import build_attention_model
from onnxkv.zoo.builders import TINY, build_model

DATA = Path(__file__).parents[1] / "data" / "arch"
FOLDERS = sorted(p.name + "/" + q.name for p in DATA.iterdir() if p.is_dir() for q in p.glob("genai_*"))
PAGED = onnxkv.CacheConfig("paged", block_size=4)


def _assert_alone(session, requests) -> None:
    """Each request's tokens are those of ``generate`` alone, its prompt in the engine's chunks."""
    for r in requests:
        alone = onnxkv.generate(
            session, r.prompt[None], r.max_new_tokens, cache=PAGED, prefill_chunk=r.chunk, eos_token_id=[]
        )
        assert r.tokens == alone.tokens[0].tolist()


@pytest.mark.parametrize("folder", [*FOLDERS, "attention"])
def test_requests_on_builder_exports_equal_generate_alone(folder):
    model = build_model("attention", TINY, seed=11) if folder == "attention" else str(DATA / folder)
    session = onnxkv.Session(model, threads=1, events=True)
    rng = np.random.default_rng(1)
    vocab = min(session.token_limit or 100, 100)
    engine = onnxkv.Engine(session, cache=PAGED, max_batch_tokens=24)
    assert engine._segmented
    requests = []
    for i, n in enumerate((5, 30, 11, 17, 2)):  # past the exports' window of 8 positions
        requests.append(engine.add_request(rng.integers(1, vocab, n), 12 + i, eos_token_id=[]))
        engine.step()
    engine.run()
    assert all(e.extra["runs"] == 1 for e in session.events if e.action == "engine_step")
    _assert_alone(session, requests)
    engine.close()


def test_an_attention_graph_whose_mask_is_not_causal_runs_its_steps_one_by_one():
    """A graph whose Attention nodes read the padding mask alone (every prompt token sees the whole prompt):
    its first run of segments is refused and undone, the engine makes that step's runs and every later
    step's one by one, says why, and each request's tokens are those of ``generate`` alone."""
    model = build_model("attention", TINY, seed=11)
    padding = next(n for n in model.graph.node if n.op_type == "Unsqueeze" and "padding" in n.output[0]).output[0]
    for n in model.graph.node:
        if n.op_type == "Attention":
            n.input[3] = padding
    session = onnxkv.Session(model, threads=1, events=True)
    engine = onnxkv.Engine(session, cache=PAGED, max_batch_tokens=24)
    assert engine._segmented
    rng = np.random.default_rng(2)
    requests = [engine.add_request(rng.integers(1, 100, n), 6, eos_token_id=[]) for n in (5, 9)]
    engine.run()
    assert not engine._segmented
    assert "causal attention over its" in engine.describe()["batching"]
    _assert_alone(session, requests)
    engine._batch.pool.audit()
    engine.close()


def test_an_attention_graph_masking_with_a_finite_bias_batches_its_decode_rows():
    """A graph whose mask hides keys with the finite bias -1e9: a run of segments cannot read that as causal
    attention (its first is refused and undone, describe() says why), and the batched decode run used to
    raise InputError at its first step (the bias over a row's unwritten positions counted as shown).  The
    engine now says those positions are padding (State.run(gaps_padding=True)): decode rows of different
    lengths still run in one run per step, and each request's tokens are those of ``generate`` alone."""
    session = onnxkv.Session(build_attention_model(TINY, seed=11, mask_bias=-1e9), threads=1, events=True)
    engine = onnxkv.Engine(session, cache=PAGED, max_batch_tokens=24)
    rng = np.random.default_rng(4)
    requests = []
    for i, n in enumerate((5, 30, 11, 17, 2)):
        requests.append(engine.add_request(rng.integers(1, 100, n), 12 + i, eos_token_id=[]))
        engine.step()
    engine.run()
    assert not engine._segmented
    assert "finite bias -1e+09" in engine.describe()["batching"]
    assert max(e.extra["batched_rows"] for e in session.events if e.action == "engine_step") >= 3
    _assert_alone(session, requests)
    engine._batch.pool.audit()
    engine.close()


def _unmasked(causal: bool):
    """The builder's Attention graph with no attn_mask (is_causal as given), its mask nodes dropped."""
    import onnx

    model = build_model("attention", TINY, seed=11)
    for n in model.graph.node:
        if n.op_type == "Attention":
            n.input[3] = ""
            n.attribute.append(onnx.helper.make_attribute("is_causal", int(causal)))
    while True:
        used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        dead = [n for n in model.graph.node if not any(o in used for o in n.output)]
        if not dead:
            return model
        for n in dead:
            model.graph.node.remove(n)


def test_an_attention_graph_without_a_mask_batches_its_rows_in_runs_of_segments_only():
    """Without attn_mask nothing hides from a row the positions it never wrote, so the batched decode of rows
    of different lengths used to fail at its first step.  A causal graph now runs every step, decode rows
    alone too, as a run of segments; a graph that is not causal is not batched."""
    session = onnxkv.Session(_unmasked(True), threads=1, events=True)
    engine = onnxkv.Engine(session, cache=PAGED, max_batch_tokens=24)
    assert engine.batched and engine._decode_segments
    rng = np.random.default_rng(3)
    requests = [engine.add_request(rng.integers(1, 100, n), 7, eos_token_id=[]) for n in (5, 9, 2)]
    engine.run()
    _assert_alone(session, requests)
    engine._batch.pool.audit()
    engine.close()
    plain = onnxkv.Engine(onnxkv.Session(_unmasked(False), threads=1), cache=PAGED)
    assert not plain.batched and "not batched" in plain.describe()["batching"]
