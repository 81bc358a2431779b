"""Fallback kernels for the standard-operator long tail, from ``onnx.reference``.

Operators onnxkv has no kernel for, in the default ONNX domain, run through
the operator classes of ``onnx.reference`` instead of being rewritten by
hand; an operator ONNX defines by a function body (Mish, HardSwish,
MeanVarianceNormalization, ...) runs that body through
``onnx.reference.ReferenceEvaluator``.  They are correct but slow;
``onnxkv inspect`` lists the nodes that use them so a hot one can be given a
real kernel.  Outputs may share memory with any input (the reference classes
do not promise otherwise), which the plan accounts for through
``view_inputs``.

Values are tensors: a node whose reference implementation returns a
sequence raises :class:`~onnxkv.errors.OperatorError` naming it.  A node
with a subgraph attribute (If, Loop, Scan, ...) has no fallback (a
:class:`~onnxkv.errors.ModelError` naming it and the attribute), nor has an
operator whose function body depends on the input types (a
context-dependent function: :func:`has_fallback` is False).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops import load_op

from onnxkv.errors import OperatorError
from onnxkv.plan.registry import DOMAIN_ALIASES, BuildContext, Op

__all__ = ["FallbackOp", "has_fallback"]


@cache
def _reference_class(domain: str, op_type: str, version: int):
    if DOMAIN_ALIASES.get(domain, domain) != "":
        return None
    try:
        return load_op("", op_type, version or None, evaluator_cls=ReferenceEvaluator)
    except Exception:
        return None


def has_fallback(domain: str, op_type: str, version: int) -> bool:
    """True if ``onnx.reference`` implements this operator at this opset."""
    return _reference_class(domain, op_type, version) is not None


class FallbackOp(Op):
    """A node run by the ``onnx.reference`` implementation of its operator."""

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.op_type = node.op_type
        self.domain = node.domain
        cls = _reference_class(node.domain, node.op_type, ctx.opset(node.domain))
        if cls is None:
            raise self.error("no kernel and no onnx.reference implementation")
        graphs = [a.name for a in node.attribute if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)]
        if graphs:
            raise self.error(
                f"no kernel, and the onnx.reference fallback runs no subgraph (attribute(s) {graphs}); "
                "expected an operator without graph attributes"
            )
        self.view_inputs = tuple(range(len(node.input)))
        self._impl: OpRun = cls(
            node,
            {
                "log": lambda *a: None,
                "opsets": dict(ctx.opsets),
                "verbose": 0,
                "new_ops": None,
                "existing_functions": {},
                "evaluator_cls": None,
            },
        )

    def run(self, inputs: list, rt) -> list:
        res = self._impl.run(*inputs)
        for name, r in zip(self.node.output, res):
            if isinstance(r, list):
                raise OperatorError(
                    f"{self.op_type} node '{self.name}': output '{name}' is a sequence of "
                    f"{len(r)} tensors; onnxkv values are tensors"
                )
        return [None if r is None else np.asarray(r) for r in res]
