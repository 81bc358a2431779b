"""onnxkv.speculative_generate: greedy identity with generate, rollback without copies, the rejection rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import onnxkv
from onnxkv import InputError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.generate.speculative import accept_or_resample, speculative_generate
from onnxkv.zoo import embedded
from onnxkv.zoo.builders import MICRO, build_model

CACHES = ["contiguous", "paged"]
FAMILIES = ["gqa", "attention", "concat"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """(target, draft): MICRO models of one family with different random weights."""
    return (
        onnxkv.Session(build_model(request.param, MICRO, seed=3), threads=1),
        onnxkv.Session(build_model(request.param, MICRO, seed=4), threads=1),
    )


@pytest.fixture(scope="module")
def emb():
    if not embedded.embedded_draft_dir().exists():
        pytest.skip("embedded draft model not built")
    return (
        onnxkv.Session(embedded.embedded_model_dir(), threads=1),
        onnxkv.Session(embedded.embedded_draft_dir(), threads=1),
    )


def _prompt(seed: int, n: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MICRO.vocab_size, (1, n))


# -- greedy identity ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["lookup", "draft", "self"])
@pytest.mark.parametrize("cache", CACHES)
def test_greedy_equals_generate_on_builder_models(pair, mode, cache):
    target, other = pair
    draft = {"lookup": None, "draft": other, "self": target}[mode]
    for seed, k in ((1, 4), (2, 3)):
        ids = _prompt(seed)
        want = onnxkv.generate(target, ids, 30, eos_token_id=[])
        got = speculative_generate(
            target, ids, draft=draft, num_draft_tokens=k, max_new_tokens=30, eos_token_id=[], cache=cache
        )
        np.testing.assert_array_equal(got.sequences, want.sequences)
        assert got.sequences.dtype == np.int64 and got.new_tokens == 30
        assert got.accepted <= got.proposed
        assert got.target_runs == 1 + (30 - 1 - got.accepted)  # each run emits its accepted tokens + 1
        if mode == "self":
            assert got.acceptance_rate == 1.0 and got.proposed > 0
        if draft is None:
            assert got.draft_runs == 0


@pytest.mark.parametrize("mode", ["lookup", "draft"])
def test_greedy_equals_generate_on_embedded_model(emb, mode):
    target, draft = emb
    ids = np.array([embedded.encode("The ")])
    want = onnxkv.generate(target, ids, 48)
    got = speculative_generate(target, ids, draft=draft if mode == "draft" else None, max_new_tokens=48)
    np.testing.assert_array_equal(got.sequences, want.sequences)
    assert got.proposed > 0
    if mode == "draft":
        assert got.draft_runs > 1 and got.accepted > 0
    else:
        assert got.draft_runs == 0


def test_draft_catches_up_one_token_in_its_greedy_steps(emb, monkeypatch):
    """A one-token catch-up (the target's correction) is the first of the draft's greedy steps, not a run of
    its own: the draft's own runs only catch up two tokens, after a proposal accepted whole."""
    import importlib

    stepper = importlib.import_module("onnxkv.generate.verification").Stepper
    target, draft = emb
    fed = []
    feed = stepper.feed

    def counted(self, tokens):
        fed.append((self.role, tokens.shape[0]))
        return feed(self, tokens)

    monkeypatch.setattr(stepper, "feed", counted)
    ids = np.array([embedded.encode("The ")])
    got = speculative_generate(target, ids, draft=draft, num_draft_tokens=2, max_new_tokens=48, eos_token_id=[])
    np.testing.assert_array_equal(got.sequences, onnxkv.generate(target, ids, 48, eos_token_id=[]).sequences)
    drafts = [n for role, n in fed if role == "draft"]
    assert 0 < got.accepted < got.proposed
    assert all(n == 2 for n in drafts)
    assert len(drafts) < len([n for role, n in fed if role == "target"])


def test_prompt_lookup_accepts_on_a_repetitive_prompt(emb):
    target, _ = emb
    ids = np.array([embedded.encode("def add(a, b):\n    return a + b\n\n" * 4)])
    got = speculative_generate(target, ids, max_new_tokens=32, num_draft_tokens=8)
    np.testing.assert_array_equal(got.sequences, onnxkv.generate(target, ids, 32).sequences)
    assert got.acceptance_rate > 0
    assert got.target_runs < got.new_tokens  # several tokens per target run


# -- rollback ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", CACHES)
def test_rollback_copies_no_cache_bytes(cache):
    model = build_model("gqa", MICRO, seed=3)
    target = onnxkv.Session(model, threads=1, events=True)
    draft = onnxkv.Session(build_model("gqa", MICRO, seed=4), threads=1, events=True)
    config = onnxkv.CacheConfig(cache, capacity=64 if cache == "contiguous" else None)
    got = speculative_generate(target, _prompt(5), draft=draft, max_new_tokens=40, eos_token_id=[], cache=config)
    assert got.accepted < got.proposed  # rejections happened: both caches were truncated
    np.testing.assert_array_equal(
        got.sequences, onnxkv.generate(onnxkv.Session(model, threads=1), _prompt(5), 40, eos_token_id=[]).sequences
    )
    for sess in (target, draft):
        writes = [e for e in sess.events if e.action == "cache_write"]
        assert writes
        assert all(e.prefix_copied_bytes == 0 and e.cow_copied_bytes == 0 for e in writes), [
            (e.step, e.prefix_copied_bytes, e.cow_copied_bytes) for e in writes
        ]


def test_feed_builder_rewind_replays_the_same_feeds():
    sess = onnxkv.Session(build_model("attention", MICRO, seed=3), threads=1)
    ids = _prompt(8, 5)
    a = FeedBuilder(sess.plan.inputs, sess.model, ids, np.array([5]), 0, thread_cache=False)
    b = FeedBuilder(sess.plan.inputs, sess.model, ids, np.array([5]), 0, thread_cache=False)
    a.first(), b.first()
    a.next(np.array([[1, 2, 3]]), None)
    a.rewind(6)
    b.next(np.array([[1]]), None)
    assert a.total == b.total == 6
    fa, fb = a.next(np.array([[9, 4]]), None), b.next(np.array([[9, 4]]), None)
    assert fa.keys() == fb.keys()
    for name in fa:
        np.testing.assert_array_equal(fa[name], fb[name])
    for bad in (9, -1, 2.0):
        with pytest.raises(InputError, match="FeedBuilder.rewind"):
            a.rewind(bad)


# -- EOS and budget ---------------------------------------------------------------------------------
def test_eos_inside_an_accepted_run_stops_there(pair):
    target, _ = pair
    ids = _prompt(6)
    free = speculative_generate(target, ids, draft=target, num_draft_tokens=4, max_new_tokens=20, eos_token_id=[])
    new = free.sequences[0, ids.shape[1] :].tolist()
    # Positions 1..4 of the new tokens are the first proposal, all accepted (the draft is the target).
    fresh = [i for i in range(1, 5) if new.index(new[i]) == i]  # not emitted before position i
    assert fresh, new
    idx = fresh[0]
    got = speculative_generate(target, ids, draft=target, num_draft_tokens=4, max_new_tokens=20, eos_token_id=new[idx])
    assert got.new_tokens == idx + 1
    np.testing.assert_array_equal(got.sequences, free.sequences[:, : ids.shape[1] + idx + 1])
    assert got.accepted == got.proposed and got.accepted >= idx


@pytest.mark.parametrize("mode", ["lookup", "draft"])
def test_max_new_tokens_is_exact(pair, mode):
    target, other = pair
    ids = np.tile(_prompt(9, 3), 3)  # repetitive: prompt lookup proposes from the start
    draft = other if mode == "draft" else None
    for n in (0, 1, 2, 3, 5, 6):
        got = speculative_generate(target, ids, draft=draft, num_draft_tokens=4, max_new_tokens=n, eos_token_id=[])
        assert got.new_tokens == n and got.sequences.shape == (1, ids.shape[1] + n)
        np.testing.assert_array_equal(got.sequences, onnxkv.generate(target, ids, n, eos_token_id=[]).sequences)
    one = speculative_generate(target, ids, draft=draft, max_new_tokens=1, eos_token_id=[])
    assert one.target_runs == 1 and one.proposed == 0


def test_callback_sees_every_token(pair):
    target, other = pair
    seen = []
    got = speculative_generate(
        target,
        _prompt(4),
        draft=other,
        max_new_tokens=12,
        eos_token_id=[],
        callback=lambda step, tok: seen.append((step, int(tok[0]))),
    )
    assert [s for s, _ in seen] == list(range(12))
    assert [t for _, t in seen] == got.sequences[0, 7:].tolist()


# -- sampling -----------------------------------------------------------------------------------------
def _chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn where p is 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


#: Chi-square 99.9% quantile for 4 degrees of freedom (5 outcomes).
CHI2_4_999 = 18.47


@pytest.mark.parametrize(
    "q",
    [
        np.array([0.05, 0.4, 0.3, 0.05, 0.2]),  # a draft that disagrees with p
        np.array([0.0, 0.0, 1.0, 0.0, 0.0]),  # prompt lookup: one-hot
    ],
)
def test_accept_or_resample_outputs_the_target_distribution(q):
    p = np.array([0.1, 0.15, 0.05, 0.5, 0.2])
    rng = np.random.default_rng(1234)
    n = 20000
    counts = np.zeros(5)
    accepted = 0
    for _ in range(n):
        x = int(rng.choice(5, p=q))
        ok, tok = accept_or_resample(p, q, x, rng)
        accepted += ok
        assert not ok or tok == x
        counts[tok] += 1
    assert _chi_square(counts, p) < CHI2_4_999
    # The acceptance probability is sum(min(p, q)).
    assert abs(accepted / n - np.minimum(p, q).sum()) < 0.02


def test_accept_or_resample_rejects_tokens_the_target_excludes():
    p = np.array([0.5, 0.5, 0.0])
    q = np.array([0.2, 0.2, 0.6])
    rng = np.random.default_rng(7)
    for _ in range(200):
        ok, tok = accept_or_resample(p, q, 2, rng)
        assert not ok and tok in (0, 1)


@pytest.mark.parametrize("mode", ["lookup", "draft", "self"])
def test_sampling_is_repeatable_and_valid(pair, mode):
    target, other = pair
    draft = {"lookup": None, "draft": other, "self": target}[mode]
    ids = np.tile(_prompt(2, 3), 2)
    kw = dict(draft=draft, max_new_tokens=24, eos_token_id=[], do_sample=True, temperature=0.9, top_k=40, top_p=0.95)
    a = speculative_generate(target, ids, seed=5, **kw)
    b = speculative_generate(target, ids, seed=5, **kw)
    np.testing.assert_array_equal(a.sequences, b.sequences)
    assert a.new_tokens == 24 and (a.sequences >= 0).all() and (a.sequences < MICRO.vocab_size).all()
    others = [speculative_generate(target, ids, seed=s, **kw).sequences for s in range(6, 9)]
    assert any(not np.array_equal(a.sequences, o) for o in others)
    one = speculative_generate(target, ids, seed=5, **{**kw, "max_new_tokens": 1})
    plain = onnxkv.generate(
        target, ids, 1, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=5, eos_token_id=[]
    )
    np.testing.assert_array_equal(one.sequences, plain.sequences)  # the first token is drawn as generate draws it
    if mode == "self":
        assert a.acceptance_rate > 0.9  # p == q up to rounding: almost every proposal is accepted


def test_sampled_eos_ends_generation(pair):
    target, other = pair
    ids = _prompt(3)
    free = speculative_generate(target, ids, draft=other, max_new_tokens=16, eos_token_id=[], do_sample=True, seed=1)
    eos = int(free.sequences[0, ids.shape[1] + 3])
    got = speculative_generate(target, ids, draft=other, max_new_tokens=16, eos_token_id=eos, do_sample=True, seed=1)
    new = got.sequences[0, ids.shape[1] :].tolist()
    assert new[-1] == eos and eos not in new[:-1] and len(new) <= 4


# -- errors ------------------------------------------------------------------------------------------
def test_argument_errors(pair):
    target, other = pair
    ids = _prompt(1)
    bad = [
        (dict(input_ids=np.vstack([ids, ids])), "batch 1"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(prompt_lookup_ngram=0), "prompt_lookup_ngram"),
        (dict(cache="ring"), "cache"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(eos_token_id=MICRO.vocab_size), "eos_token_id"),
    ]
    for kw, match in bad:
        args = {"input_ids": ids, **kw}
        with pytest.raises(InputError, match=match):
            speculative_generate(target, draft=other, **args)


@pytest.mark.parametrize("cache", CACHES)
def test_a_huge_num_draft_tokens_is_capped_by_the_budget(pair, cache):
    """num_draft_tokens past the states' limits (2**31 - 1 positions kept for a truncate) proposes at most
    the budget, as a contiguous cache always did; a paged one used to raise naming keep_for_truncate."""
    target, other = pair
    ids = _prompt(5)
    want = onnxkv.generate(target, ids, 8, eos_token_id=[], cache=cache).sequences
    for draft in (None, other):
        got = speculative_generate(
            target, ids, draft=draft, num_draft_tokens=2**31 - 1, max_new_tokens=8, eos_token_id=[], cache=cache
        )
        np.testing.assert_array_equal(got.sequences, want)


def test_draft_with_another_vocabulary_is_rejected():
    target = onnxkv.Session(build_model("gqa", MICRO, seed=3), threads=1)
    draft = onnxkv.Session(build_model("gqa", dataclasses.replace(MICRO, vocab_size=50), seed=3), threads=1)
    with pytest.raises(InputError, match="vocabulary"):
        speculative_generate(target, _prompt(1) % 50, draft=draft, max_new_tokens=4)


def test_static_cache_cannot_be_truncated():
    ts = onnxkv.Session(build_model("tensorscatter", MICRO, seed=3), threads=1)
    gqa = onnxkv.Session(build_model("gqa", MICRO, seed=3), threads=1)
    with pytest.raises(InputError, match="tensor_scatter"):
        speculative_generate(ts, _prompt(1), max_new_tokens=4)
    with pytest.raises(InputError, match="draft model's cache convention is 'tensor_scatter'"):
        speculative_generate(gqa, _prompt(1), draft=ts, max_new_tokens=4)


# -- tree verification ---------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [(1, 4), (2, 3), (4, 2), (3, 15)])
def test_tree_greedy_equals_generate_and_verifies_every_branch_in_one_forked_run(pair, tree, monkeypatch):
    target, other = pair
    k, depth = tree
    shapes = []
    real = onnxkv.State.run

    def run(state, feeds, *args, **kw):
        if state.session is target:
            shapes.append(feeds[target.model.io.input_ids].shape)
        return real(state, feeds, *args, **kw)

    monkeypatch.setattr(onnxkv.State, "run", run)
    for seed in (1, 2):
        ids = _prompt(seed)
        want = onnxkv.generate(target, ids, 30, eos_token_id=[])
        shapes.clear()
        got = speculative_generate(target, ids, draft=other, max_new_tokens=30, eos_token_id=[], tree=tree)
        np.testing.assert_array_equal(got.sequences, want.sequences)
        assert got.new_tokens == 30 and got.target_runs == len(shapes)
        # the prompt, then one run per step of k rows (fewer tokens once the budget is short; with no budget
        # left for a proposal, one token)
        assert shapes[0] == ids.shape
        assert all((b == k and 2 <= s <= depth + 1) or (b, s) == (1, 1) for b, s in shapes[1:]), shapes
        assert got.target_runs == 1 + (30 - 1 - got.accepted)


def test_tree_greedy_equals_generate_on_the_embedded_pair_with_an_eos(emb):
    target, draft = emb
    ids = np.array([embedded.encode("The ")])
    free = onnxkv.generate(target, ids, 60, eos_token_id=[]).tokens[0]
    eos = int(free[40])
    want = onnxkv.generate(target, ids, 60, eos_token_id=eos)
    for tree in ((3, 4), (2, 6)):
        got = speculative_generate(target, ids, draft=draft, max_new_tokens=60, eos_token_id=eos, tree=tree)
        np.testing.assert_array_equal(got.sequences, want.sequences)


def test_tree_argument_errors(pair):
    target, other = pair
    ids = _prompt(1)
    for tree, match in (
        ((0, 3), "tree must be"),
        ((2, 0), "tree must be"),
        ((17, 2), "tree must be"),
        ((2, 16), "tree must be"),
        ((2.0, 3), "tree must be"),
        ((True, 3), "tree must be"),
        ((2, 3, 4), "tree must be"),
        (3, "tree must be"),
    ):
        with pytest.raises(InputError, match=match):
            speculative_generate(target, ids, draft=other, tree=tree)
    with pytest.raises(InputError, match="needs a draft model"):
        speculative_generate(target, ids, tree=(2, 3))
    with pytest.raises(InputError, match="do_sample must be False"):
        speculative_generate(target, ids, draft=other, tree=(2, 3), do_sample=True)
    with pytest.raises(InputError, match="cache must be 'paged' or None, got 'contiguous'"):
        speculative_generate(target, ids, draft=other, tree=(2, 3), cache="contiguous")


def _windowed(seed: int, window: int = 8) -> onnxkv.Session:
    """A MICRO GroupQueryAttention model whose attention sees the last ``window`` positions."""
    model = build_model("gqa", MICRO, seed=seed)
    for node in model.graph.node:
        for a in node.attribute:
            if node.op_type == "GroupQueryAttention" and a.name == "local_window_size":
                a.i = window
    return onnxkv.Session(model, threads=1)


@pytest.mark.parametrize("k", [4, 7])
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_sliding_window_with_paged_caches_keeps_what_a_step_takes_back(k, block_size):
    """A paged state frees the pages behind the window after each run: a verification that took back
    tokens then raised StateError (and tree= never worked on such models).  The states keep k + 1
    positions behind the window, and every mode equals generate."""
    target, draft = _windowed(3), _windowed(4)
    ids = np.random.default_rng(0).integers(0, MICRO.vocab_size, (1, 20))
    want = onnxkv.generate(target, ids, 40, eos_token_id=[]).sequences
    cache = onnxkv.CacheConfig("paged", block_size=block_size)
    for kw in ({}, {"draft": draft}, {"draft": draft, "tree": (2, k)}):
        got = speculative_generate(
            target, ids, max_new_tokens=40, eos_token_id=[], num_draft_tokens=k, cache=cache, **kw
        )
        np.testing.assert_array_equal(got.sequences, want, err_msg=str(kw))


def test_keep_for_truncate_lets_a_windowed_state_take_back_what_it_keeps():
    sess = _windowed(3)
    ids = np.random.default_rng(1).integers(0, MICRO.vocab_size, (1, 40))
    for keep in (0, 6):
        state = sess.new_state(cache=onnxkv.CacheConfig("paged", block_size=4))
        state.keep_for_truncate(keep)
        builder = FeedBuilder(sess.plan.inputs, sess.model, ids, np.array([40]), 0, thread_cache=False)
        state.run(builder.first()[0], [sess.model.io.logits])
        if keep:
            state.truncate(40 - keep)  # 8 visible + 6 kept behind the window
            assert state.length == 34
        else:
            with pytest.raises(onnxkv.StateError, match="evicted by the sliding window"):
                state.truncate(34)
        for bad in (-1, 1.5, True, 2**31):
            with pytest.raises(InputError, match="State.keep_for_truncate"):
                state.keep_for_truncate(bad)
        state.close()
    with pytest.raises(onnxkv.StateError, match="needs a paged state"):
        sess.new_state().keep_for_truncate(2)


def test_tree_branches_start_from_the_most_likely_tokens_in_a_stable_sorts_order():
    """_most_likely (the kernel for float32/float16 rows without NaN, else the sort) equals a stable
    descending sort's first k: ties to the lower id, NaN last, k past the vocabulary."""
    from onnxkv.generate.speculative import _most_likely

    rng = np.random.default_rng(0)
    rows = [
        rng.standard_normal(300).astype(np.float32),
        rng.integers(-2, 2, 300).astype(np.float32),  # ties everywhere
        rng.integers(-2, 2, 300).astype(np.float16),
        np.where(rng.random(300) < 0.1, np.nan, rng.standard_normal(300)).astype(np.float32),
        rng.standard_normal(300),  # float64
        np.array([0.0, -0.0, 1.0, -np.inf], np.float32),
    ]
    for x in rows:
        for k in (1, 3, 4, 500):
            assert _most_likely(x, k) == np.argsort(-x, kind="stable")[:k].tolist(), (x.dtype, k)
