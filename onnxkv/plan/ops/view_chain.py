"""``ai.onnxkv::ViewChain``: a chain of view/layout operators run as one plan node.

Made by :func:`onnxkv.plan.fusion_view.fuse_view_chains`.  Input 0 is the
chain's data, the others the values its operators read besides (reshape
targets, axes); attribute ``body`` holds the chain (``Reshape``,
``Transpose``, ``Squeeze``, ``Unsqueeze``, ``Flatten``; at most one
``Transpose``).  Output: the last operator's result, a view of input 0 or
the one array the ``Transpose`` writes (from the plan's buffer for this
output).  Each operator runs its registered kernel on the previous result,
so the output is exactly the chain's.
"""

from __future__ import annotations

from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._body import Body
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["ViewChain"]

#: Marks the input position that takes the previous step's result.
_PREVIOUS = -1


@register("ViewChain", domain="ai.onnxkv")
class ViewChain(Op):
    """See the module docstring."""

    view_inputs = (0,)

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        body = Body.of(self, ctx, ("x",))
        names = list(node.input)
        steps = []
        previous = node.input[0]
        for n, kernel in body.steps:
            if not n.input or n.input[0] != previous or any(x and x != previous and x not in names for x in n.input):
                raise self.error(f"body node '{n.name or n.output[0]}' does not continue the chain from "
                                 f"'{previous}' over the node's inputs")
            steps.append((kernel.run, tuple(_PREVIOUS if x == previous else names.index(x) if x else None
                                            for x in n.input)))
            previous = n.output[0]
        self._steps = tuple(steps)

    def run(self, inputs: list, rt: RunContext) -> tuple:
        y = inputs[0]
        for run, sources in self._steps:
            y = run([y if s == _PREVIOUS else None if s is None else inputs[s] for s in sources], rt)[0]
        return (y,)
