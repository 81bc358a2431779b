"""Engine.run over random requests (lengths, limits, end ids, sampling shared, mixed with greedy rows or each
row's own, some added after a
few steps, a pool small enough to pause some): every request's tokens are what ``generate`` makes for it
alone, whether its decode steps ran one by one or in the compiled loop (Engine.run's shortcut)."""

from __future__ import annotations

import numpy as np
from fuzzing import examples
from state_steps import count_decode_steps

import onnxkv
from onnxkv.zoo import embedded

MODEL = str(embedded.embedded_model_dir())


def _alone(session, request, sampling: dict) -> list[int]:
    out = onnxkv.generate(
        session, request.prompt[None], request.max_new_tokens, cache=onnxkv.CacheConfig("paged", block_size=16),
        prefill_chunk=request.chunk, eos_token_id=request.eos, **sampling,
    )  # fmt: skip
    return out.tokens[0].tolist()


def test_random_requests_run_equal_generate_alone(monkeypatch):
    ran = count_decode_steps(monkeypatch)
    session = onnxkv.Session(MODEL, threads=2)
    seed = 62
    rng = np.random.default_rng(seed)
    for case in range(examples(6)):
        pages = int(rng.choice([0, 12, 24]))
        cache = onnxkv.CacheConfig("paged", block_size=16, **({"max_pages": pages} if pages else {}))
        engine = onnxkv.Engine(session, cache=cache)
        shared = {"do_sample": True, "temperature": float(rng.uniform(0.6, 1.2)), "top_k": int(rng.integers(0, 40))}
        mode = str(rng.choice(["greedy", "sampled", "mixed", "own"]))
        eos = [int(x) for x in rng.integers(3, 256, int(rng.integers(0, 3)))]
        requests, sampling = [], {}
        for i in range(int(rng.integers(1, 6))):
            if i and rng.random() < 0.3:
                for _ in range(int(rng.integers(1, 4))):
                    engine.step()
            kw = {} if mode == "greedy" or (mode in ("mixed", "own") and rng.random() < 0.5) else dict(shared)
            if kw and mode == "own":  # each sampled row its own parameters
                kw.update(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(0, 40)))
                kw["top_p"] = float(rng.uniform(0.5, 1.0)) if rng.random() < 0.5 else None
            if kw:
                kw["seed"] = int(rng.integers(1 << 30))
            ids = rng.integers(3, 256, int(rng.integers(1, 40)))
            own = eos if rng.random() < 0.8 else [int(rng.integers(3, 256))]
            r = engine.add_request(ids, int(rng.integers(1, 40)), eos_token_id=own, **kw)
            sampling[r.id] = kw
            requests.append(r)
        engine.run()
        where = f"seed {seed}, case {case}: {mode}, {len(requests)} requests, max_pages {pages or None}"
        for r in requests:
            assert r.finished in ("eos", "length"), where
            assert r.tokens == _alone(session, r, sampling[r.id]), f"{where}: request {r.id}"
        engine.close()
    assert sum(ran) > 0  # some cases took the loop


def test_rows_of_their_own_sampling_decode_in_the_loop(monkeypatch):
    """Greedy rows and rows sampling with their own temperature, top_k and top_p run their decode steps in
    one compiled loop, each row's tokens what generate makes for it alone."""
    ran = count_decode_steps(monkeypatch)
    session = onnxkv.Session(MODEL, threads=2)
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16))
    rng = np.random.default_rng(7)
    kinds = [{}, {"do_sample": True, "temperature": 0.7, "top_k": 5, "seed": 1},
             {"do_sample": True, "temperature": 1.3, "top_p": 0.9, "seed": 2}, {}]  # fmt: skip
    requests = [
        engine.add_request(rng.integers(3, 256, 6 + i), 24, eos_token_id=[], **kw) for i, kw in enumerate(kinds)
    ]
    engine.run()
    assert max(ran) >= 20  # the decode steps after the prompts ran in C
    for r, kw in zip(requests, kinds, strict=True):
        assert r.tokens == _alone(session, r, kw), f"request {r.id}"
    engine.close()


def test_rows_of_their_own_end_ids_decode_in_the_loop(monkeypatch):
    """Rows with different end ids run their decode steps in one compiled loop, each ending at its own."""
    session = onnxkv.Session(MODEL, threads=2)
    cache = onnxkv.CacheConfig("paged", block_size=16)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 256, 5 + 3 * i) for i in range(3)]
    free = onnxkv.Engine(session, cache=cache)
    unbounded = [free.add_request(p, 30, eos_token_id=[]) for p in prompts]
    free.run()
    ends = [[unbounded[0].tokens[8]], [], [unbounded[2].tokens[14], 1]]  # row 1 runs to its limit
    ran = count_decode_steps(monkeypatch)
    engine = onnxkv.Engine(session, cache=cache)
    requests = [engine.add_request(p, 30, eos_token_id=e) for p, e in zip(prompts, ends, strict=True)]
    engine.run()
    assert max(ran) >= 8  # the three rows looped together until row 0 ended
    for r, e, u in zip(requests, ends, unbounded, strict=True):
        cut = next((i for i, t in enumerate(u.tokens) if t in e), len(u.tokens) - 1)
        assert r.tokens == u.tokens[: cut + 1] and r.finished == ("eos" if e and cut < 29 else "length"), r.id
    free.close()
    engine.close()
