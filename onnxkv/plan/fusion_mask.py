"""Fusion of the mask lengths that GroupQueryAttention graphs compute every step.

The ONNX Runtime GenAI model builder derives GroupQueryAttention's
``seqlens_k`` and ``total_sequence_length`` from ``attention_mask`` [B, L]
with two chains of small nodes::

    Cast(Sub(ReduceSum(mask, axes, keepdims=0), one), to=INT32)   # seqlens_k [B]
    Cast(Gather(Shape(mask), index, axis=0), to=INT32)            # total_sequence_length

:func:`fuse_mask_lengths` replaces each such pair over one mask by one
``ai.onnxkv::MaskLengths`` node (inputs: the mask, then the constants the
chains read; outputs: the two Casts' values), with the six nodes as its
``body`` (:func:`onnxkv.plan.fusion.fused_with_body`): its kernel
(:mod:`onnxkv.plan.ops.mask_lengths`) computes both values in one call when
the constants are ``axes`` [1], ``one`` 1 and ``index`` 1, and evaluates the
body literally otherwise.  Five node dispatches fewer per decode step.

Matched structurally: the intermediate values have this chain as their only
reader and are not graph outputs, ReduceSum keeps no dims, Shape has no
start/end, Gather's axis is 0, both Casts go to int32.  The fused node takes
the place of the later of the two Casts, so every value it reads is made
before it; a pair whose outputs are read before that place is left alone.
"""

from __future__ import annotations

import onnx

from onnxkv.plan.fusion import default_op, fused_with_body, graph_index

__all__ = ["fuse_mask_lengths"]

_INT32 = onnx.TensorProto.INT32


def _attr(node: onnx.NodeProto, name: str, default):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def fuse_mask_lengths(nodes: list[onnx.NodeProto], protected: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with each GenAI mask-length pair replaced by a MaskLengths node (see the module docstring)."""
    readers, _, single = graph_index(nodes, protected)

    def to_int32(i: int) -> bool:
        return default_op(nodes[i], "Cast") and _attr(nodes[i], "to", 0) == _INT32

    def producer(value: str, reader: int, op_type: str) -> int | None:
        i = single(value, reader)
        return i if i is not None and default_op(nodes[i], op_type) and len(nodes[i].output) == 1 else None

    seqlens: dict[str, tuple[int, int, int]] = {}  # mask -> (ReduceSum, Sub, Cast)
    totals: dict[str, tuple[int, int, int]] = {}  # mask -> (Shape, Gather, Cast)
    for c, node in enumerate(nodes):
        if not to_int32(c) or len(node.input) != 1:
            continue
        sub = producer(node.input[0], c, "Sub")
        if sub is not None and len(nodes[sub].input) == 2:
            red = producer(nodes[sub].input[0], sub, "ReduceSum")
            if (
                red is not None
                and _attr(nodes[red], "keepdims", 1) == 0
                and not _attr(nodes[red], "noop_with_empty_axes", 0)
            ):
                seqlens.setdefault(nodes[red].input[0], (red, sub, c))
            continue
        gather = producer(node.input[0], c, "Gather")
        if gather is not None and len(nodes[gather].input) == 2 and _attr(nodes[gather], "axis", 0) == 0:
            shape = producer(nodes[gather].input[0], gather, "Shape")
            if shape is not None and not nodes[shape].attribute:
                totals.setdefault(nodes[shape].input[0], (shape, gather, c))
    drop: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for mask, chain in seqlens.items():
        if mask not in totals:
            continue
        body = sorted(chain + totals[mask])
        at = max(chain[2], totals[mask][2])
        outputs = [nodes[chain[2]].output[0], nodes[totals[mask][2]].output[0]]
        if any(r < at for o in outputs for r in readers.get(o, [])):
            continue
        drop.update(i for i in body if i != at)
        replace[at] = fused_with_body("MaskLengths", [nodes[i] for i in body], [mask], outputs=outputs)
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]
