"""Many requests with random arrivals, lengths, sampling and aborts on a small page pool (prefix hits,
quantization and pauses all happen): every request ends as it should, and at the end the pool audit is
whole and every page byte is back with the allocator."""

from __future__ import annotations

import numpy as np

import onnxkv
from onnxkv.zoo import embedded

MODEL = str(embedded.embedded_model_dir())
WORDS = ["def ", "return ", "x", " = ", "(self)", "\n", "    ", "class ", "import ", "for i in ", "range(3)", ":"]


def _prompt(rng) -> np.ndarray:
    shared = "def main():\n    " if rng.random() < 0.5 else ""  # half share a prefix
    text = shared + "".join(rng.choice(WORDS) for _ in range(int(rng.integers(1, 30))))
    return np.array(embedded.encode(text), np.int64)


def test_random_requests_and_aborts_leave_the_pool_whole():
    rng = np.random.default_rng(2026)
    session = onnxkv.Session(MODEL, threads=1, events=True)
    engine = onnxkv.Engine(
        session, cache=onnxkv.CacheConfig("paged", block_size=16), max_batch_tokens=96, max_pages=48,
        max_cache_bytes=40 * 32768, prefix_pages=12,
    )  # fmt: skip
    requests, aborted, seen, hits = [], set(), set(), 0
    for _ in range(300):
        for _ in range(int(rng.poisson(1.0))):
            kw = (
                {"do_sample": True, "temperature": 0.8, "seed": int(rng.integers(1 << 30))}
                if rng.random() < 0.3
                else {}
            )
            requests.append(engine.add_request(_prompt(rng), int(rng.integers(0, 24)), **kw))
        live = engine.active
        if live and rng.random() < 0.15:
            victim = live[int(rng.integers(len(live)))]
            engine.abort(victim)
            aborted.add(victim.id)
        engine.step()
        popped = engine.pop_finished()  # let go as a server would: the engine lists active requests only
        assert all(r.finished is not None for r in popped) and all(r.finished is None for r in engine.requests)
        seen.update(e.action for e in session.events if e.action.startswith("preempt"))
        hits += sum(1 for e in session.events if e.action == "prefix_lookup" and e.extra["prefix_hit_tokens"])
        session.events.clear()
    engine.run()
    assert seen == {"preempt", "preempt_quantize"} and hits > 20  # every relief ran, prefixes were shared
    assert len(requests) > 200 and engine.describe()["requests"] == len(requests)
    assert [r.id for r in requests] == list(range(len(requests)))
    for r in requests:
        if r.id in aborted:
            assert r.finished == "aborted"
        else:
            assert r.finished in ("length", "eos") and (len(r.tokens) == r.max_new_tokens or r.finished == "eos")
    pool = engine._batch.pool
    pool.audit()
    engine.close()
    assert pool.live_pages == 0 and pool.committed_bytes == 0
    pool.audit()
    stats = pool.allocator.stats()
    assert stats.live == 0 and stats.allocations == stats.frees
