"""PageCore.write_plan (the blocks a write needs pages for) against its NumPy twin, and the reference
count checks of incref / decref."""

from __future__ import annotations

import numpy as np
import pytest
from onnxkv.cache._pagecore import COPY, FRESH, KEEP, PageCore


def write_plan_twin(refs, tables, starts, counts, bs, committed, nonnative, keep_one):
    """The plan as the Python staging computed it: per row, its blocks' actions (a fresh page for none, a copy
    for a shared or marked page), then one copy of each page that only its copiers hold turned into a keep
    for the first of them writing furthest, when no holder committed past that row's start."""
    plan = []
    for b in range(tables.shape[0]):
        if counts[b] <= 0:
            continue
        for blk in range(starts[b] // bs, -(-(starts[b] + counts[b]) // bs)):
            p = tables[b, blk]
            if p < 0:
                plan.append([b, blk, FRESH])
            elif refs[p] > 1 or (nonnative.size and nonnative[p]):
                plan.append([b, blk, COPY])
    if keep_one:
        copies: dict[int, list] = {}
        for entry in plan:
            if entry[2] == COPY:
                copies.setdefault(int(tables[entry[0], entry[1]]), []).append(entry)
        for page, holders in copies.items():
            if len(holders) != refs[page]:
                continue
            keeper = max(holders, key=lambda e: starts[e[0]])
            if all(committed[e[0]] <= starts[keeper[0]] for e in holders):
                keeper[2] = KEEP
    return [tuple(e) for e in plan if e[2] != KEEP]


def _case(rng):
    """A pool whose pages are shared by random rows (as beams are after a reorder) and a random write."""
    core = PageCore(8, None)
    B, M, bs = int(rng.integers(1, 7)), int(rng.integers(1, 6)), int(rng.integers(1, 5))
    pool = core.reserve(int(rng.integers(1, 12)))
    tables = np.where(rng.random((B, M)) < 0.2, -1, rng.choice(pool, (B, M))).astype(np.int32)
    held = tables[tables >= 0]
    core.incref(held)
    core.decref(pool)  # the pages are held by the table's rows only ...
    extra = rng.choice(held, int(rng.integers(0, 3))) if held.size and rng.random() < 0.5 else held[:0]
    core.incref(extra)  # ... and some by other holders too
    committed = rng.integers(0, M * bs + 1, B).astype(np.int64)
    drift = rng.integers(-2, 2, B) if rng.random() < 0.5 else 0  # else every row appends
    starts = np.minimum(committed + drift, M * bs - 1).clip(0).astype(np.int64)
    counts = np.minimum(rng.integers(0, 4, B), M * bs - starts).astype(np.int64)
    nonnative = (rng.random(core.capacity) < 0.2).astype(np.uint8) if rng.random() < 0.3 else np.zeros(0, np.uint8)
    return core, tables, starts, counts, bs, committed, nonnative


@pytest.mark.parametrize("seed", range(300))
def test_write_plan_equals_its_twin(seed):
    rng = np.random.default_rng(seed)
    core, tables, starts, counts, bs, committed, nonnative = _case(rng)
    for keep_one in (False, True):
        refs = core.refs().copy()
        rows, blocks, actions = core.write_plan(tables, starts, counts, bs, committed, nonnative, keep_one)
        got = list(zip(rows.tolist(), blocks.tolist(), actions.tolist()))
        assert got == write_plan_twin(refs, tables, starts, counts, bs, committed, nonnative, keep_one)
        np.testing.assert_array_equal(core.refs(), refs)  # a plan changes no count


def test_beams_appending_into_one_shared_page_copy_all_but_the_furthest():
    core = PageCore(8, None)
    page = core.reserve(1)
    core.incref(np.repeat(page, 3))  # four beams hold the page of their last block
    tables = np.repeat(page, 4).reshape(4, 1).astype(np.int32)
    lengths = np.full(4, 2, np.int64)
    none = np.zeros(0, np.uint8)
    rows, _, actions = core.write_plan(tables, lengths, np.ones(4, np.int64), 4, lengths, none, True)
    assert rows.tolist() == [1, 2, 3] and actions.tolist() == [COPY] * 3  # beam 0 keeps it
    core.incref(page)  # a checkpoint holds it too: every beam copies
    rows, _, actions = core.write_plan(tables, lengths, np.ones(4, np.int64), 4, lengths, none, True)
    assert rows.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "tables, starts, counts, match",
    [
        (np.zeros((2, 1), np.int32), np.zeros(2, np.int64), np.full(2, 5, np.int64), "past its 1"),
        (
            np.full((1, 2), 99, np.int32),
            np.zeros(1, np.int64),
            np.ones(1, np.int64),
            r"holds 99, not a live page id in \[0, 8\)",
        ),
        (np.zeros((1, 2), np.int32), np.full(1, -1, np.int64), np.ones(1, np.int64), "starts at -1"),
        (np.zeros((2, 2), np.int32), np.zeros(1, np.int64), np.ones(1, np.int64), "2 rows, starts 1"),
        # a start + count that wraps int64 (it used to shrink the plan's arrays, then write past them)
        (np.zeros((2, 2), np.int32), np.array([0, 1], np.int64), np.array([1, 2**63 - 1], np.int64), "row 1 writes"),
        (np.zeros((1, 2), np.int32), np.array([2**63 - 1], np.int64), np.ones(1, np.int64), "row 0 writes 1"),
        (np.full((1, 2), 1, np.int32), np.zeros(1, np.int64), np.ones(1, np.int64), "holds 1, not a live page"),
        (np.full((1, 2), -2, np.int32), np.zeros(1, np.int64), np.ones(1, np.int64), "holds -2, not a live page"),
    ],
)
def test_write_plan_refuses_what_does_not_fit(tables, starts, counts, match):
    core = PageCore(8, None)
    core.reserve(1)
    with pytest.raises(ValueError, match=match):
        core.write_plan(tables, starts, counts, 4, np.zeros(len(tables), np.int64), np.zeros(0, np.uint8), True)


def test_decref_past_the_references_held_changes_no_count():
    core = PageCore(8, None)
    a, b = core.reserve(2).tolist()
    core.incref(np.array([b], np.int32))
    with pytest.raises(ValueError, match=f"page {b} has 2 reference\\(s\\), fewer than the 3 dropped"):
        core.decref(np.array([a, b, -1, b, b], np.int32))
    assert core.refs()[[a, b]].tolist() == [1, 2]
    with pytest.raises(ValueError, match="out of range"):
        core.decref(np.array([a, 8], np.int32))
    with pytest.raises(ValueError, match=f"PageCore.incref: page {a + 2} is free"):
        core.incref(np.array([a, a + 2], np.int32))
    assert core.refs()[[a, b]].tolist() == [1, 2]
    assert core.decref(np.array([b, a, b], np.int32)).tolist() == [a, b]


def test_write_plan_refuses_a_block_size_its_arithmetic_cannot_hold():
    core = PageCore(8, None)
    core.reserve(1)
    with pytest.raises(ValueError, match="block size 4611686018427387904 past 2147483647"):
        core.write_plan(np.zeros((1, 2), np.int32), np.array([3], np.int64), np.array([2**62], np.int64), 2**62,
                        np.zeros(1, np.int64), np.zeros(0, np.uint8), True)  # fmt: skip


@pytest.mark.parametrize(
    "ids, match",
    [
        (np.array([2**32], np.int64), r"page ids must be in \[0, 8\) \(negative: none\), got 4294967296"),
        (np.array([-(2**32) + 1], np.int64), r"page ids must be in \[0, 8\) \(negative: none\), got -4294967295"),
        (
            np.array([2**64 - 1], np.uint64),
            r"page ids must be in \[0, 8\) \(negative: none\), got 18446744073709551615",
        ),
        (np.array([0.7]), "page ids must be integers, got dtype float64"),
    ],
)
def test_ids_are_checked_in_their_own_width(ids, match):
    """An int64 id 2**32 + p once narrowed to page p (and a float p + 0.7 to p) before the range check."""
    core = PageCore(8, None)
    core.reserve(2)
    for api in ("incref", "decref"):
        with pytest.raises(ValueError, match=f"PageCore.{api}: {match}"):
            getattr(core, api)(ids)
    with pytest.raises(ValueError, match=f"PageCore.pages_needed: {match}"):
        core.pages_needed(ids, 0, 1)
    assert core.refs()[:2].tolist() == [1, 1]
    core.incref(np.array([1, -1], np.int64))  # other widths in range, negative: no page
    assert core.refs()[:2].tolist() == [1, 2]
