"""The loops that run a plan's nodes: plain, and recording every node in an event log.

Both read the plan's prepared steps (``Plan._steps``: kernel call, input and
output slots per node) and after-lists (``Plan._after``: alias check, slots to
clear, buffers to free) and stop before a node when the run is cancelled.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from onnxkv.errors import Cancelled, OnnxkvError, OperatorError
from onnxkv.events import EventLog
from onnxkv.plan.buffers import RunBuffers
from onnxkv.plan.context import RunContext
from onnxkv.plan.logit_rows import take_rows

if TYPE_CHECKING:
    from onnxkv.plan.plan import Plan

__all__ = ["needed_nodes", "run_nodes", "run_plain", "run_recording", "segmented"]


def segmented(caches: dict | None) -> bool:
    """Whether a run over ``caches`` is a run of segments (:meth:`State.run
    <onnxkv.runtime.state.State.run>`): a compiled step never replays one."""
    return bool(caches) and getattr(next(iter(caches.values())), "segments", None) is not None


def _node_failure(plan: Plan, k: int, e: Exception) -> OperatorError:
    node = plan.nodes[k]
    return OperatorError(f"{node.op_type} node '{node.name or node.output[0]}' failed: {type(e).__name__}: {e}")


def _python_starts(rt: RunContext) -> None:
    """Nodes of the run are about to run in Python: call the run's ``on_python`` hook, once."""
    hook = rt.on_python
    if hook is not None:
        rt.on_python = None
        hook()


def needed_nodes(plan: Plan, out_slots: tuple) -> list[bool] | None:
    """Per node of ``plan``, whether a run asked for the outputs in ``out_slots`` must run it (see
    :meth:`Plan.needed`, which caches this); None when every node is."""
    live = set(out_slots) | {plan.slot_of[n] for n in plan.output_names if n in plan.present_output_names}
    need = [False] * len(plan._steps)
    for k in range(len(plan._steps) - 1, -1, -1):
        if plan.must_alias[k] or not live.isdisjoint(plan.out_idx[k]):
            need[k] = True
            live.update(plan.in_idx[k])
    return None if all(need) else need


def run_plain(plan: Plan, slots: list, bufs: RunBuffers, rt: RunContext, cancel=None, needed=None, rows=None) -> bool:
    """Run every node of ``plan`` on ``slots`` (bound inputs; outputs land in their slots), releasing
    values and buffers after their last use; a kernel's non-onnxkv exception becomes an OperatorError
    naming the node.  ``needed`` (per node, or None for all): nodes to run; the others are skipped, their
    releases still made.  ``rows`` (a :class:`~onnxkv.plan.logit_rows.LogitHead` and the [B] positions
    of a run given ``logits_at``, or None): the head's inputs are replaced by those rows just before it
    runs; returns whether they were (see :func:`~onnxkv.plan.logit_rows.take_rows`)."""
    if rows is None:
        run_nodes(plan, 0, len(plan._steps), slots, bufs, rt, cancel, needed)
        return False
    head, at = rows
    run_nodes(plan, 0, head.node, slots, bufs, rt, cancel, needed)
    taken = take_rows(head, slots, at)
    run_nodes(plan, head.node, len(plan._steps), slots, bufs, rt, cancel, needed)
    return taken


def run_nodes(
    plan: Plan, first: int, end: int, slots: list, bufs: RunBuffers, rt: RunContext, cancel=None, needed=None
) -> None:
    """``run_plain`` for the nodes ``[first, end)`` only (the others run elsewhere: a compiled step).  The run's
    ``on_python`` hook is called before the first of them whose kernel may call BLAS (``Op.uses_blas``)."""
    hook = rt.on_python is not None
    blas = plan.uses_blas
    release = bufs.release
    get = slots.__getitem__
    steps, after = plan._steps, plan._after  # indexed, not sliced: no copy of the step lists per call
    k = first
    try:
        for k in range(first, end):
            run, ins, outs = steps[k]
            check, clear, free = after[k]
            rt._node = k
            if cancel is not None and cancel.cancelled:
                raise Cancelled(f"run cancelled before node '{plan.nodes[k].name or plan.nodes[k].output[0]}'")
            if needed is not None and not needed[k]:
                for s in clear:
                    slots[s] = None
                for s in free:
                    release(s)
                continue
            if hook and blas[k]:
                _python_starts(rt)
                hook = False
            args = list(map(get, ins))
            results = run(args, rt)
            if check:
                plan._check_aliases(k, args, results)
            if len(outs) == 1:  # most nodes: no zip
                slots[outs[0]] = results[0]
            else:
                for s, v in zip(outs, results):
                    slots[s] = v
            for s in clear:
                slots[s] = None
            for s in free:
                release(s)
    except OnnxkvError:
        raise
    except Exception as e:
        raise _node_failure(plan, k, e) from e


def run_recording(
    plan: Plan,
    slots: list,
    bufs: RunBuffers,
    rt: RunContext,
    events: EventLog,
    step: int,
    cache_allocator=None,
    cancel=None,
    needed=None,
    rows=None,
) -> bool:
    """``run_plain`` that also records each node's time, counters and allocator figures, and each cache
    write, in ``events`` under ``step`` (a skipped node records nothing)."""
    _python_starts(rt)
    allocator = plan.allocator
    release = bufs.release
    after = plan._after
    k, taken = 0, False
    try:
        for k, (run, ins, outs) in enumerate(plan._steps):
            rt._node = k
            if rows is not None and k == rows[0].node:
                taken = take_rows(rows[0], slots, rows[1])
            if cancel is not None and cancel.cancelled:
                raise Cancelled(f"run cancelled before node '{plan.nodes[k].name or plan.nodes[k].output[0]}'")
            if needed is not None and not needed[k]:
                for s in after[k][1]:
                    slots[s] = None
                for s in after[k][2]:
                    release(s)
                continue
            rt.counters = {}
            t0 = time.perf_counter()
            args = [slots[i] for i in ins]
            results = run(args, rt)
            dt = time.perf_counter() - t0
            check, clear, free = after[k]
            if check:
                plan._check_aliases(k, args, results)
            for s, v in zip(outs, results):
                slots[s] = v
            st = allocator.stats()
            node = plan.nodes[k]
            events.record(
                step,
                node.name or node.output[0],
                node.op_type,
                "execute",
                seconds=dt,
                committed=st.committed,
                live=st.live,
                peak=st.peak,
                **rt.counters,
            )
            if rt.cache_events:
                cst = cache_allocator.stats()
                for past, cost in rt.cache_events:
                    events.record(
                        step,
                        node.name or node.output[0],
                        node.op_type,
                        "cache_write",
                        committed=cst.committed,
                        live=cst.live,
                        peak=cst.peak,
                        extra={"cache": past},
                        **vars(cost),
                    )
                rt.cache_events.clear()
            for s in clear:
                slots[s] = None
            for s in free:
                release(s)
    except OnnxkvError:
        raise
    except Exception as e:
        raise _node_failure(plan, k, e) from e
    return taken
