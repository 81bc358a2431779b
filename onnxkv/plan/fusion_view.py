"""Plan-time fusion of chains of view and layout operators into one node.

Exports move every head split and merge through separate operators:
``Reshape(x, [B, S, H, D]) -> Transpose(perm=[0, 2, 1, 3])`` for each of q, k
and v, and ``Reshape -> Transpose -> Reshape`` after attention.  Each is cheap,
but each costs a step of the plan's run loop.  ``fuse_view_chains`` replaces
every chain of two or more such operators, each reading the previous one's
output as its data (input 0) and being its only reader, by one
``ai.onnxkv::ViewChain`` node (:class:`onnxkv.plan.ops.view_chain.ViewChain`)
that runs the same kernels one after the other: the results are exactly
those of the chain.  The chain's nodes are its ``body`` graph
(:func:`onnxkv.plan.fusion.fused_with_body`); the fused node reads the data
first, then every other value the chain reads, and keeps the last node's
output name.  A chain holds at most one ``Transpose`` (the only operator of
the set that writes a new array), so at most one step asks the plan for the
output buffer.  Intermediate values that are protected (graph outputs,
subgraph captures) end a chain.
"""

from __future__ import annotations

import onnx

from onnxkv.plan.fusion import default_op, fused_with_body, graph_index

__all__ = ["fuse_view_chains", "VIEW_OPS"]

#: Operators a chain may hold: input 0 is the data, the others shapes or axes.
VIEW_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")


def fuse_view_chains(nodes: list[onnx.NodeProto], protected: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with each chain of view/layout operators replaced by a ViewChain node (see the module docstring)."""
    readers, _, _ = graph_index(nodes, protected)

    def is_view(i: int) -> bool:
        n = nodes[i]
        return any(default_op(n, op) for op in VIEW_OPS) and len(n.output) == 1 and bool(n.input)

    taken: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for i in range(len(nodes)):
        if i in taken or not is_view(i):
            continue
        chain = [i]
        transposes = int(nodes[i].op_type == "Transpose")
        while True:
            out = nodes[chain[-1]].output[0]
            after = readers.get(out, [])
            if out in protected or len(after) != 1 or not is_view(after[0]):
                break
            j = after[0]
            if list(nodes[j].input).count(out) != 1 or nodes[j].input[0] != out:
                break
            transposes += nodes[j].op_type == "Transpose"
            if transposes > 1:
                break
            chain.append(j)
        if len(chain) < 2:
            continue
        taken.update(chain)
        replace[chain[-1]] = fused_with_body("ViewChain", [nodes[k] for k in chain], [nodes[chain[0]].input[0]])
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in taken or i in replace]
