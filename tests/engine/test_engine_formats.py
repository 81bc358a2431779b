"""An engine over pages a kv_format converts when full: every request gets the tokens generate gives it alone
over the same cache, prefix hits and pauses included, because its runs end where generate's runs end and a
prefix hit is taken only where its pages are in the formats generate's state holds there."""

from __future__ import annotations

import numpy as np
import pytest

import onnxkv
from onnxkv.cache.policy import ResidualPolicy
from onnxkv.zoo import embedded

MODEL = str(embedded.embedded_model_dir())
BASE = "def compute(values):\n    total = 0\n    for v in values:\n"
TAILS = [
    "        total += v\n",
    "        if v:\n",
    "        print(v)\n",
    "        yield v\n",
    "        total -= v * 2\n",
]


@pytest.fixture(scope="module")
def session():
    return onnxkv.Session(MODEL, threads=1)


def _prompts() -> list[np.ndarray]:
    """Prompts sharing prefixes of 57 to 122 tokens: hits end inside 32-token chunks and on their edges."""
    return [np.array(embedded.encode(BASE * (1 + i % 2) + t), np.int64) for i, t in enumerate(TAILS)]


def _alone(session, r, cache) -> list[int]:
    out = onnxkv.generate(
        session, r.prompt[None], r.max_new_tokens, cache=cache, prefill_chunk=r.chunk, eos_token_id=r.eos
    )
    return out.tokens[0].tolist()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("half_the_pages", [False, True])
def test_requests_get_their_tokens_alone_with_prefix_hits_and_pauses(session, fmt, block_size, half_the_pages):
    cache = onnxkv.CacheConfig("paged", block_size=block_size, kv_format=fmt)
    prompts, new = _prompts(), 40
    pages = [-(-(p.size + new) // block_size) for p in prompts]
    max_pages = max(sum(pages) // 2, max(pages)) if half_the_pages else None
    engine = onnxkv.Engine(session, cache=cache, max_batch_tokens=32, max_pages=max_pages)
    requests = []
    for i, p in enumerate(prompts):
        requests.append(engine.add_request(p, new, eos_token_id=[]))
        if i % 2:
            engine.step()
    engine.run()
    assert sum(r.prefix_hit_tokens for r in requests) > 0
    assert (sum(r.preemptions for r in requests) > 0) == half_the_pages
    for r in requests:
        assert r.chunk == 32 and r.tokens == _alone(session, r, cache), r.id
    engine._batch.pool.audit()
    engine.close()


@pytest.mark.parametrize("fmt, hit", [(None, 48), ("int8", 32), (ResidualPolicy("int8", "int8", 8), 32)])
def test_a_prefix_hit_ends_where_a_run_of_the_request_alone_ends(session, fmt, hit):
    """The two prompts share 61 tokens, 3 pages of 16.  Over converted pages the second request takes 2:
    generate alone runs its tokens 32..63 in one run, whose queries read tokens 32..47 as computed there,
    native (the residual policy's page 1 too: it is due at 64 + 8)."""
    cache = onnxkv.CacheConfig("paged", block_size=16, kv_format=fmt)
    engine = onnxkv.Engine(session, cache=cache, max_batch_tokens=32)
    first = engine.add_request(np.array(embedded.encode(BASE + TAILS[0]), np.int64), 4, eos_token_id=[])
    engine.run()
    second = engine.add_request(np.array(embedded.encode(BASE + "    return total\n"), np.int64), 4, eos_token_id=[])
    engine.step()
    assert second.prefix_hit_tokens == hit
    assert second.prompt_done == (64 if hit == 32 else 74)  # then it runs to 64 and the rest, as alone
    engine.run()
    for r in (first, second):
        assert r.tokens == _alone(session, r, cache)
    engine.close()


def test_a_paused_request_reruns_its_tokens_in_runs_that_end_where_pages_converted(session):
    cache = onnxkv.CacheConfig("paged", block_size=4, kv_format="int8")
    engine = onnxkv.Engine(session, cache=cache, max_batch_tokens=32, prefix_caching=False)
    r = engine.add_request(np.array(embedded.encode(BASE), np.int64), 12, eos_token_id=[])  # 57 tokens
    while len(r.tokens) < 10:
        engine.step()
    # as a pause leaves it: the prompt and the 9 tokens it had made to run again, none of them cached
    r._seq, r.prompt_done = np.concatenate([r.prompt, np.asarray(r.tokens[:-1], np.int64)]), 0
    sizes = []
    while r.prompt_done < r._seq.size:
        sizes.append(r.next_tokens)
        r.prompt_done += sizes[-1]
    # the prompt in 32-token chunks and its end (57), then pages of 4 fall due at 60 and 64, and 66 is the end
    assert sizes == [32, 25, 3, 4, 2]
    engine.close()


def test_a_paused_request_reruns_its_tokens_within_the_step_budget(session):
    """Its runs end where pages fall due and are never wider than its chunk (at most max_batch_tokens): a
    run of 4 tokens up to the next page would never fit a budget of 2, and the request, holding pages
    others wait for, would stall the engine."""
    cache = onnxkv.CacheConfig("paged", block_size=4, kv_format="int8")
    prompts = [np.array(embedded.encode(t), np.int64) for t in ("def f(x):\n", "def g(y):\n")]
    engine = onnxkv.Engine(session, cache=cache, max_batch_tokens=2, max_pages=20)  # 18 and 10 pages alone
    first = engine.add_request(prompts[0], 60, eos_token_id=[])
    while len(first.tokens) < 6:
        engine.step()
    second = engine.add_request(prompts[1], 30, eos_token_id=[])  # paused after it made tokens
    for _ in range(2000):
        if not engine.active:
            break
        assert all(r.next_tokens <= r.chunk <= 2 for r in engine.active)
        engine.step()
    assert not engine.active and second.preemptions > 0
    for r in (first, second):
        assert r.tokens == _alone(session, r, cache), r.id
    engine.close()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no conversion may fail and leave a page native
@pytest.mark.parametrize("residual", [4, 8])
@pytest.mark.parametrize("new", [5, 9, 14])
def test_a_full_pool_converts_pages_the_prefix_cache_shares(session, residual, new):
    """A residual policy converts prompt pages the prefix cache already holds.  With the pool exactly as
    large as the request needs, no page is free to copy one into: the cache lets go of them instead, and
    the request gets its tokens alone (not an error, not a page left native)."""
    cache = onnxkv.CacheConfig("paged", block_size=4, kv_format=ResidualPolicy("int8", "int8", residual))
    prompt = _prompts()[0][:20]
    need = -(-(prompt.size + new - 1) // 4)
    engine = onnxkv.Engine(session, cache=cache, max_pages=need)
    r = engine.add_request(prompt, new, eos_token_id=[])
    engine.run()
    assert r.finished == "length" and r.tokens == _alone(session, r, cache)
    engine.close()


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("max_pages", [10, 12, 14])
def test_a_request_converting_pages_another_holds_pauses_the_later_one(session, max_pages):
    """Two requests share prompt pages a residual policy converts later: converting them for the first
    copies them, and in a tight pool the later request is paused to make that room; both get their
    tokens alone."""
    cache = onnxkv.CacheConfig("paged", block_size=4, kv_format=ResidualPolicy("int4", "int4", 8))
    p = _prompts()[0]
    engine = onnxkv.Engine(session, cache=cache, max_pages=max_pages)
    first = engine.add_request(p[:14], 24, eos_token_id=[])
    engine.step()
    second = engine.add_request(np.concatenate([p[:12], p[40:43]]), 24, eos_token_id=[])
    engine.run()
    assert second.preemptions > 0
    for r in (first, second):
        assert r.finished == "length" and r.tokens == _alone(session, r, cache), r.id
    engine.close()
