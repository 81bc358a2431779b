"""Fusion of a tanh cap outside attention (Gemma 2's final logits) into ``Softcap``.

transformers caps Gemma 2's logits as ``tanh(logits / c) * c``, which
``torch.onnx.export`` writes as three nodes::

    y = Mul(Tanh(Div(x, c)), c')     # the Mul in either operand order

:func:`fuse_softcaps` replaces each such chain by one
``ai.onnxkv::Softcap(x, c, c')`` node
(:class:`onnxkv.plan.ops.activation.Softcap`) with the three nodes as its
``body``, when the Div and Tanh outputs are read by the chain alone and are not
protected.  Whether ``c`` and ``c'`` are one value is the operator's to decide
(it evaluates the body otherwise).  Run after
:func:`onnxkv.plan.fusion.fuse_masked_attention`: a cap on attention scores
belongs to the attention block it fuses.
"""

from __future__ import annotations

import onnx

from onnxkv.plan.fusion import default_op, fused_with_body, graph_index

__all__ = ["fuse_softcaps"]


def fuse_softcaps(nodes: list[onnx.NodeProto], protected: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with each tanh cap replaced by a Softcap node (see the module docstring)."""
    readers, _, single = graph_index(nodes, protected)
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for t, tanh in enumerate(nodes):
        if not default_op(tanh, "Tanh") or len(tanh.input) != 1:
            continue
        d = single(tanh.input[0], t)
        if d is None or not default_op(nodes[d], "Div") or len(nodes[d].input) != 2:
            continue
        r = readers.get(tanh.output[0], [])
        m = r[0] if len(r) == 1 and tanh.output[0] not in protected else None
        if m is None or not default_op(nodes[m], "Mul") or list(nodes[m].input).count(tanh.output[0]) != 1:
            continue
        a, b = nodes[m].input
        cap = b if a == tanh.output[0] else a
        x, c = nodes[d].input
        drop.update((d, t))
        replace[m] = fused_with_body("Softcap", [nodes[i] for i in sorted((d, t, m))], [x, c, cap])
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]
