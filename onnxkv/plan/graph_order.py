"""The order of a graph's nodes and what each reads, for :class:`onnxkv.plan.plan.Plan`.

``topological`` sorts nodes so that every value is produced before it is read
(ties by position, so an already sorted graph keeps its order) and checks that
every value read is defined once; ``node_reads`` lists a node's inputs and the
names its subgraphs capture.
"""

from __future__ import annotations

import heapq

import onnx

from onnxkv.errors import ModelError
from onnxkv.model.scopes import scope_names, subgraphs

__all__ = ["dims", "node_label", "node_reads", "topological"]


def dims(vi: onnx.ValueInfoProto) -> tuple | None:
    """The static shape of a value info (an int, a dim_param name or None per dim); None without a shape."""
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)


def node_label(node: onnx.NodeProto) -> str:
    """How errors name a node: its operator and its name (or first output)."""
    return f"{node.op_type} node '{node.name or (node.output[0] if node.output else '')}'"


def topological(nodes: list[onnx.NodeProto], known: set[str]) -> list[onnx.NodeProto]:
    """Nodes in an order where every input is produced before it is read.

    Raises:
        ModelError: a node reads (as an input or a subgraph capture) a value
            that is neither ``known`` (an initializer or graph input) nor any
            node's output, a value is produced twice (or shadows a known one),
            or the graph has a cycle.
    """
    producers: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.output:
            if not o:
                continue
            if o in producers or o in known:
                first = node_label(nodes[producers[o]]) if o in producers else "an initializer or graph input"
                raise ModelError(
                    f"{node_label(n)} writes the value '{o}', which {first} already defines "
                    "(every value must have one producer)"
                )
            producers[o] = i
    for n in nodes:
        for x in node_reads(n):
            if x not in producers and x not in known:
                raise ModelError(
                    f"{node_label(n)} reads the value '{x}', which no node, initializer or graph input defines"
                )
    deps = [{producers[x] for x in node_reads(n) if x in producers and x not in known} for n in nodes]
    users: list[list[int]] = [[] for _ in nodes]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    pending = [len(d) for d in deps]
    ready = [i for i, p in enumerate(pending) if p == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        done = set(order)
        stuck = [nodes[i].name or nodes[i].op_type for i in range(len(nodes)) if i not in done]
        raise ModelError(f"graph has a cycle; stuck nodes: {stuck[:8]}")
    return [nodes[i] for i in order]


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Every value a node reads: its inputs plus names its subgraphs capture."""
    reads = [x for x in node.input if x]
    for g in subgraphs(node):
        reads.extend(scope_names(g))
    return reads
