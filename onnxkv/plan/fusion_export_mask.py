"""Fusion of the attention-mask chains exports rebuild every run into one ``ai.onnxkv::ExportMask`` node.

A ``torch.onnx.export`` of a ``transformers`` decoder computes its masks from
``attention_mask`` with 30 to 45 small nodes per run (Range, Unsqueeze,
comparisons, a Gather from the flattened mask, Expand, Where; a second chain
for sliding-window layers), each a Python node dispatch in a decode step.
:func:`fuse_export_masks` finds every value that
:func:`onnxkv.plan.mask_formula.mask_formula` proves to be a causal
(optionally windowed, optionally padded) mask and that a node outside those
chains reads, and replaces the nodes that compute them by one ``ExportMask``
node (:mod:`onnxkv.plan.ops.export_mask`) whose outputs are those values and
whose ``body`` holds the nodes, so its kernel can evaluate them literally when
a run falls outside the formula's run-time conditions.

The fused node stands right after the last producer of the values it reads
(so before every reader of its outputs).  A chain node whose output something
outside the chains also reads (a sequence length a reshape uses) stays in the
graph as well, computed twice; so does one whose value is protected (a
graph output, a value subgraphs read).  A protected mask is an output of the
fused node.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from onnxkv.plan.fusion import fused_with_body, graph_index, kept_nodes
from onnxkv.plan.mask_formula import analyse, mask_formula

__all__ = ["fuse_export_masks"]


def fuse_export_masks(
    nodes: list[onnx.NodeProto], protected: set[str], constants: Mapping[str, np.ndarray | None]
) -> list[onnx.NodeProto]:
    """``nodes`` with the proved mask chains replaced by one ExportMask node (see the module docstring)."""
    readers, producer, _ = graph_index(nodes, protected)
    made = set(producer)
    graph_inputs = {x for n in nodes for x in n.input if x and x not in made and x not in constants}
    values = analyse(nodes, constants, graph_inputs)
    described = {i for i, n in enumerate(nodes) if len(n.output) == 1 and n.output[0] in values}
    outputs = [
        n.output[0]
        for i, n in enumerate(nodes)
        if i in described
        and mask_formula(values[n.output[0]]) is not None
        and (n.output[0] in protected or any(r not in described for r in readers.get(n.output[0], [])))
    ]
    if not outputs:
        return nodes
    body: set[int] = set()
    stack = [producer[o] for o in outputs]
    while stack:
        i = stack.pop()
        if i in body:
            continue
        body.add(i)
        stack += [producer[x] for x in nodes[i].input if x in producer and producer[x] in described]
    inside = {o for i in body for o in nodes[i].output}
    external = {x for i in body for x in nodes[i].input if x and x not in inside}
    fused = fused_with_body("ExportMask", [nodes[i] for i in sorted(body)], [], outputs=outputs)
    keep = kept_nodes(nodes, body, set(outputs), protected)
    at = max((producer[x] for x in external if x in producer), default=-1) + 1
    out: list[onnx.NodeProto] = []
    for i, n in enumerate(nodes):
        if i == at:
            out.append(fused)
        if i not in body or i in keep:
            out.append(n)
    if at >= len(nodes):
        out.append(fused)
    return out
