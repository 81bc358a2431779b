"""The prompt chunk a session chooses (onnxkv.runtime.prompt_chunk, Session.prompt_chunk) and its use by
``generate(prefill_chunk="auto")``, recorded in the event log."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import onnxkv
from onnxkv import InputError
from onnxkv.runtime import prompt_chunk as PC
from onnxkv.zoo import embedded
from onnxkv.zoo.builders import MICRO, build_model


def _products(*widths):
    """Op stand-ins: a packed product per width (packed [P, K, 16]), and a block-quantized one (k)."""
    ops = [SimpleNamespace(packed=np.empty((1, k, 16), np.float32)) for k in widths[:-1]]
    return [*ops, SimpleNamespace(k=widths[-1]), SimpleNamespace(name="a norm")]


@pytest.mark.parametrize(
    "widths,block,want",
    [
        ((1024, 2816), None, 256),  # the small builder model: 3 MiB / (2816 * 4 B) = 279 -> 256
        ((128, 384), None, PC.MAX_CHUNK),  # the embedded model: capped
        ((4096, 11008), None, PC.MIN_CHUNK),  # a 7B model: at least MIN_CHUNK rows
        ((1024, 2816), 48, 240),  # whole pages of 48 tokens
        ((1024, 2816), 2048, 2048),  # a page larger than the chunk: one page
        ((1024, 1000), None, 768),  # multiples of ALIGN
    ],
)
def test_chunk_from_the_widest_product_input(widths, block, want):
    assert PC.prompt_chunk(_products(*widths), block) == want


def test_no_product_takes_the_largest_chunk():
    assert PC.widest_product_input([SimpleNamespace()]) is None
    assert PC.prompt_chunk([], None) == PC.MAX_CHUNK


def test_session_prompt_chunk():
    session = onnxkv.Session(embedded.embedded_model_dir(), threads=1)
    assert session.prompt_chunk() == PC.MAX_CHUNK == session.prompt_chunk("contiguous")
    assert session.prompt_chunk(onnxkv.CacheConfig("paged", block_size=48)) == PC.MAX_CHUNK // 48 * 48
    with pytest.raises(InputError, match=r"Session.prompt_chunk: cache must be .* got 'tensor'"):
        session.prompt_chunk("tensor")


def test_generate_auto_chunks_as_the_session_says(monkeypatch):
    """A prompt longer than the session's chunk runs in chunks of it, with the tokens of the whole prompt,
    and the log says so."""
    monkeypatch.setattr(PC, "MIN_CHUNK", 32)
    monkeypatch.setattr(PC, "MAX_CHUNK", 32)
    session = onnxkv.Session(build_model("gqa", MICRO), threads=1, events=True)
    assert session.prompt_chunk() == 32
    prompt = np.random.default_rng(3).integers(3, MICRO.vocab_size, (1, 100))
    auto = onnxkv.generate(session, prompt, 6, eos_token_id=[])
    chunked = [e for e in session.events if e.action == "prompt_chunk"]
    assert [e.extra for e in chunked] == [{"chunk": 32, "prompt_tokens": 100, "chunks": 4}]
    whole = onnxkv.generate(session, prompt, 6, eos_token_id=[], prefill_chunk=None)
    np.testing.assert_array_equal(auto.tokens, whole.tokens)
    assert len([e for e in session.events if e.action == "prompt_chunk"]) == 1  # the whole prompt: no event
    with pytest.raises(InputError, match="prefill_chunk"):
        onnxkv.generate(session, prompt, 2, prefill_chunk="whole")
