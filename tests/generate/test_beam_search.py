"""onnxkv.generate.beam_search: transformers' beam-search rules, the paged and tensor drivers.

The scorer is tested on hand-made log-probability tables; the drivers against
beams recorded from transformers (tests/data, scripts/make_fixtures.py), a
plain reference search over full-recompute logits, and each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _beam_helpers import full_logprobs, reference_beam_search

import onnxkv
from onnxkv import InputError
from onnxkv.generate.beam_search import BeamScorer, _top, beam_search, log_softmax
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.zoo.builders import MICRO, build_model

DATA = Path(__file__).resolve().parent.parent / "data"
REF = np.load(DATA / "tiny_llama_reference.npz")
SETTINGS = json.loads(str(REF["beam_settings"]))
FIXTURES = {"genai": DATA / "genai_tiny_llama", "torch": DATA / "torch_tiny_llama" / "model.onnx"}
EOS = 4


@pytest.fixture
def paged() -> str:
    """The paged cache mode (a fixture so tests can ask for it by name)."""
    return "paged"


@pytest.fixture(params=["tensor", "paged"])
def cache(request) -> str:
    """Each cache mode in turn."""
    return request.getfixturevalue(request.param) if request.param == "paged" else request.param


# -- the scorer on hand-made tables -----------------------------------------------------------------
def _run(tables, k=2, max_new=10, lp=1.0, es=False, eos=(EOS,), batch=1):
    """Feed ``tables`` (probabilities [B*k, V] per step) until the scorer is done; return it and its outputs."""
    scorer = BeamScorer(batch, k, max_new, lp, es, list(eos), pad_token_id=9)
    outs = []
    for table in tables:
        outs.append(scorer.process(np.log(np.asarray(table, dtype=np.float64))))
        if scorer.done:
            break
    return scorer, outs


U = [0.2] * 5
# Step 0: beam 0 only.  Step 1: beam 0 ends (EOS at rank 0), beam 1 continues.
# Step 2: the best candidate continues, the EOS ranks 1 (< k): two finished.
# Step 3: nothing good: the running beams fall below the worst finished one at their length.
STORY = [
    [[0.5, 0.3, 0.1, 0.05, 0.05], U],
    [[0.05, 0.05, 0.05, 0.05, 0.8], [0.9, 0.025, 0.025, 0.025, 0.025]],
    [[0.5, 0.02, 0.02, 0.02, 0.44], U],
    [U, U],
    [U, U],
]


def test_first_step_takes_only_the_first_beam_and_breaks_ties_by_index():
    scorer, [(tokens, beam_idx)] = _run([[[0.4, 0.2, 0.2, 0.1, 0.1], U]], k=2)
    np.testing.assert_array_equal(tokens, [0, 1])  # 1 and 2 tie: the lower id wins
    np.testing.assert_array_equal(beam_idx, [0, 0])
    np.testing.assert_allclose(scorer.running_scores[0], np.log([0.4, 0.2]), rtol=1e-6)
    assert not scorer.is_finished.any() and not scorer.done


def test_eos_ranked_at_or_past_num_beams_is_ignored():
    # EOS is the third candidate (rank 2 = k): it neither finishes nor runs.
    scorer, [(tokens, _)] = _run([[[0.4, 0.3, 0.05, 0.05, 0.2], U]], k=2)
    np.testing.assert_array_equal(tokens, [0, 1])
    assert not scorer.is_finished.any()
    # EOS at rank 0 finishes, and the running beams are the next best.
    scorer, outs = _run(STORY[:2], k=2)
    tokens, beam_idx = outs[1]
    np.testing.assert_array_equal(tokens, [0, 0])
    np.testing.assert_array_equal(beam_idx, [1, 0])
    assert scorer.is_finished[0].tolist() == [True, False]
    np.testing.assert_allclose(scorer.finished_scores[0, 0], np.log(0.4) / 2, rtol=1e-6)
    np.testing.assert_array_equal(scorer.finished[0, 0, :2], [0, EOS])


@pytest.mark.parametrize("es, steps", [(True, 3), (False, 4), ("never", 5)])
def test_early_stopping_variants(es, steps):
    scorer, outs = _run(STORY, es=es)
    assert len(outs) == steps
    assert scorer.done == (es != "never")  # "never" runs out of tables instead
    tokens, scores, lengths = scorer.finalize(2)
    np.testing.assert_allclose(scores, [np.log(0.4) / 2, np.log(0.27 * 0.44) / 3], rtol=1e-6)
    np.testing.assert_array_equal(tokens, [[0, EOS, 9], [1, 0, EOS]])
    np.testing.assert_array_equal(lengths, [2, 3])


def test_length_penalty_divides_by_generated_length_to_the_power():
    scorer, _ = _run(STORY, lp=2.0, es=True)
    _, scores, _ = scorer.finalize(2)
    np.testing.assert_allclose(scores, [np.log(0.4) / 4, np.log(0.27 * 0.44) / 9], rtol=1e-6)
    scorer, _ = _run(STORY, lp=-0.5, es=True)
    _, scores, _ = scorer.finalize(2)
    assert scores[0] >= scores[1]
    np.testing.assert_allclose(
        sorted(scores, reverse=True),
        sorted([np.log(0.4) * 2**0.5, np.log(0.27 * 0.44) * 3**0.5], reverse=True),
        rtol=1e-6,
    )


def test_last_step_finishes_every_top_candidate_and_returns_n_best():
    scorer, outs = _run(STORY[:2], k=2, max_new=2)
    assert len(outs) == 2 and scorer.done and scorer.is_finished.all()
    tokens, scores, _ = scorer.finalize(2)
    np.testing.assert_array_equal(tokens, [[0, EOS], [1, 0]])
    np.testing.assert_allclose(scores, np.log([0.4, 0.27]) / 2, rtol=1e-6)
    one, score1, _ = scorer.finalize(1)
    np.testing.assert_array_equal(one, tokens[:1])
    assert score1.shape == (1,) and score1.dtype == np.float32


def test_batch_rows_are_scored_apart_and_beam_indices_are_global():
    rng = np.random.default_rng(3)
    tables = [rng.dirichlet(np.ones(7), size=6) for _ in range(4)]
    scorer, outs = _run(tables, k=3, max_new=4, eos=(), batch=2)
    for _tokens, beam_idx in outs:
        assert (beam_idx[:3] < 3).all() and (beam_idx[3:] >= 3).all()
    for b in range(2):  # each row alone gives the same hypotheses
        alone, _ = _run([t[3 * b : 3 * b + 3] for t in tables], k=3, max_new=4, eos=())
        np.testing.assert_array_equal(alone.finished[0], scorer.finished[b])
        np.testing.assert_allclose(alone.finished_scores[0], scorer.finished_scores[b], rtol=1e-6)


def test_scorer_matches_reference_on_random_tables():
    rng = np.random.default_rng(5)
    V, k, n = 6, 3, 5
    table = {}

    def lp(tokens):
        key = tuple(tokens)
        if key not in table:
            table[key] = np.log(rng.dirichlet(np.ones(V) * 0.7))
        return table[key]

    for lp_pow, es in [(1.0, False), (0.7, True), (1.5, "never")]:
        scorer = BeamScorer(1, k, n, lp_pow, es, [EOS], pad_token_id=0)
        seqs = [[]] * k
        while not scorer.done:
            tokens, beam_idx = scorer.process(np.stack([lp([1] + s) for s in seqs]))
            seqs = [seqs[i] + [int(t)] for i, t in zip(beam_idx, tokens)]
        want = reference_beam_search(lp, [1], k, n, lp_pow, es, [EOS])
        got, scores, lengths = scorer.finalize(len(want))
        assert [list(g[:m]) for g, m in zip(got, lengths)] == [w[1] for w in want]
        np.testing.assert_allclose(scores, [w[0] for w in want], rtol=1e-5)


def test_top_candidates_break_ties_by_lower_index():
    x = np.random.default_rng(8).integers(0, 4, (3, 50)).astype(np.float32)  # many ties
    for n in (1, 7, 50):
        np.testing.assert_array_equal(_top(x, n), np.argsort(-x, axis=1, kind="stable")[:, :n])


def test_log_softmax_is_float32_and_normalised():
    x = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 8
    y = log_softmax(x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(np.exp(y.astype(np.float64)).sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(y, x - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True)), atol=1e-5)


# -- FeedBuilder.select_rows ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gqa", "concat"])
def test_select_rows_gathers_every_row_field(family):
    sess = onnxkv.Session(build_model(family, MICRO, seed=2), threads=1)
    ids = np.array([[0, 0, 5, 6], [7, 8, 9, 3]])
    builder = FeedBuilder(sess.plan.inputs, sess.model, ids, np.array([2, 4]), 0, thread_cache=False)
    builder.first()
    before = builder.mask.copy()
    builder.select_rows(np.array([1, 1, 0]))
    assert builder.batch == 3
    np.testing.assert_array_equal(builder.mask, before[[1, 1, 0]])
    np.testing.assert_array_equal(builder.lengths, [4, 4, 2])
    np.testing.assert_array_equal(builder.prompt, ids[[1, 1, 0]])
    feeds = builder.next(np.array([1, 2, 3]), {})
    assert feeds[sess.model.io.input_ids].shape == (3, 1)
    with pytest.raises(InputError, match=r"select_rows.*\[0, 3\).*max 3"):
        builder.select_rows(np.array([0, 3]))
    with pytest.raises(InputError, match="select_rows"):
        builder.select_rows(np.array([], dtype=np.int64))


# -- drivers against transformers' recorded beams -------------------------------------------------------
def _fixture_search(session, cache, **kw):
    s = SETTINGS
    return beam_search(
        session,
        REF["beam_prompt_ids"],
        s["num_beams"],
        s["max_new_tokens"],
        length_penalty=s["length_penalty"],
        early_stopping=s["early_stopping"],
        eos_token_id=s["eos_token_id"],
        num_return_sequences=s["num_return_sequences"],
        pad_token_id=s["pad_token_id"],
        cache=cache,
        **kw,
    )


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_models_match_transformers_beams(name, cache):
    session = onnxkv.Session(FIXTURES[name], threads=2, events=True)
    res = _fixture_search(session, cache)
    np.testing.assert_array_equal(res.sequences, REF["beam_sequences"])
    np.testing.assert_allclose(res.sequences_scores, REF["beam_sequences_scores"], atol=1e-4, rtol=0)
    assert res.sequences.dtype == np.int64 and res.sequences_scores.dtype == np.float32
    steps = SETTINGS["max_new_tokens"] - 1
    assert len(res.step_seconds) == len(res.committed_bytes) == len(res.reorder_copied_bytes) == steps
    assert res.tokens_per_second > 0 and res.prompt_seconds > 0
    if cache == "tensor":  # every step gathers every present: the copy-per-beam cost
        L, k = REF["beam_prompt_ids"].size, SETTINGS["num_beams"]
        per_token = _bytes_per_token(session)
        assert res.prompt_copied_bytes == k * L * per_token
        assert res.reorder_copied_bytes == [k * (L + i) * per_token for i in range(steps)]


def _bytes_per_token(session) -> int:
    conv = session.model.convention
    return 2 * len(conv.layers) * conv.kv_heads * conv.head_size * 4


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_beams_share_pages_and_copy_at_most_a_page_per_beam(name, block_size, paged):
    session = onnxkv.Session(FIXTURES[name], threads=2, events=True)
    res = _fixture_search(session, onnxkv.CacheConfig(paged, block_size=block_size))
    np.testing.assert_array_equal(res.sequences, REF["beam_sequences"])
    k, L = SETTINGS["num_beams"], REF["beam_prompt_ids"].size
    per_token = _bytes_per_token(session)
    page = block_size * per_token  # one page of every layer's keys and values
    log = session.events
    cow = [sum(e.cow_copied_bytes for e in log if e.action == "cache_write" and e.step == s) for s in log.steps()]
    assert len(cow) == len(res.step_seconds) + 1 and max(cow) > 0
    assert all(c <= k * page for c in cow)
    assert res.prompt_copied_bytes == 0 and res.reorder_copied_bytes == [0] * len(res.step_seconds)
    assert any(e.action == "reorder" for e in log)
    shared, tail = L // block_size * block_size, L % block_size
    for i, committed in enumerate(res.committed_bytes):
        generated = i + 1
        # The prompt's full pages once; per beam its generated tokens, plus its copy of the
        # prompt's partial last page (none when the prompt fills whole pages) and one page of slack.
        assert committed <= (shared + k * (tail + generated + block_size)) * per_token
        if tail == 0:
            assert committed <= (L + k * generated + k * block_size) * per_token


# -- drivers on builder models -----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["gqa", "attention", "concat", "tensorscatter"])
def micro(request):
    return onnxkv.Session(build_model(request.param, MICRO, seed=7), threads=1)


def test_tensor_mode_matches_reference_search(micro):
    prompt = [3, 17, 42, 8, 61]
    # EOS ids chosen so that some returned hypotheses end early (two EOS ids: 3k candidates kept).
    for k, lp, es, eos in [(3, 1.0, False, [46]), (2, 1.7, "never", [95]), (4, 0.5, True, [46, 11])]:
        res = beam_search(
            micro,
            np.array(prompt),
            k,
            6,
            length_penalty=lp,
            early_stopping=es,
            eos_token_id=eos,
            num_return_sequences=k,
            pad_token_id=0,
            cache="tensor",
        )
        want = reference_beam_search(lambda t: full_logprobs(micro, t), prompt, k, 6, lp, es, eos)
        assert len(want) == k
        for row, score, (w_score, w_tokens) in zip(res.sequences, res.sequences_scores, want):
            np.testing.assert_array_equal(row[: len(prompt) + len(w_tokens)], prompt + w_tokens)
            assert (row[len(prompt) + len(w_tokens) :] == 0).all()
            np.testing.assert_allclose(score, w_score, atol=1e-4)


def test_paged_and_tensor_modes_agree(micro, paged):
    ids = np.array([[0, 0, 0, 9, 23, 4], [12, 5, 77, 31, 2, 6]])
    mask = (ids != 0).astype(np.int64)
    kw = dict(attention_mask=mask, eos_token_id=11, num_return_sequences=2, pad_token_id=0, length_penalty=1.2)
    in_pages = beam_search(micro, ids, 3, 12, cache=onnxkv.CacheConfig(paged, block_size=4), **kw)
    tensor = beam_search(micro, ids, 3, 12, cache="tensor", **kw)
    np.testing.assert_array_equal(in_pages.sequences, tensor.sequences)
    np.testing.assert_allclose(in_pages.sequences_scores, tensor.sequences_scores, atol=1e-5)


def test_left_padded_batch_rows_equal_rows_alone(micro, cache):
    rows = [[9, 23, 4], [12, 5, 77, 31, 2, 6]]
    L = max(map(len, rows))
    ids = np.array([[0] * (L - len(r)) + r for r in rows])
    mask = np.array([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    kw = dict(eos_token_id=[], num_return_sequences=2, pad_token_id=0, cache=cache)
    batch = beam_search(micro, ids, 3, 7, attention_mask=mask, **kw)
    assert batch.sequences.shape == (4, L + 7)
    for b, r in enumerate(rows):
        alone = beam_search(micro, np.array(r), 3, 7, **kw)
        np.testing.assert_array_equal(batch.sequences[2 * b : 2 * b + 2, L:], alone.sequences[:, len(r) :])
        np.testing.assert_allclose(batch.sequences_scores[2 * b : 2 * b + 2], alone.sequences_scores, atol=1e-4)


def test_every_row_left_padded_equals_rows_alone(micro, cache):
    """No row spans the prompt's width: the GroupQueryAttention layout leaves the common padding column out,
    so a paged state (which holds each row's tokens only) is fed a mask as wide as its cache."""
    rows = [[9, 23, 4], [12, 5, 77, 31]]
    ids = np.array([[0] * (5 - len(r)) + r for r in rows])
    mask = np.array([[0] * (5 - len(r)) + [1] * len(r) for r in rows])
    kw = dict(eos_token_id=[], num_return_sequences=2, pad_token_id=0, cache=cache)
    batch = beam_search(micro, ids, 3, 5, attention_mask=mask, **kw)
    for b, r in enumerate(rows):
        alone = beam_search(micro, np.array(r), 3, 5, **kw)
        np.testing.assert_array_equal(batch.sequences[2 * b : 2 * b + 2, 5:], alone.sequences[:, len(r) :])
        np.testing.assert_allclose(batch.sequences_scores[2 * b : 2 * b + 2], alone.sequences_scores, atol=1e-4)


def test_quantized_pages_of_a_left_padded_row_equal_the_row_alone(micro):
    """A static (TensorScatter) cache's prompt run writes each short row's padding after its tokens, as a
    GroupQueryAttention one does: those positions are not full pages of the row, so int8 pages hold what the
    row alone holds.  (A left-padded row of the other forms holds its padding in its first pages:
    docs/paged-caches.md.)"""
    if micro.model.convention.kind not in ("group_query_attention", "tensor_scatter"):
        pytest.skip("left padding lies in the row's first pages: not the row alone's pages")
    short, long_ = [5, 6], list(range(10, 22))
    ids = np.array([[0] * 10 + short, long_])
    mask = (np.arange(12) >= np.array([[10], [0]])).astype(np.int64)
    cfg = onnxkv.CacheConfig("paged", block_size=4, kv_format="int8")
    batch = beam_search(micro, ids, 2, 6, attention_mask=mask, eos_token_id=[], cache=cfg)
    alone = beam_search(micro, np.array(short), 2, 6, eos_token_id=[], cache=cfg)
    np.testing.assert_array_equal(batch.sequences[0, 12:], alone.sequences[0, 2:])
    np.testing.assert_allclose(batch.sequences_scores[0], alone.sequences_scores[0], atol=1e-5)


def test_negative_length_penalty_returns_full_hypotheses(micro, cache):
    """A negative length_penalty multiplies finished scores far below transformers' -1e9 markers of empty
    slots: the search still returns its hypotheses, scored as the formula says."""
    prompt = [5, 6, 7]
    res = beam_search(micro, np.array(prompt), 3, 30, length_penalty=-5.0, eos_token_id=[], cache=cache)
    assert res.sequences.shape == (1, 33)
    seq = res.sequences[0].tolist()
    total = sum(float(full_logprobs(micro, seq[:i])[seq[i]]) for i in range(3, 33))
    np.testing.assert_allclose(res.sequences_scores[0], total / 30.0**-5.0, rtol=1e-4)


def test_callback_sees_every_step(micro):
    seen = []
    res = beam_search(
        micro,
        np.array([5, 6, 7]),
        3,
        4,
        eos_token_id=[],
        cache="tensor",
        callback=lambda step, tokens, idx: seen.append((step, tokens.copy(), idx.copy())),
    )
    assert [s for s, _, _ in seen] == [0, 1, 2, 3]
    assert all(t.shape == (3,) and i.shape == (3,) for _, t, i in seen)
    np.testing.assert_array_equal(seen[0][2], [0, 0, 0])
    assert res.sequences.shape == (1, 7)


def test_one_new_token_returns_the_k_most_likely_tokens(micro, cache):
    res = beam_search(micro, np.array([5, 6, 7]), 3, 1, eos_token_id=[], num_return_sequences=3, cache=cache)
    lp = full_logprobs(micro, [5, 6, 7])
    best = np.argsort(-lp, kind="stable")[:3]
    np.testing.assert_array_equal(res.sequences[:, 3], best)
    np.testing.assert_allclose(res.sequences_scores, lp[best], atol=1e-4)
    assert res.step_seconds == [] and res.committed_bytes == [] and res.tokens_per_second == 0.0


# -- argument errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_beams=0), r"num_beams.*0"),
        (dict(num_beams=2, num_return_sequences=3), r"num_return_sequences 3 exceeds num_beams 2"),
        (dict(max_new_tokens=0), r"max_new_tokens.*0"),
        (dict(length_penalty="1"), r"length_penalty.*'1'"),
        (dict(length_penalty=True), r"length_penalty.*True"),
        (dict(length_penalty=10**400), r"length_penalty must be a finite number .*, got 1000"),
        (dict(early_stopping="sometimes"), r"early_stopping.*'sometimes'"),
        (dict(cache="contiguous"), r"cache.*'contiguous'"),
        (dict(do_sample=True), r"do_sample=True \(beam sampling\) is not supported"),
        (dict(attention_mask=np.ones((2, 3), np.int64)), r"attention_mask shape \(2, 3\)"),
        (dict(eos_token_id=500), r"eos_token_id 500"),
        (dict(pad_token_id=-1), r"pad_token_id -1"),
        (dict(num_beams=True), r"num_beams.*True"),
        (dict(max_new_tokens=2.0), r"max_new_tokens.*2\.0"),
        (dict(num_beams=10**6), r"num_beams must be at most 65536, got 1000000"),  # it ran for minutes
    ],
)
def test_bad_arguments_raise_input_error_naming_beam_search(micro, kwargs, match):
    args = dict(num_beams=2, max_new_tokens=3, cache="tensor") | kwargs
    with pytest.raises(InputError, match=r"^beam_search: .*" + match):
        beam_search(micro, np.array([[1, 2, 3]]), **args)


def test_beam_rows_of_a_batch_are_bounded(micro):
    with pytest.raises(
        InputError, match=r"beam_search: 3 row\(s\) \* num_beams 30000 = 90000 beam rows; at most 65536"
    ):
        beam_search(micro, np.array([[1, 2, 3]] * 3), num_beams=30000, max_new_tokens=2, cache="tensor")


def test_scorer_rejects_too_small_vocab_and_wrong_shapes():
    scorer = BeamScorer(1, 3, 4, eos_token_id=[EOS])
    with pytest.raises(InputError, match=r"beam_search: .*\[3, vocab\].*\(2, 9\)"):
        scorer.process(np.zeros((2, 9)))
    with pytest.raises(InputError, match=r"beam_search: num_beams \* vocab = 3"):
        scorer.process(np.zeros((3, 1)))
    with pytest.raises(InputError, match="beam_search: .*NaN"):
        scorer.process(np.full((3, 9), np.nan))
    assert scorer.step == 0 and not scorer.done


@pytest.mark.parametrize("eos", [(), (EOS,), (EOS, 2)])
@pytest.mark.parametrize("seed", range(4))
def test_a_merge_that_takes_nothing_keeps_every_finished_slot(eos, seed):
    """process skips the merge of finished hypotheses when no candidate is taken: the merge must then
    leave every slot as it is, whatever the slots hold (empty, finished, tied scores)."""
    rng = np.random.default_rng(seed)
    B, k, V, n = 2, 3, 6, 7
    scorer = BeamScorer(B, k, n, float(rng.uniform(-1, 2)), [False, True, "never"][seed % 3], list(eos), 0)
    while not scorer.done:
        probs = rng.dirichlet(np.ones(V) * 0.5, size=B * k)
        probs[rng.random(B * k) < 0.3] = 1.0 / V  # rows of equal scores: ties between candidates and slots
        before = {
            f: getattr(scorer, f).copy() for f in ("finished", "finished_scores", "finished_lengths", "is_finished")
        }
        kept = scorer.keep
        scorer._merge(
            rng.normal(size=(B, kept)).astype(np.float32),
            rng.integers(0, V, (B, kept, n)),
            rng.random((B, kept)) < 0.5,
            np.zeros((B, kept), bool),
            scorer.step,
        )
        for f, v in before.items():
            np.testing.assert_array_equal(getattr(scorer, f), v, err_msg=f)
        scorer.process(np.log(probs))
