"""Plan-time fusion of sibling MatMuls: products of one input with several constant weights.

Decoder graphs project the same normalised hidden state separately onto
queries, keys and values, and onto the MLP's gate and up branches.
``fuse_sibling_matmuls`` replaces each such group, ``MatMul(x, W1) ...
MatMul(x, Wn)`` with 2-D float32 initializer weights of one row count, by one
``ai.onnxkv::SiblingMatMul(x, W1, ..., Wn)`` node with the same outputs
(names unchanged), run by :class:`onnxkv.plan.ops.sibling_matmul.SiblingMatMul`
as one product against the weights packed side by side: x is read once and
one kernel call (one thread team) replaces n.  The fused node takes the place
of the group's first MatMul; no value disappears, so nothing else in the
graph changes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

from onnxkv.plan.fusion import FUSED_DOMAIN, default_op

__all__ = ["fuse_sibling_matmuls"]


def fuse_sibling_matmuls(nodes: list[onnx.NodeProto], constants: Mapping[str, np.ndarray | None]) -> list[onnx.NodeProto]:
    """``nodes`` with each group of MatMuls sharing input A and reading constant weights fused into one node.

    ``constants`` maps initializer names to their arrays; a weight qualifies
    when it is a non-empty 2-D float32 array, and a group needs at least two
    MatMuls whose weights have the same number of rows.
    """
    groups: dict[tuple[str, int], list[int]] = {}
    for i, n in enumerate(nodes):
        if not default_op(n, "MatMul") or len(n.input) != 2 or len(n.output) != 1:
            continue
        w = constants.get(n.input[1])
        if isinstance(w, np.ndarray) and w.ndim == 2 and w.dtype == np.float32 and w.size:
            groups.setdefault((n.input[0], w.shape[0]), []).append(i)
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for (x, _), members in groups.items():
        if len(members) < 2:
            continue
        first = nodes[members[0]]
        replace[members[0]] = helper.make_node(
            "SiblingMatMul", [x, *(nodes[i].input[1] for i in members)], [nodes[i].output[0] for i in members],
            name=first.name or first.output[0], domain=FUSED_DOMAIN)
        drop.update(members[1:])
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]
