"""When each value of a plan may be dropped and when its buffer may be reused.

Buffer lifetime: values joined by possible views (each kernel class's
``view_inputs``, and the inputs a node must alias) form one *storage class*.
A value is released after its last use (as an input, an output or a
subgraph capture); its storage class's buffers go back to the allocator after
the last use of any member, unless a member is pinned (a graph output, a
value a nested plan reads, a constant): then the whole class is persistent
and never comes from the plan's allocator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx

from onnxkv.plan.graph_order import node_reads
from onnxkv.plan.registry import Op

__all__ = ["plan_lifetimes"]


def plan_lifetimes(
    nodes: Sequence[onnx.NodeProto],
    kernels: Sequence[Op],
    in_idx: Sequence[Sequence[int]],
    out_idx: Sequence[Sequence[int]],
    must_alias: Sequence[Sequence[tuple[int, int]]],
    slot_of: Mapping[str, int],
    n_slots: int,
    pinned: set[int],
) -> tuple[list[bool], list[tuple], list[tuple]]:
    """(persistent per slot, release list per node, free list per node) of a plan whose node k reads the
    slots ``in_idx[k]`` and writes ``out_idx[k]`` (-1: absent) among ``n_slots`` (``slot_of`` names them, for
    subgraph captures); ``pinned`` slots live past the run."""
    n = len(nodes)
    never = n + 1
    last_use = [-1] * n_slots
    for k in range(n):
        for s in out_idx[k]:
            if s >= 0:
                last_use[s] = max(last_use[s], k)
        for s in in_idx[k]:
            if s >= 0:
                last_use[s] = k
        for name in node_reads(nodes[k]):
            if name in slot_of and name not in nodes[k].input:
                last_use[slot_of[name]] = k
    for s in pinned:
        last_use[s] = never

    # Storage classes: union of values that may share memory through views.
    parent = list(range(n_slots))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for k, kernel in enumerate(kernels):
        for pos in set(kernel.view_inputs) | {i for _, i in must_alias[k]}:
            if pos < len(in_idx[k]) and in_idx[k][pos] >= 0:
                for o in out_idx[k]:
                    if o >= 0:
                        parent[find(o)] = find(in_idx[k][pos])
    class_end: dict[int, int] = {}
    for s in range(n_slots):
        r = find(s)
        class_end[r] = max(class_end.get(r, -1), last_use[s])
    # A value may use the allocator if its storage class never reaches the caller.
    persistent = [class_end[find(s)] >= never for s in range(n_slots)]
    release: list[list[int]] = [[] for _ in range(n)]
    frees: list[list[int]] = [[] for _ in range(n)]
    for s in range(n_slots):
        if 0 <= last_use[s] < never:
            release[last_use[s]].append(s)
        end = class_end[find(s)]
        if 0 <= end < never:
            frees[end].append(s)
    return persistent, [tuple(r) for r in release], [tuple(f) for f in frees]
