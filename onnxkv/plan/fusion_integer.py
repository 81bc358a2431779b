"""``fuse_dynamic_quant_matmuls``: each dynamically quantized product of ONNX Runtime's ``quantize_dynamic``
as one node.

quantize_dynamic writes every float MatMul with a constant weight as
``DynamicQuantizeLinear(x) -> (xq, xs, xz)``, ``MatMulInteger(xq, W, xz[, wz]) -> i``,
``Cast(i, to=FLOAT) -> f``, ``Mul(xs, ws) -> s`` and ``Mul(f, s) -> y`` (either Mul's operands in
either order).  A chain with a constant W (int8 or uint8, 2-D), a constant or absent wz (one value or
one per column) and a constant float32 ws (one value or one per column), whose values i, f and s have
no other reader and are not protected, becomes ``ai.onnxkv::DynamicQuantMatMul(x, W, wz, ws) -> y``
(:class:`onnxkv.plan.ops.matmul_integer.DynamicQuantMatMul`) at the place of the last Mul: the
quantization of x, the integer product and the scaling in one compiled call, with the chain's bits.
The DynamicQuantizeLinear node stays while other nodes read its outputs, and goes with its last reader.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxkv.plan.fusion import FUSED_DOMAIN

__all__ = ["fuse_dynamic_quant_matmuls"]

_DEFAULT = ("", "ai.onnx")


def _weights_fit(w, wz, ws) -> bool:
    if not isinstance(w, np.ndarray) or w.ndim != 2 or w.dtype not in (np.int8, np.uint8) or 0 in w.shape:
        return False
    n = w.shape[1]
    if wz is not None and (wz.dtype != w.dtype or wz.ndim > 2 or wz.size not in (1, n)):
        return False
    return isinstance(ws, np.ndarray) and ws.dtype == np.float32 and ws.ndim <= 1 and ws.size in (1, n)


def fuse_dynamic_quant_matmuls(
    nodes: list[onnx.NodeProto], protected: set[str], constants: Mapping[str, np.ndarray | None]
) -> list[onnx.NodeProto]:
    """``nodes`` with every chain of the module docstring fused into one DynamicQuantMatMul node."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    readers: dict[str, list[int]] = defaultdict(list)
    for i, n in enumerate(nodes):
        for x in n.input:
            readers[x].append(i)

    def only_reader(value: str) -> int | None:
        r = readers.get(value, [])
        return r[0] if len(r) == 1 and value not in protected else None

    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for i, m in enumerate(nodes):
        if m.op_type != "MatMulInteger" or m.domain not in _DEFAULT or len(m.input) < 3:
            continue
        ins = list(m.input) + [""] * (4 - len(m.input))
        d = producer.get(ins[0])
        dql = nodes[d] if d is not None else None
        if dql is None or dql.op_type != "DynamicQuantizeLinear" or len(dql.output) < 3 or ins[2] != dql.output[2]:
            continue
        c = only_reader(m.output[0])
        to = next((a.i for a in nodes[c].attribute if a.name == "to"), None) if c is not None else None
        if c is None or nodes[c].op_type != "Cast" or to != TensorProto.FLOAT:
            continue
        y = only_reader(nodes[c].output[0])
        if y is None or nodes[y].op_type != "Mul" or len(nodes[y].input) != 2:
            continue
        scale = [x for x in nodes[y].input if x != nodes[c].output[0]]
        s = producer.get(scale[0]) if len(scale) == 1 else None
        if s is None or nodes[s].op_type != "Mul" or only_reader(scale[0]) != y or dql.output[1] not in nodes[s].input:
            continue
        others = [x for x in nodes[s].input if x != dql.output[1]]
        ws_name = others[0] if len(others) == 1 else None
        wz = constants.get(ins[3]) if ins[3] else None
        if ws_name is None or (ins[3] and wz is None):
            continue
        if not _weights_fit(constants.get(ins[1]), wz, constants.get(ws_name)):
            continue
        replace[y] = helper.make_node(
            "DynamicQuantMatMul",
            [dql.input[0], ins[1], ins[3], ws_name],
            [nodes[y].output[0]],
            name=m.name or m.output[0],
            domain=FUSED_DOMAIN,
        )
        drop.update((i, c, s))
    for d, n in enumerate(nodes):  # a DynamicQuantizeLinear whose every reader was fused goes too
        if n.op_type == "DynamicQuantizeLinear" and not protected.intersection(n.output):
            if all(r in drop for o in n.output for r in readers.get(o, [])):
                drop.add(d)
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]
