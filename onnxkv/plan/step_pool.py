"""A plan's pool of idle compiled steps (:mod:`onnxkv.plan.compiled_step`), and when to record one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from onnxkv.plan.buffers import RunBuffers, slot_allocator
from onnxkv.plan.compiled_step import CompiledStep, cache_kinds, record
from onnxkv.plan.registry import baked_epoch
from onnxkv.plan.run_loops import run_nodes

if TYPE_CHECKING:
    from onnxkv.plan.context import RunContext
    from onnxkv.plan.plan import Plan

__all__ = ["StepPool"]


class StepPool:
    """A plan's idle compiled steps, and when to record one.

    The first run of a plan runs plain (a prompt rarely repeats its shapes).
    A later run takes the most recently used idle step whose graph-input
    shapes and cache storage fit (:meth:`CompiledStep.fits`: a decode step and
    a speculative verification of several tokens each keep their own, and so
    do contiguous and paged caches), or records one when
    none fits; at most :attr:`MAX_IDLE` steps are kept (the least recently
    used is closed).  A step is taken for one run and given back after it
    (stale steps are closed instead), so concurrent runs never share one.
    """

    #: Idle steps kept at most.
    MAX_IDLE = 8

    def __init__(self) -> None:
        self.idle: list[CompiledStep] = []  # least recently used first
        self.runs = 0

    def run(self, plan: Plan, slots: list, bufs: RunBuffers, rt: RunContext, cancel=None) -> CompiledStep | None:
        """Run ``plan`` on ``slots``: replay an idle step, record one, or run plain (the first run).

        Returns the step used (give it back with :meth:`done`), or None.
        """
        self.runs += 1
        step = self.take(slots, rt.caches)
        if step is not None:
            try:
                step.run(plan, slots, bufs, rt, cancel)
            except BaseException:
                self.done(step)
                raise
            return step
        if self.runs == 1:
            run_nodes(plan, 0, len(plan._steps), slots, bufs, rt, cancel)
            return None
        own = RunBuffers(plan.allocator)
        own.plan_alloc = slot_allocator(own, plan.persistent, plan.out_idx)
        try:
            return record(plan, slots, rt, bufs, own, cancel)
        except BaseException:
            own.close()
            raise

    def take(self, slots: list, caches: dict | None) -> CompiledStep | None:
        """The most recently used idle step that fits ``slots`` and ``caches`` (the run's), taken out of the
        pool (give it back with :meth:`done`), or None."""
        idle = self.idle
        epoch = baked_epoch()
        for i in range(len(idle) - 1, -1, -1):
            if idle[i].epoch != epoch:  # recorded with baked data since changed
                idle.pop(i).close()
        kinds = cache_kinds(caches)
        for i in range(len(idle) - 1, -1, -1):
            if idle[i].fits(slots, kinds):
                return idle.pop(i)
        return None

    def done(self, step: CompiledStep | None) -> None:
        """Give back the step a run used: idle again (the most recent), or closed when stale or compiling
        nothing; the least recently used idle step is closed past :attr:`MAX_IDLE`."""
        if step is None:
            return
        if step.stale or not step.compiled_nodes or step.epoch != baked_epoch():
            step.close()
            return
        self.idle.append(step)
        if len(self.idle) > self.MAX_IDLE:
            self.idle.pop(0).close()

    def close(self) -> None:
        """Close every idle step."""
        while self.idle:
            self.idle.pop().close()
