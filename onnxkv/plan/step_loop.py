"""Decode steps of a batch as one call: the compiled generation loop.

When a decode step's compiled step (:mod:`onnxkv.plan.compiled_step`) is one
segment covering every node of the plan, the whole step is one
:class:`~onnxkv._kernels.step.Program`, and the steps of a greedy generation
differ only in values the loop itself can make: each row's token id (the argmax of
the previous step's logits, or a draw from them: :class:`Draws`; the pad id once
the row has ended), the attention mask (one more column of ones; or, for a
right-padded batch, one more one after each row's own),
the positions (one more) and the committed cache lengths.  The masks an
export's ``ExportMask`` node computes from the attention mask are such values
too: a step of that node and one segment, or of a head segment that writes no
cache, the node and a segment (a torch export's token embedding comes before
its masks), replays with the loop writing the node's masks before each step
(:meth:`ExportMask.loop_masks <onnxkv.plan.ops.export_mask.ExportMask.loop_masks>`;
all-ones attention masks, left-padded ones: each row's padding hides its first keys, or, on paged caches,
the engine's rows of different lengths: each row's keys between its own and the last one hidden).
:func:`run_steps` replays that program token after token in C
(:func:`onnxkv._kernels.token_loop.decode_steps`), with no Python between the
tokens, and stages the rows the steps appended in the caches; the caller (a
state) commits them, or discards them when the call raises.

Tokens, logits and caches are those of the steps run one by one through
:meth:`Plan.run` bit for bit.  Anything the loop cannot replay returns None
with nothing run or staged, and the caller runs its steps one by one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from onnxkv._kernels.token_loop import MISMATCH, REFUSED, decode_steps
from onnxkv.errors import InputError
from onnxkv.plan.compiled_step import Segment
from onnxkv.plan.ops._export_record import CommittedLength, RowsAppend
from onnxkv.plan.ops._gqa_paged_decode import PagedAppend
from onnxkv.plan.ops._gqa_record import CacheAppend
from onnxkv.plan.ops.export_mask import ExportMask

if TYPE_CHECKING:
    from collections.abc import Sequence

    from onnxkv.plan.plan import Plan

__all__ = ["DecodeNames", "Draws", "StepsRun", "check_steps", "run_steps"]


@dataclass(frozen=True)
class DecodeNames:
    """The graph values a greedy decode loop makes and reads.

    Attributes:
        token: the input of the step's token ids (int64, one per row).
        mask: the attention mask input (int64 [B, L], all ones or each row's ones first; a column longer
            each step).
        logits: the output whose argmax is each row's next token (float32, one row of V per row).
        position: the position input (int64, one per row; one more each step), or None: the model has none.
    """

    token: str
    mask: str
    logits: str
    position: str | None = None


@dataclass(frozen=True)
class Draws:
    """How the steps draw their tokens instead of taking the argmax (:mod:`onnxkv._kernels.sampling`).

    Attributes:
        temperature: > 0 and finite; or float64 [B], one per row, 0 for a row that takes its argmax.
        top_k: keep the ``top_k`` highest logits (0: all); or int64 [B], one per row.
        top_p: then the nucleus of probability ``top_p`` (1.0: all); or float64 [B], one per row.
        uniforms: float64 [>= count * B] in [0, 1): step ``t`` draws row ``b`` with ``uniforms[t * B + b]``
            (one number per row and step, as :func:`onnxkv.generate.sampling.select_next` draws them; an
            argmax row's are not read).
    """

    temperature: float | np.ndarray
    top_k: int | np.ndarray
    top_p: float | np.ndarray
    uniforms: np.ndarray


@dataclass
class StepsRun:
    """What :func:`run_steps` ran.

    Attributes:
        tokens: int64 [steps] for one row, [steps, B] for B rows: the ids each step chose (step ``t`` fed
            the ids before it, the first the caller's tokens; a row that has ended takes the pad id).
        seconds: float64 [steps]: each step's time.
        refused: the step after the last one refused its values (a position or id its calls do not take);
            run it through :meth:`Plan.run`, which raises or takes the general path.
    """

    tokens: np.ndarray
    seconds: np.ndarray
    refused: bool

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[0])


def _check_draws(api: str, draws: Draws) -> None:
    """Raise InputError unless ``draws``' parameters are numbers, or per-row arrays of one length, in range
    (a per-row temperature may be 0: that row takes its argmax)."""
    per_row = [isinstance(v, np.ndarray) for v in (draws.temperature, draws.top_k, draws.top_p)]
    rows = {v.shape for v in (draws.temperature, draws.top_k, draws.top_p) if isinstance(v, np.ndarray)}
    if any(per_row) and (len(rows) != 1 or len(next(iter(rows))) != 1):
        raise InputError(f"{api}: per-row draws parameters must be 1-D arrays of one length, got {sorted(rows)}")
    for name, value, kinds in (("temperature", draws.temperature, "iuf"), ("top_k", draws.top_k, "iu"),
                               ("top_p", draws.top_p, "iuf")):  # fmt: skip
        if isinstance(value, (bool, np.bool_)) or np.asarray(value).dtype.kind not in kinds:
            what = "an int" if kinds == "iu" else "a number"
            raise InputError(f"{api}: draws.{name} must be {what} or an array of them, got {value!r}")
    t, k, p = (np.asarray(v, np.float64) for v in (draws.temperature, draws.top_k, draws.top_p))
    greedy = (t == 0) & per_row[0]
    if not np.all(greedy | ((0 < t) & (t < np.inf))):
        raise InputError(
            f"{api}: draws.temperature must be a finite number > 0, got {draws.temperature!r} "
            "(per row: 0 takes the argmax)"
        )
    if not np.all(k >= 0):
        raise InputError(f"{api}: draws.top_k must be an int >= 0 (0: every id), got {draws.top_k!r}")
    if not np.all((0 < p) & (p <= 1)):
        raise InputError(f"{api}: draws.top_p must be a number in (0, 1], got {draws.top_p!r}")


def check_steps(
    api: str,
    count: int,
    draws: Draws | None,
    names: DecodeNames | None = None,
    eos=(),
    known: Mapping[str, int] | None = None,
    finished: np.ndarray | None = None,
    pad: int = 0,
) -> None:
    """Raise InputError (naming ``api``) unless ``count`` is an int >= 1; ``draws`` is None or holds a finite
    temperature > 0, an int ``top_k`` >= 0, ``top_p`` in (0, 1] and float64 ``uniforms`` in [0, 1) with a number per
    step (and row: checked against the rows when they run); ``names`` (when given) is a :class:`DecodeNames`
    whose values are in ``known`` (the plan's value names); ``eos`` is an int, a list, tuple or 1-D array of
    ints in [0, 2**63), or one such sequence per row;
    ``finished`` None or a writable bool [B]; and ``pad`` an int in [0, 2**63)."""
    if finished is not None and not (
        isinstance(finished, np.ndarray)
        and finished.dtype == np.bool_
        and finished.ndim == 1
        and finished.flags.writeable
    ):
        raise InputError(f"{api}: finished must be a writable bool array [B] or None, got {finished!r}")
    if isinstance(pad, (bool, np.bool_)) or not isinstance(pad, (int, np.integer)) or not 0 <= pad < 2**63:
        raise InputError(f"{api}: the pad id must be an int in [0, 2**63), got {pad!r}")
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise InputError(f"{api}: count must be an int >= 1, got {count!r}")
    if draws is not None and not isinstance(draws, Draws):
        raise InputError(f"{api}: draws must be a Draws or None, got {type(draws).__name__}")
    u = None if draws is None else draws.uniforms
    if draws is not None and not (
        isinstance(u, np.ndarray) and u.dtype == np.float64 and u.ndim == 1 and u.shape[0] >= count
    ):
        raise InputError(
            f"{api}: draws.uniforms must be float64 [>= count={count}], got "
            f"{getattr(u, 'dtype', type(u).__name__)} {getattr(u, 'shape', '')}"
        )
    if draws is not None and not np.all((u >= 0.0) & (u < 1.0)):
        bad = int(np.argmin((u >= 0.0) & (u < 1.0)))
        raise InputError(f"{api}: draws.uniforms must be numbers in [0, 1), got uniforms[{bad}] = {u[bad]!r}")
    if draws is not None:
        _check_draws(api, draws)
    if names is not None or known is not None:
        if not isinstance(names, DecodeNames):
            raise InputError(f"{api}: names must be a DecodeNames, got {names!r}")
        for field in ("token", "mask", "logits", "position"):
            value = getattr(names, field)
            if (value is not None or field != "position") and (not isinstance(value, str) or value not in known):
                raise InputError(f"{api}: names.{field} {value!r} is not a value of the model's graph")
    ids = [eos] if isinstance(eos, (int, np.integer)) else eos
    sequence = isinstance(ids, (list, tuple)) or (isinstance(ids, np.ndarray) and ids.ndim in (1, 2))
    per_row = sequence and _per_row_eos(ids)
    rows = ids if per_row else [ids]
    if not sequence or not all(
        (isinstance(row, (list, tuple)) or (isinstance(row, np.ndarray) and row.ndim == 1))
        and all(
            isinstance(e, (int, np.integer)) and not isinstance(e, (bool, np.bool_)) and 0 <= e < 2**63
            for e in (row.tolist() if isinstance(row, np.ndarray) else row)
        )
        for row in rows
    ):
        raise InputError(
            f"{api}: eos must be token ids (an int, or a list, tuple or 1-D array of ints in [0, 2**63)), or "
            f"one such sequence per row, got {eos!r}"
        )


def _per_row_eos(eos) -> bool:
    """Whether ``eos`` (checked by :func:`check_steps`) holds one sequence of end ids per row."""
    return any(isinstance(e, (list, tuple, np.ndarray)) for e in eos)


def eos_table(eos, rows: int) -> np.ndarray:
    """int64 [rows or 1, E >= 1]: the end ids of every row (``eos`` a sequence of ints) or of each row (a
    sequence of ``rows`` sequences), -1 past a row's own; InputError when a per-row ``eos`` has another
    number of rows."""
    if isinstance(eos, (int, np.integer)) or not _per_row_eos(eos):
        ids = [int(eos)] if isinstance(eos, (int, np.integer)) else [int(e) for e in eos]
        return np.array([[*ids, -1]], np.int64)
    if len(eos) != rows:
        raise InputError(f"decode_steps: eos has {len(eos)} rows of end ids, the steps run {rows} rows")
    width = max(len(e) for e in eos) + 1
    out = np.full((rows, width), -1, np.int64)
    for b, e in enumerate(eos):
        out[b, : len(e)] = np.asarray(e, np.int64).reshape(-1)
    return out


def run_steps(
    plan: Plan,
    feeds: Mapping[str, np.ndarray],
    caches: dict,
    count: int,
    names: DecodeNames,
    eos: Sequence[int] = (),
    draws: Draws | None = None,
    finished: np.ndarray | None = None,
    pad: int = 0,
) -> StepsRun | None:
    """Run up to ``count`` decode steps of ``plan`` from ``feeds`` in one call: greedy, or drawing with
    ``draws``.

    ``feeds`` are the first step's full feeds (a state's cache views included) of B rows, the values
    ``names`` (:class:`DecodeNames`) describes: rows of one length (an all-ones mask), or a right-padded
    batch (each row's mask ones first: the rows of a GroupQueryAttention graph, each written at its own
    length; on contiguous caches over its padding until it passes the longest row, the committed bytes the
    steps may write over kept so that a discard restores them; a paged cache holds each row's own tokens
    only), or, for a graph whose ``ExportMask`` node makes the masks, a left-padded batch or (paged) rows
    each at its own length, the mask hiding the columns between a row's ones and the last one (the
    engine's ``FeedBuilder.ragged``; the next mask keeps the gap after one more one).  ``caches`` (past input name -> contiguous :class:`~onnxkv.cache.contiguous.CacheTensor`, or
    the planes of one paged cache) are written in place; the steps' rows are staged (the
    caller commits or discards them).  Later steps feed each row's argmax of ``names.logits`` (or its
    draw; ``pad`` for a row that has ended: ``finished``, bool [B] or None, updated in place),
    a mask one column longer and the next positions.  Stops after ``count`` steps, once every row has
    chosen an id in ``eos`` (or in its own ``eos[b]``: one sequence per row), when the caches are full
    (the next step grows them through :meth:`Plan.run`) or before a step whose calls refuse their values.

    Returns None, with nothing run or staged, unless the plan holds an idle compiled step fitting these
    feeds that is one segment of every node (or the segments and ``ExportMask`` node of the module
    docstring) whose only effects are decode cache appends, whose logits it exports as float32 [B, V],
    and whose external values are those inputs, the caches and the masks the loop writes.

    Raises:
        InputError: ``feeds`` do not fit the graph inputs (as :meth:`Plan.run`).
        MemoryError: a kernel could not allocate its workspace (nothing staged).
    """
    if plan.steps is None or count < 1:
        return None
    slots = plan.bind_inputs(feeds, caches)
    step = plan.steps.take(slots, caches)
    if step is None:
        return None
    try:
        return _replay(plan, step, slots, caches, count, names, eos, draws, finished, pad)
    finally:
        plan.steps.done(step)


def _replay(
    plan, step, slots, caches, count: int, names: DecodeNames, eos, draws: Draws | None, finished, pad: int
) -> StepsRun | None:
    slot_of = plan.slot_of
    mask = slots[slot_of[names.mask]]
    rows = mask.shape[0] if isinstance(mask, np.ndarray) and mask.ndim == 2 else 0
    loop = _loop_items(plan, step.items, slots, names.mask) if rows else None
    if loop is None:
        return None
    head, seg, derived, made, pads, gaps = loop
    logits = next((v for s, v in seg.exports if s == slot_of[names.logits]), None)
    kinds = {type(effect) for effect, _ in seg.effects}
    if (
        logits is None
        or logits.dtype != np.float32
        or logits.size != rows * logits.shape[-1]
        or not logits.flags.c_contiguous
        or kinds not in (({RowsAppend, CommittedLength}, {PagedAppend}) if derived else ({CacheAppend}, {PagedAppend}))
        or any(r not in (1, rows) for _, _, r, _, _, _ in derived.values())
        or (finished is not None and finished.shape != (rows,))
    ):
        return None
    paged = kinds == {PagedAppend}
    if paged and any(effect.tokens != 1 for effect, _ in seg.effects):  # a step of one token per row only
        return None
    if gaps is not None and not paged:  # rows of different lengths: each row's own keys are a paged cache's
        return None
    try:
        named = list({id(c): c for c in (caches[n] for effect, _ in seg.effects for n in effect.names)}.values())
    except KeyError:
        return None
    if any(c.batch != rows for c in named):
        return None
    if derived and any(c.length != mask.shape[1] - 1 for c in named):  # one query after each cache's past
        return None
    count = min(count, _room(named, paged))
    if count < 1:
        return None
    roles = {slot_of[names.token]: "token", slot_of[names.mask]: "mask"}
    if names.position is not None:
        roles[slot_of[names.position]] = "position"
    start = {id(c): c.length for c in named}
    for effect, _ in seg.effects:  # a paged one stages the pages of the steps' positions
        if not (effect.before(caches, count) if paged else effect.before(caches)):
            return None
    width = mask.shape[1]
    head_bound = None if head is None else _externals(head, slots, caches, roles, {}, {}, rows, width, count, paged)
    bound = _externals(seg, slots, caches, roles, derived, made, rows, width, count, paged)
    if bound is None or (head is not None and (head_bound is None or "mask" in head_bound[1])):
        return None
    externals, where, spec, mask_ones, at = bound
    if ("token" not in where and (head_bound is None or "token" not in head_bound[1])) or (
        ("mask" in where) == bool(derived)
    ):
        return None
    if derived and not paged:  # every row at the past the caches hold
        at = np.full(rows, mask.shape[1] - 1, np.int64)
    starts = [effect.lengths[0].copy() for effect, _ in seg.effects] if paged else []
    if at is not None:  # the committed bytes the steps may write over (rows below the longest) kept
        if (at < 0).any() or any((at > c.lengths).any() for c in named):
            return None
        for c in named:
            c.save_rows(at, count)
    if draws is not None and any(
        isinstance(v, np.ndarray) and v.shape != (rows,) for v in (draws.temperature, draws.top_k, draws.top_p)
    ):
        raise InputError(f"decode_steps: per-row draws parameters must have one entry per row ({rows})")
    if draws is not None and draws.uniforms.shape[0] < count * rows:
        raise InputError(
            f"decode_steps: draws.uniforms has {draws.uniforms.shape[0]} numbers, {count} steps of {rows} rows "
            f"need {count * rows}"
        )
    tokens = np.empty((count, rows), dtype=np.int64)
    seconds = np.empty(count, dtype=np.float64)
    ended = np.zeros(rows, np.uint8) if finished is None else finished.astype(np.uint8)
    head_where = {} if head_bound is None else head_bound[1]
    done, why = decode_steps(
        seg.program,
        externals,
        where.get("token", -1),
        where.get("mask", -1),
        where.get("position", -1),
        slots[slot_of[names.mask]].shape[1],
        logits.reshape(-1),
        eos_table(eos, rows),
        tokens,
        seconds,
        *(
            ()
            if draws is None
            else (
                draws.temperature,
                np.minimum(np.asarray(draws.top_k), logits.size),
                draws.top_p,
                np.ascontiguousarray(draws.uniforms[: count * rows]),  # a strided view is the caller's to give
            )
        ),
        finished=ended,
        pad=int(pad),
        mask_ones=mask_ones,
        derived=np.array([d for d, _ in spec], np.int64) if spec else None,
        derived_values=np.array([v for _, v in spec], np.float64) if spec else None,
        head=None if head is None else head.program,
        head_externals=None if head_bound is None else head_bound[0],
        head_token_ext=head_where.get("token", -1),
        head_position_ext=head_where.get("position", -1),
        derived_starts=pads,
        derived_gaps=gaps,
    )
    if not done and at is not None:
        for c in named:  # nothing ran: the kept bytes are what the caches hold
            c.discard()
    if why == MISMATCH:  # as a replay whose check fails: the pool drops the step, a later run records one
        step.stale = True
        return None
    if done and paged:
        for (effect, _), first in zip(seg.effects, starts, strict=True):
            effect.stage(caches, first, done)
        for cache in {id(c.cache): c.cache for c in named}.values():
            cache.drop_unwritten()
    elif done:
        for c in named:
            c.stage(done, max(start[id(c)], int(at.max()) + done), at)
    if finished is not None:
        finished[...] = ended.astype(bool)
    return StepsRun(tokens[:done, 0] if rows == 1 else tokens[:done], seconds[:done], why == REFUSED)


def _externals(
    seg: Segment,
    slots: list,
    caches: dict,
    roles: dict,
    derived: dict,
    made: dict,
    rows: int,
    width: int,
    count: int,
    paged: bool,
) -> tuple | None:
    """The externals of ``seg`` for the loop: ``(externals, where, spec, mask_ones, at)`` -- the arrays, the
    index of the token / mask / position one by role, the derived masks' ``decode_steps`` entries, and
    the mask's per-row ones and each row's first position when the mask is each row's ones first -- or None
    when one is not a value the loop makes or takes.  ``made``: slot -> the array an earlier segment of the
    step writes it in (the loop's head); ``width``: the first step's mask width."""
    externals: list = []
    where: dict = {}
    spec: list = []
    mask_ones = at = None
    for e, s in enumerate(seg.external_slots):
        if type(s) is int and s in derived:  # a mask the loop writes: [rows, 1, 1, T], T the step's mask width
            kind, window, r, visible, hidden, padded = derived[s]
            spec.append(((e, int(kind == "bool"), window, r, int(padded)), (visible, hidden)))
            externals.append(np.empty((r, 1, 1, width + count - 1), np.dtype(kind)))
            continue
        if type(s) is int and s in made:
            externals.append(made[s])
            continue
        if type(s) is tuple:  # a paged cache's page addresses or block tables, as staged
            externals.append(getattr(caches[s[0]], s[1]))
            continue
        if type(s) is str:
            if s not in caches or getattr(caches[s], "paged", False):
                return None
            externals.append(caches[s].buffer)
            continue
        role, value = roles.get(s), slots[s]
        if role is None or value is None or value.dtype != np.int64:
            return None
        if role == "mask":  # all ones, or each row's ones first (a right-padded batch's, rows of their own lengths)
            if value.ndim != 2 or value.shape[0] != rows:
                return None
            ones = value.sum(axis=1)
            uniform = bool((ones == value.shape[1]).all())
            if not uniform and not (value == (np.arange(value.shape[1]) < ones[:, None])).all():
                return None
            mask_ones = None if uniform else ones
            at = None if paged else ones - 1  # each row's first position (a contiguous cache's rows may differ)
            value = np.ones((rows, value.shape[1] + count - 1), dtype=np.int64)
        elif value.size != rows:
            return None
        else:
            value = value.copy()  # the loop writes the next id / position into it
        where[role] = e
        externals.append(value)
    if len(spec) != len(derived):
        return None
    return externals, where, spec, mask_ones, at


def _loop_items(plan, items: list, slots: list, mask: str) -> tuple | None:
    """``(head, segment, masks, made, starts, gaps)``: the segments a compiled step's ``items`` loop over, and
    the masks the loop writes for the segment (slot -> :meth:`ExportMask.loop_masks` entry).  Either one
    segment of every node (no head, no masks); or an ``ExportMask`` node whose masks only the segment after
    it reads, as externals, when the node's formula makes them the masks of one query after the mask
    ``mask`` -- all ones; left-padded: ``starts`` (int64 [B], else None) the zeros that come first in each
    row; or each row's ones first, then zeros up to a last one (the rows of requests of different lengths):
    ``gaps`` (int64 [B], else None) each row's ones before its zeros --, with every other node in that
    segment, or in it and a head segment before the node that writes no cache (the token embedding a torch
    export computes before its masks), whose exports (slot -> array) are ``made``.  None otherwise."""
    if len(items) == 1 and type(items[0]) is Segment:
        return None, items[0], {}, {}, None, None
    head = items[0] if len(items) == 3 and type(items[0]) is Segment and not items[0].effects else None
    rest = items[1:] if head is not None else items
    if len(rest) != 2 or type(rest[0]) is not int or type(rest[1]) is not Segment:
        return None
    node, seg = rest
    op, outs, value = plan.kernels[node], plan.out_idx[node], slots[plan.slot_of[mask]]
    if type(op) is not ExportMask or not (isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[1] > 0):
        return None
    shown, cols, last = value != 0, np.arange(value.shape[1]), value.shape[1] - 1
    if not shown[:, -1].all():
        return None
    starts, gaps = np.argmax(shown, axis=1).astype(np.int64), None  # each row's first non-zero
    if (shown != (cols >= starts[:, None])).any():  # not left-padded: each row's ones, zeros, then a last one
        gaps = np.where(shown[:, :-1].all(axis=1), last, np.argmin(shown[:, :-1], axis=1)).astype(np.int64)
        if (shown != ((cols < gaps[:, None]) | (cols == last))).any():
            return None
        starts = np.zeros_like(starts)
    taken = {s for s in seg.external_slots if type(s) is int}
    if any(s not in taken or s in plan.output_slots for s in outs):
        return None
    made = dict(head.exports) if head is not None else {}  # the head's values, as its replay leaves them
    inputs = [None if i < 0 else slots[i] if slots[i] is not None else made.get(i) for i in plan.in_idx[node]]
    masks = op.loop_masks(inputs, mask, value.shape[1])
    padded, gapped = bool(starts.any()), gaps is not None
    if masks is None or ((padded or gapped) and any(m[5] and m[2] != value.shape[0] for m in masks)):
        return None
    return head, seg, dict(zip(outs, masks)), made, starts if padded else None, gaps if gapped else None


#: Positions a compiled loop over a paged cache stages pages for at most, rounded up to the end of a page:
#: the loop writes only into pages staged before it (fresh pages it did not reach are freed after it).
PAGED_LOOP_POSITIONS = 64


def _room(named: list, paged: bool) -> int:
    """Steps the caches ``named`` take at most: a contiguous cache's free capacity; for paged caches the
    positions up to the end of the page holding the longest row's next ``PAGED_LOOP_POSITIONS``-th, and
    below a fixed capacity."""
    if not paged:
        return min(c.capacity - c.length for c in named)
    cache = named[0].cache
    length, bs = named[0].length, named[0].block_size
    room = ((length + PAGED_LOOP_POSITIONS - 1) // bs + 1) * bs - length
    return room if cache.max_tokens is None else min(room, cache.max_tokens - length)
