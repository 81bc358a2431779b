"""The literal fallback of fused nodes: their replaced nodes, evaluated one by one (not an operator).

A fusion of :mod:`onnxkv.plan.fusion` / :mod:`onnxkv.plan.fusion_torch`
that can only prove its arithmetic at run time stores the nodes it replaced as
the fused node's ``body`` graph attribute; the graph's inputs are values the
fused node reads (by the same names) and its outputs are the fused node's
outputs.  :class:`Body` builds one registered kernel (or the
``onnx.reference`` fallback) per body node when the plan is built, and
evaluates them whenever the fused kernel cannot express a call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from onnxkv.plan.context import RunContext
from onnxkv.plan.fallback import FallbackOp
from onnxkv.plan.registry import BuildContext, Op, lookup

__all__ = ["Body"]


class Body:
    """The ``body`` graph of a fused node, built into kernels.

    Attributes:
        steps: (node, kernel) per body node, in the graph's (topological) order.
        outputs: names of the graph outputs, in order.
    """

    def __init__(self, graph: onnx.GraphProto, ctx: BuildContext) -> None:
        self.steps: list[tuple[onnx.NodeProto, Op]] = []
        for n in graph.node:
            cls = lookup(n.domain, n.op_type, ctx.opset(n.domain))
            self.steps.append((n, cls(n, ctx) if cls is not None else FallbackOp(n, ctx)))
        self.outputs = [o.name for o in graph.output]

    @classmethod
    def of(cls, op: Op, ctx: BuildContext, fixed: Sequence[str]) -> Body:
        """The ``body`` of fused node ``op`` whose fixed inputs (by position) are ``fixed``.

        Raises ModelError naming the node when the attribute is missing or the
        node has fewer inputs.
        """
        body = op.attrs.get("body")
        if not isinstance(body, onnx.GraphProto) or len(op.node.input) < len(fixed):
            raise op.error(f"needs a 'body' graph and at least the inputs ({', '.join(fixed)})")
        return cls(body, ctx)

    def kernel(self, op_type: str) -> Op | None:
        """The kernel of the first body node of ``op_type``, or None."""
        return next((k for n, k in self.steps if n.op_type == op_type), None)

    def node(self, op_type: str) -> onnx.NodeProto | None:
        """The first body node of ``op_type``, or None."""
        return next((n for n, _ in self.steps if n.op_type == op_type), None)

    def evaluate(self, names, inputs: list, rt: RunContext) -> list[np.ndarray]:
        """The graph outputs for ``inputs`` (one array or None per name of ``names``, the fused node's inputs).

        Temporaries come from NumPy, not from the plan's buffers, since the
        plan knows nothing of the body's values.  Everything else a body node
        leaves for the run (deferred commits and rollbacks of storage it
        changed, storage counters, cache events) goes to the fused node's
        ``rt``, so a failed run undoes a body node's writes too.
        """
        values = {name: x for name, x in zip(names, inputs) if name}
        sub = rt.nested(lambda _rt, _i, shape, dtype: np.empty(shape, dtype))
        for node, kernel in self.steps:
            outs = kernel.run([values[x] if x else None for x in node.input], sub)
            values.update((name, val) for name, val in zip(node.output, outs) if name)
        return [values[name] for name in self.outputs]
