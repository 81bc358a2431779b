"""Compiled steps: a plan's run with its compilable nodes replayed as recorded kernel calls.

A decode step runs the same nodes on the same shapes as the step before it.
A :class:`CompiledStep` is made by one recording run (:func:`record`) that runs
every node as the plain loop does and, for each node whose operator says it
is compilable at these inputs (:meth:`onnxkv.plan.registry.Op.compilable`),
records the kernel calls it made (:mod:`onnxkv._kernels._record`).  Runs of
consecutive compiled nodes become *segments*, each one
:class:`onnxkv._kernels.step.Program`; the other nodes stay Python nodes.
Later runs (:meth:`CompiledStep.run`) run the Python nodes as the plain loop
does and each segment as one call into its program, which takes the segment's
*external* values -- the slots it reads that the segment does not produce and
that are not constants: graph inputs and Python nodes' outputs -- checks that
they have the recorded shapes, dtypes and memory relations, and replays the
calls with their current addresses.  A segment whose check fails runs its
nodes in Python instead, and the step is then marked stale (the plan records
a new one on a later run); one whose calls refuse the run's values (a full
cache, which the Python path grows; an id out of range, which it refuses)
runs in Python too but stays.  The caches the decode calls write are
*resizable* externals: a replay reads their capacity, so a step serves a
cache that grew and the caches of a new state.

Memory: the values produced inside segments live in buffers the step owns (a
:class:`~onnxkv.plan.buffers.RunBuffers` the compilable nodes of the
recording run allocate from, never handed to another run; Python nodes take
the run's buffers, when recording as when replaying: a node tried for the
step that stays a Python node leaves its outputs' buffers to the step, unused),
so a replay writes the
same addresses as the recording and never memory a Python node holds.  Slots
that later nodes or the graph outputs read are set to those arrays after the
segment ran; :meth:`CompiledStep.owned_outputs` names the graph outputs that
are the step's memory, which the plan copies before returning them.  A
segment's external values that an earlier segment made are step memory too,
which the buffers may have handed to this segment's calls again: they are
pinned (a replay needs them at their recorded address, so a segment after one
that ran in Python runs in Python too).

A value a call takes whole with its length read when replayed (the attention
mask of ``MaskLengths``: :meth:`~onnxkv._kernels._record.Recorder.ragged_last`)
is a *ragged* external of its program, and a graph input that is one enters
the step's signature without its last dim, so that one step serves a mask
that grows by a column per token; a node reading it is only compiled when no
other node reads it (another compiled node would have its shape baked).

Calls that write a state's cache (the fused decode attention) take the cache
buffers of the run by name, and carry an *effect* (see
:mod:`onnxkv._kernels._record`) that the replay runs around the program: its
``before`` prepares what the calls check, its ``after`` stages what they wrote
as the operator would and sets the node outputs it names.

A node whose operator reads only its inputs' shapes (``Op.shape_only``: a
reshape target made by ``ShapeOf``) and whose inputs the open segment made
joins it with no call: those shapes are the step's, so its value is kept as a
constant of the step; so does a deterministic node whose inputs are constants
and such kept values (a rotary width computed from a shape); a compilable node whose recorded calls
depend on the values of some inputs (``Op.replay_fixed``: a rotation's slice bounds) is recorded only when
those are constants or such kept values.  A node whose operator declares ``view_inputs`` and
whose viewed inputs the open segment made (its other inputs constants or such
kept values) joins the segment with no call
when its outputs are C-contiguous views inside those inputs (a reshape of a
product: step memory at a fixed address), or with the calls of a copy its
operator recorded (a strided Slice packed by rows); a copy that was not
recorded would be baked, so it stays a Python node.  A value that an effect sets (a present view) may be read by
later nodes only at inputs their recorded calls do not read
(``Op.replay_unread``), and a value taken ragged by several nodes only when
every reader declares it (``Op.ragged_inputs``: an export's mask, read by
every layer's attention).

A step is used by one run at a time (the plan keeps idle steps in a pool, as
its idle buffers).  Outputs equal the plain loop's bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx

from onnxkv._kernels._record import Recorder
from onnxkv._kernels.step import Program
from onnxkv.errors import Cancelled
from onnxkv.plan.buffers import RunBuffers
from onnxkv.plan.context import RunContext
from onnxkv.plan.folding import NON_DETERMINISTIC
from onnxkv.plan.ops._gqa_paged_decode import PagedAppend
from onnxkv.plan.registry import baked_epoch
from onnxkv.plan.run_loops import run_nodes

if TYPE_CHECKING:
    from onnxkv.plan.plan import Plan

__all__ = ["CompiledStep", "Segment", "cache_kinds", "record"]


class Segment:
    """Consecutive compiled nodes ``[first, end)`` replayed as one program.

    Attributes:
        program: the recorded kernel calls.
        external_slots: the values :attr:`program` takes each run, in its order: a slot (int), the name
            of a cache (str) whose current buffer the calls write, or ``(cache name, attribute)`` of a paged
            cache's tables the calls read (``page_addresses``, ``tables``: they change as pages are staged).
        exports: ``(slot, array)`` for every value produced here that a later node or a graph output reads.
        effects: ``(effect, output slots of its node)`` per recorded call with an effect (see
            :mod:`onnxkv._kernels._record`), in node order.
    """

    __slots__ = ("first", "end", "program", "external_slots", "exports", "effects")

    def __init__(
        self, first: int, end: int, program: Program, external_slots: list, exports: list, effects: list
    ) -> None:
        self.first, self.end = first, end
        self.program = program
        self.external_slots = external_slots
        self.exports = exports
        self.effects = effects

    def replay(self, slots: list, rt: RunContext) -> bool | None:
        """Run the program on this run's values: True once it ran; False (nothing run) when they differ from
        the recording's; None (nothing run but prelude calls) when they are the recording's but a call
        refuses them (a full cache, an id out of range: the Python path grows or raises)."""
        caches = rt.caches
        try:
            if self.effects:
                for effect, _ in self.effects:
                    if not effect.before(caches):
                        return False
            externals = [
                slots[s] if type(s) is int else caches[s].buffer if type(s) is str else getattr(caches[s[0]], s[1])
                for s in self.external_slots
            ]
        except (KeyError, TypeError, AttributeError):  # a cache this run does not have, or not a contiguous one
            return False
        try:
            ran = self.program.run(externals)
        except BaseException:  # a call could not allocate: the bytes the calls before it wrote over go back
            for effect, _ in self.effects:
                kept = getattr(effect, "kept", None)
                if kept is not None:
                    kept(caches)
            raise
        if not ran:
            return None if self.program.refused else False
        for s, v in self.exports:
            slots[s] = v
        for effect, outs in self.effects:
            for index, value in effect.after(rt):
                slots[outs[index]] = value
        return True


class CompiledStep:
    """A recorded run of a plan: Python nodes (ints) and :class:`Segment` items in node order.

    Attributes:
        items: node indices and segments, covering every node once, in order.
        buffers: the recording run's buffers (the memory of every segment), owned by this step.
        stale: a segment's check failed on a run, or the recording run was transient (a node ran in Python
            for values of that run only, see ``Recorder.transient``), or an operator changed data the
            recorded calls bake (:func:`~onnxkv.plan.registry.bump_baked_epoch`): the plan drops the step.
    """

    def __init__(
        self, items: list, buffers: RunBuffers, output_slots: set[int], signature: tuple = (), caches: tuple = ()
    ) -> None:
        self.items = items
        #: ``items`` with each run of consecutive Python nodes as one ``(first, end)`` range (one loop call).
        self._runs = _python_ranges(items)
        self.buffers = buffers
        self.stale = False
        #: :func:`~onnxkv.plan.registry.baked_epoch` when recorded: a later change of baked data drops the step.
        self.epoch = baked_epoch()
        self._compiled_nodes = sum(item.end - item.first for item in items if isinstance(item, Segment))
        exported = {s for item in items if isinstance(item, Segment) for s, _ in item.exports}
        #: Graph output slots whose value is this step's memory (copied before they are returned).
        self.owned_outputs = exported & output_slots
        #: ``(slot, shape)`` of the graph inputs the segments take (a run whose inputs differ there would fail
        #: their checks: :class:`~onnxkv.plan.step_pool.StepPool` gives it another step); the shape of a ragged one lacks its last dim.
        self.signature = signature
        #: :func:`cache_kinds` of the recording run's caches: a run whose caches are stored otherwise (paged,
        #: or in another format) takes other operator paths, so it takes another step.
        self.caches = caches

    def fits(self, slots: list, caches: tuple) -> bool:
        """Whether the graph inputs of ``slots`` have the shapes this step's segments were recorded with
        (a ragged input's last dim aside) and ``caches`` (:func:`cache_kinds` of the run's) are its."""
        if caches != self.caches:
            return False
        for s, shape, ragged in self.signature:
            v = slots[s]
            if v is None or (v.shape[:-1] != shape if ragged else v.shape != shape):
                return False
        return True

    @property
    def compiled_nodes(self) -> int:
        """How many nodes run as recorded kernel calls."""
        return self._compiled_nodes

    def run(self, plan: Plan, slots: list, bufs: RunBuffers, rt: RunContext, cancel=None) -> None:
        """Run ``plan`` on ``slots`` (bound inputs) as the plain loop does, segments replayed.

        Python nodes take their temporaries from ``bufs`` (the run's); a segment
        whose external values differ from the recording, or whose calls refuse
        this run's values (a full cache, an id out of range), runs its nodes
        through the plain loop too (with ``bufs``); the first marks the step
        stale, the second does not (the next run may replay it).
        """
        for item in self._runs:
            if type(item) is tuple:
                run_nodes(plan, item[0], item[1], slots, bufs, rt, cancel)
                continue
            if cancel is not None and cancel.cancelled:
                node = plan.nodes[item.first]
                raise Cancelled(f"run cancelled before node '{node.name or node.output[0]}'")
            ran = item.replay(slots, rt)
            if not ran:
                # values a call refuses (a full cache, a hostile id) are this run's (None); other externals are not
                self.stale |= ran is False
                run_nodes(plan, item.first, item.end, slots, bufs, rt, cancel)

    def close(self) -> None:
        """Return the step's buffers to the allocator."""
        self.buffers.close()


def _python_ranges(items: list) -> list:
    """``items`` (Python node indices and segments, in order) with each run of consecutive node indices as
    one ``(first, end)`` tuple."""
    out: list = []
    for item in items:
        if type(item) is int:
            if out and type(out[-1]) is tuple and out[-1][1] == item:
                out[-1] = (out[-1][0], item + 1)
            else:
                out.append((item, item + 1))
        else:
            out.append(item)
    return out


def record(plan: Plan, slots: list, rt: RunContext, bufs: RunBuffers, own: RunBuffers, cancel=None) -> CompiledStep:
    """Run ``plan`` on ``slots`` like the plain loop, recording its compilable nodes; return the step.

    Compilable nodes take their buffers from ``own`` (which the returned step
    then owns), the others from ``bufs`` (the run's), as they do when the step
    is replayed: the two never share memory.  Raises what the plain loop raises
    (the step is then not made and ``own`` is the caller's to close).
    """
    steps = plan._steps
    constant = [v is not None for v in plan._template]
    last_read = _last_reads(plan)
    outputs = set(plan.output_slots)
    items: list = []
    current: list = []  # the open segment: node indices
    calls: list = []
    external: dict = {}  # slot, cache name or (name, attribute) -> the value the open segment read (or wrote)
    produced: dict[int, np.ndarray] = {}  # slot -> value made in the open segment
    effects: list = []  # (effect, output slots of its node)
    ragged: set[int] = set()  # ids of the open segment's external values taken ragged
    ragged_slots: set[int] = set()  # slots of the values segments take ragged
    step_memory: set[int] = set()  # ids of the values closed segments export (kept alive by them)
    readers = _reader_counts(plan)
    ragged_readers = _RaggedReaders(plan)
    unread_after = _UnreadAfter(plan)
    transient = False  # a node could not be recorded for this run's values only: the step serves this run
    fixed: set[int] = set()  # slots of shape-only nodes' values kept for the step (constants of its replays)
    packable = _layout_free_slices(plan)
    epoch = baked_epoch()

    def close_segment() -> None:
        if not current:
            return
        first, end = current[0], current[-1] + 1
        exports = [(s, v) for s, v in produced.items() if s in outputs or last_read.get(s, -1) >= end]
        # Values of earlier segments are the step's memory, which the buffers may have handed to this
        # segment's calls again: a replay needs them where they were recorded.
        pinned = [e for e, v in enumerate(external.values()) if _derived(v, step_memory)]
        uneven = [e for e, v in enumerate(external.values()) if id(v) in ragged]
        try:
            caches = [e for e, s in enumerate(external) if type(s) is str]  # a new state's, or grown: any capacity
            # A value this segment exports lies in the step's memory.  One that lies in a value made outside the
            # segment (memory the recording handed out again once that value was dead: an earlier segment's
            # export, or a view of one, which NumPy's collapsed bases do not tell) would be written into that
            # value's memory of the replayed run while the segment exports its own stale array: such a
            # segment's nodes run in Python.
            if any(_overlaps(v, x) for _, v in exports for s, x in external.items() if type(s) is int):
                raise ValueError("an exported value lies in a value made outside the segment")
            program = Program(list(calls), list(external.values()), pinned, uneven, caches)
        except ValueError:
            items.extend(current)
        else:
            # the exports' memory is never handed out again in the step: a later segment that reads one (or a
            # view of one) and writes a value of its own there would export a stale array whenever this
            # segment runs in Python (a refused replay) and the export lies elsewhere
            _retire(own, [s for s, _ in exports])
            PagedAppend.group([effect for effect, _ in effects])  # one state's cache: staged once per replay
            items.append(Segment(first, end, program, list(external), exports, list(effects)))
            step_memory.update(id(v) for _, v in exports)
            ragged_slots.update(s for s, v in external.items() if id(v) in ragged)
        current.clear()
        calls.clear()
        external.clear()
        produced.clear()
        effects.clear()
        ragged.clear()

    for k, (_, ins, outs) in enumerate(steps):
        args = [slots[i] for i in ins]
        op = plan.kernels[k]
        if (
            op is not None
            and current
            and (
                (op.shape_only and all(i in produced for i in ins))
                or (
                    any(i in fixed for i in ins)
                    and all(constant[i] or i in fixed or slots[i] is None for i in ins)
                    and _pure(plan.nodes[k])
                )
            )
        ):
            # the shapes of values this segment makes are the step's, and so is a pure function of them and of
            # constants: the node's value is kept for the step (no call)
            run_nodes(plan, k, k + 1, slots, own, rt, cancel)
            current.append(k)
            produced.update((s, slots[s]) for s in outs)
            fixed.update(outs)
            continue
        # a view of a value this segment makes (a reshape of a product): no call, its memory is the step's
        segment_view = bool(op is not None and op.view_inputs and current) and all(
            i in produced if j in op.view_inputs else constant[i] or i in fixed or slots[i] is None
            for j, i in enumerate(ins)
        )
        if not (
            op is not None
            and all(isinstance(a, np.ndarray) or a is None for a in args)
            and (segment_view or op.compilable(args))
            and all(constant[ins[j]] or ins[j] in fixed for j in op.replay_fixed if j < len(ins))
        ):
            close_segment()
            run_nodes(plan, k, k + 1, slots, bufs, rt, cancel)
            items.append(k)
            continue
        unread = op.replay_unread
        reads = {
            i: slots[i]
            for j, i in enumerate(ins)
            if j not in unread and not constant[i] and i not in produced and slots[i] is not None
        }
        recorder = Recorder()
        recorder.pack_views = k in packable
        rt._plan_alloc, rt._scratch = own.plan_alloc, own  # its outputs and temporaries: the step's memory
        try:
            with recorder:
                run_nodes(plan, k, k + 1, slots, own, rt, cancel)
        finally:
            rt._plan_alloc, rt._scratch = bufs.plan_alloc, bufs
        results = [slots[s] for s in outs]
        transient |= recorder.transient
        set_by_effects = {j for effect in recorder.effects for j in effect.outputs}
        uneven = {id(a) for a in recorder.ragged}
        if (
            recorder.refused
            # its shape read elsewhere
            or any(not ragged_readers(s) for s, v in reads.items() if id(v) in uneven and readers.get(s, 0) > 1)
            or (op.view_inputs and not (segment_view and _views_or_copies(results, args, op.view_inputs, recorder)))
            or not all(r is None or isinstance(r, np.ndarray) for r in results)
            # a node reads a present the effect sets, other than as the cache its own recorded call reads
            or any(not unread_after(outs[j], k) for j in set_by_effects)
        ):
            close_segment()
            _retire(own, outs)
            items.append(k)
            continue
        current.append(k)
        calls.extend(recorder.calls)
        external.update(reads)
        external.update(recorder.caches)
        effects.extend((effect, outs) for effect in recorder.effects)
        ragged.update(uneven)
        produced.update(
            (s, v) for j, (s, v) in enumerate(zip(outs, results)) if v is not None and j not in set_by_effects
        )
    close_segment()
    inputs = set(plan.input_slots)
    taken = {s for item in items if isinstance(item, Segment) for s in item.external_slots if s in inputs}
    signature = tuple(
        (s, slots[s].shape[:-1], True) if s in ragged_slots else (s, slots[s].shape, False) for s in sorted(taken)
    )
    step = CompiledStep(items, own, outputs, signature, cache_kinds(rt.caches))
    step.stale = transient or epoch != step.epoch  # baked data changed while recording: record again
    return step


#: Operators whose values do not depend on their inputs' memory layout (the same arithmetic on a strided view
#: as on a packed copy of it) and whose outputs are arrays of their own.
_LAYOUT_FREE = frozenset({"Concat", "RotateHalf", "Add", "Sub", "Mul", "Div", "Neg", "Softcap", "Shape", "ShapeOf"})


def _layout_free_slices(plan: Plan) -> set[int]:
    """The Slice nodes whose every reader is a ``_LAYOUT_FREE`` operator: recorded, they may return a packed
    copy of a strided view (``Recorder.pack_views``), and the step's values stay the plain loop's bit for bit."""
    readers: dict[int, list[int]] = {}
    for k, (_, ins, _) in enumerate(plan._steps):
        for i in ins:
            readers.setdefault(i, []).append(k)
    return {
        k
        for k, (_, _, outs) in enumerate(plan._steps)
        if plan.nodes[k].op_type == "Slice"
        and all(plan.nodes[r].op_type in _LAYOUT_FREE for s in outs for r in readers.get(s, ()))
    }


def _pure(node) -> bool:
    """Whether ``node``'s outputs are a function of its inputs alone (what constant folding may run)."""
    return node.op_type not in NON_DETERMINISTIC and not any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    )


def _views_or_copies(results: list, args: list, view_inputs: tuple, recorder: Recorder) -> bool:
    """Whether a view node's results are step memory at fixed addresses: views of its inputs (no call,
    :func:`_views`), or copies its recorded calls made (a strided Slice packed: arrays of their own, sharing no
    memory with the inputs)."""
    if not recorder.calls:
        return _views(results, args, view_inputs)
    return all(
        isinstance(r, np.ndarray)
        and r.flags.c_contiguous
        and not any(np.may_share_memory(r, a) for a in args if a is not None)
        for r in results
    )


def _views(results: list, args: list, view_inputs: tuple) -> bool:
    """Whether every result of a view node is a C-contiguous array inside the memory of one of its inputs at
    ``view_inputs`` (values of the open segment, alive while the node runs: memory a buffer could not have been
    handed out of again), i.e. a view of step memory at a fixed address, not a copy."""
    spans = [
        (a, a + v.nbytes)
        for j in view_inputs
        if j < len(args) and isinstance(v := args[j], np.ndarray)
        for a in (v.__array_interface__["data"][0],)
    ]
    for r in results:
        if r is None:
            continue
        if not r.flags.c_contiguous:
            return False
        lo = r.__array_interface__["data"][0]
        if not any(a <= lo and lo + r.nbytes <= b for a, b in spans):
            return False
    return True


class _RaggedReaders:
    """``(slot)`` -> whether every node reading the slot takes it as a ragged input of its recorded call
    (``Op.ragged_inputs``) and no graph output is it: then several compiled nodes may take it ragged."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._known: dict[int, bool] = {}

    def __call__(self, slot: int) -> bool:
        known = self._known.get(slot)
        if known is None:
            plan = self._plan
            known = slot not in plan.output_slots and all(
                p in getattr(plan.kernels[k], "ragged_inputs", ())
                for k, (_, ins, _) in enumerate(plan._steps)
                for p, i in enumerate(ins)
                if i == slot
            )
            self._known[slot] = known
        return known


class _UnreadAfter:
    """``(slot, node)`` -> whether every node after ``node`` reading the slot reads it at an input its recorded
    call does not read (``Op.replay_unread``: a present view whose cache the call takes by name)."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def __call__(self, slot: int, node: int) -> bool:
        plan = self._plan
        return all(
            p in getattr(plan.kernels[k], "replay_unread", ())
            for k in range(node + 1, len(plan._steps))
            for p, i in enumerate(plan._steps[k][1])
            if i == slot
        )


def _retire(own: RunBuffers, outs) -> None:
    """The buffers ``own`` holds for the output slots ``outs`` of a node that ran for the step but stays a
    Python node: kept by the step until it closes, never handed out again.  Back in ``own``'s free lists
    after their last read, they would go to a later compiled node, whose operand a segment reading the
    Python node's output would take for that external's memory (and write the run's value there on
    replay, never the step's own array)."""
    for s in outs:
        entry = own.held.pop(s, None)
        if entry is not None:
            own.retired.append(entry)


def cache_kinds(caches: dict | None) -> tuple:
    """How a run's caches (past input name -> cache) are stored: (paged, storage format, block size or None)
    of each, in order (a paged decode call addresses its pages by the block size it was recorded with)."""
    if not caches:
        return ()
    return tuple(
        (getattr(c, "paged", False), getattr(c, "storage", None), getattr(c, "block_size", None))
        for c in caches.values()
    )


def _overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the memory spans of arrays ``a`` and ``b`` (from their first to their last byte, strides of
    either sign) share a byte."""
    if a.size == 0 or b.size == 0:
        return False
    (lo_a, hi_a), (lo_b, hi_b) = _span(a), _span(b)
    return lo_a < hi_b and lo_b < hi_a


def _span(a: np.ndarray) -> tuple[int, int]:
    """``[first byte, last byte + 1)`` of a non-empty array's elements."""
    lo = hi = a.__array_interface__["data"][0]
    for n, st in zip(a.shape, a.strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + a.itemsize


def _derived(value: np.ndarray, arrays: set[int]) -> bool:
    """Whether ``value`` is one of ``arrays`` (ids) or a view of one (its bases end at the first object that is
    no array: a buffer such as the bytes a model's constant was read from)."""
    while isinstance(value, np.ndarray):
        if id(value) in arrays:
            return True
        value = value.base
    return False


def _reader_counts(plan: Plan) -> dict[int, int]:
    """slot -> how many nodes read it (a graph output counts as one more)."""
    counts: dict[int, int] = {}
    for _, ins, _ in plan._steps:
        for i in set(ins):
            counts[i] = counts.get(i, 0) + 1
    for s in plan.output_slots:
        counts[s] = counts.get(s, 0) + 1
    return counts


def _last_reads(plan: Plan) -> dict[int, int]:
    """slot -> index of the last node reading it."""
    last: dict[int, int] = {}
    for k, (_, ins, _) in enumerate(plan._steps):
        for i in ins:
            last[i] = k
    return last
