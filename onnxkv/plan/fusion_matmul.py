"""Plan-time fusions of MatMuls with constant weights: siblings, and the op before them.

Decoder graphs project the same normalised hidden state separately onto
queries, keys and values, and onto the MLP's gate and up branches.
``fuse_sibling_matmuls`` replaces each such group, ``MatMul(x, W1) ...
MatMul(x, Wn)`` with 2-D initializer weights of one dtype (float32 or float16) and row count, by one
``ai.onnxkv::SiblingMatMul(x, W1, ..., Wn)`` node with the same outputs
(names unchanged), run by :class:`onnxkv.plan.ops.sibling_matmul.SiblingMatMul`
as one product against the weights packed side by side: x is read once and
one kernel call (one thread team) replaces n.  The fused node takes the place
of the group's first MatMul; no value disappears, so nothing else in the
graph changes.

``fuse_sibling_nbits`` does the same for ``com.microsoft::MatMulNBits``
nodes sharing input A whose weights are initializers of one layout (K, bits,
block_size, accuracy_level, zero-point kind; constant or absent bias, no
g_idx): one ``ai.onnxkv::SiblingMatMulNBits`` node, so A is quantized once and
one kernel call covers every weight
(:class:`onnxkv.plan.ops.matmul_nbits.SiblingMatMulNBits`); and for
``com.microsoft::MatMulBnb4`` nodes of one K, block_size and quant_type: one
``ai.onnxkv::SiblingMatMulBnb4``
(:class:`onnxkv.plan.ops.matmul_bnb4.SiblingMatMulBnb4`).

``fuse_prologue_matmuls`` then joins each RMS norm (ORT's
SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization) or
``SiluMul`` whose output is read only by one MatMul with a packed weight (or
one SiblingMatMul), as that product's input A, into one
``ai.onnxkv::PrologueMatMul`` node at the norm's place (its outputs: the
product's, then the skip norm's sum output if it has one): a decode step then
runs one node per norm + projection instead of two (see
:class:`onnxkv.plan.ops.prologue_matmul.PrologueMatMul`).  The norm's output
is no longer a value of the plan.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

from onnxkv.plan.fusion import FUSED_DOMAIN, default_op, fused_with_body, graph_index
from onnxkv.plan.ops import matmul_bnb4
from onnxkv.plan.ops.matmul_nbits import layout_problem

__all__ = ["absorb_sibling_biases", "fuse_sibling_matmuls", "fuse_sibling_nbits", "fuse_prologue_matmuls"]

#: (op_type, domain) of the ops ``fuse_prologue_matmuls`` joins to the product that reads them.
PROLOGUES = {
    ("SkipSimplifiedLayerNormalization", "com.microsoft"),
    ("SimplifiedLayerNormalization", ""),
    ("SimplifiedLayerNormalization", "ai.onnx"),
    ("SimplifiedLayerNormalization", "com.microsoft"),
    ("SiluMul", FUSED_DOMAIN),
}


def _packable(w) -> bool:
    """A weight the packed kernel takes: a non-empty 2-D float32 or float16 array."""
    return isinstance(w, np.ndarray) and w.ndim == 2 and w.dtype in (np.float32, np.float16) and w.size > 0


def fuse_sibling_matmuls(
    nodes: list[onnx.NodeProto], constants: Mapping[str, np.ndarray | None]
) -> list[onnx.NodeProto]:
    """``nodes`` with each group of MatMuls sharing input A and reading constant weights fused into one node.

    ``constants`` maps initializer names to their arrays; a weight qualifies
    when it is a non-empty 2-D float32 or float16 array, and a group needs at
    least two MatMuls whose weights have the same dtype and number of rows.
    """
    groups: dict[tuple[str, int, str], list[int]] = {}
    for i, n in enumerate(nodes):
        if not default_op(n, "MatMul") or len(n.input) != 2 or len(n.output) != 1:
            continue
        w = constants.get(n.input[1])
        if _packable(w):
            groups.setdefault((n.input[0], w.shape[0], w.dtype.str), []).append(i)
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for (x, _, _), members in groups.items():
        if len(members) < 2:
            continue
        first = nodes[members[0]]
        replace[members[0]] = helper.make_node(
            "SiblingMatMul",
            [x, *(nodes[i].input[1] for i in members)],
            [nodes[i].output[0] for i in members],
            name=first.name or first.output[0],
            domain=FUSED_DOMAIN,
        )
        drop.update(members[1:])
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]


def absorb_sibling_biases(
    nodes: list[onnx.NodeProto], protected: set[str], constants: Mapping[str, np.ndarray | None]
) -> list[onnx.NodeProto]:
    """``nodes`` with the bias Adds after a float32 SiblingMatMul, or a MatMul of a float32 initializer, taken
    into one SiblingMatMul (attribute ``biased=1``, the biases as inputs after the weights; its outputs are
    the Adds'), as Qwen2's q/k/v projections: each output must be read by one Add alone whose other operand
    is a float32 initializer of shape ``[N_i]`` (every output, or the node is left alone)."""
    readers = graph_index(nodes, protected)[0]
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for i, n in enumerate(nodes):
        single = default_op(n, "MatMul") and len(n.input) == 2 and len(n.output) == 1
        if not single and (n.op_type != "SiblingMatMul" or n.domain != FUSED_DOMAIN or n.attribute):
            continue
        weights = [constants.get(w) for w in n.input[1:]]
        if not all(_packable(w) and w.dtype == np.float32 for w in weights):
            continue
        adds, biases = [], []
        for y, w in zip(n.output, weights):
            r = readers.get(y, [])
            add = nodes[r[0]] if len(r) == 1 else None
            if add is None or not default_op(add, "Add") or y in protected or len(add.input) != 2:
                break
            b = add.input[1] if add.input[0] == y else add.input[0]
            value = constants.get(b)
            if not (isinstance(value, np.ndarray) and value.dtype == np.float32 and value.shape == (w.shape[1],)):
                break
            adds.append(r[0])
            biases.append(b)
        else:
            replace[i] = helper.make_node(
                "SiblingMatMul",
                [*n.input, *biases],
                [nodes[a].output[0] for a in adds],
                name=n.name,
                domain=FUSED_DOMAIN,
                biased=1,
            )
            drop.update(adds)
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]


#: Attributes of ``MatMulNBits`` that siblings must share (with their defaults).
NBITS_SHARED = {"K": None, "bits": 4, "block_size": None, "accuracy_level": 0}


#: Attributes of ``MatMulBnb4`` that siblings must share.
BNB4_SHARED = ("K", "block_size", "quant_type")


def _bnb4_key(n: onnx.NodeProto, constants: Mapping[str, np.ndarray | None]) -> tuple | None:
    """_nbits_key of a MatMulBnb4 node: (A, ("bnb4", K, block_size, quant_type), None), or None."""
    if len(n.input) != 3 or any(constants.get(x) is None for x in n.input[1:]):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if attrs.get("transB", 1) != 1 or attrs.get("training_mode", 0) != 0:
        return None
    shared = tuple(attrs.get(k) for k in BNB4_SHARED)
    k, block_size, quant_type = shared
    if matmul_bnb4.layout_problem(k, attrs.get("N"), block_size, quant_type, constants[n.input[1]],
                                  constants[n.input[2]]) is not None:  # fmt: skip
        return None  # alone, its own build names what is wrong
    return (n.input[0], ("bnb4", *shared), None)


def _nbits_key(n: onnx.NodeProto, constants: Mapping[str, np.ndarray | None]) -> tuple | None:
    """What a MatMulNBits (or MatMulBnb4) node's siblings must share, or None when it cannot join a group:
    (A, the shared attributes, zero-point dtype or None)."""
    if n.domain != "com.microsoft" or len(n.output) != 1:
        return None
    if n.op_type == "MatMulBnb4":
        return _bnb4_key(n, constants)
    if n.op_type != "MatMulNBits":
        return None
    ins = list(n.input) + [""] * (6 - len(n.input))
    if (
        not ins[1]
        or not ins[2]
        or ins[4]
        or any(x and constants.get(x) is None for x in (ins[1], ins[2], ins[3], ins[5]))
    ):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if "N" not in attrs:
        return None
    zp = constants.get(ins[3]) if ins[3] else None
    shared = {k: attrs.get(k, d) for k, d in NBITS_SHARED.items()}
    if layout_problem(shared["K"], attrs["N"], shared["bits"], shared["block_size"], constants[ins[1]],
                      constants[ins[2]], zp) is not None:  # fmt: skip
        return None  # alone, its own build names what is wrong
    return (ins[0], tuple(shared.values()), None if zp is None else zp.dtype.str)


def fuse_sibling_nbits(nodes: list[onnx.NodeProto], constants: Mapping[str, np.ndarray | None]) -> list[onnx.NodeProto]:
    """``nodes`` with each group of at least two MatMulNBits sharing input A and one weight layout (see the
    module docstring) fused into one ``ai.onnxkv::SiblingMatMulNBits`` node at the first one's place.  Its
    inputs are A, then per member B, scales, zero_points, bias ("" when absent); its attributes the shared
    ones and ``N`` (ints, one per member)."""
    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(nodes):
        key = _nbits_key(n, constants)
        if key is not None:
            groups.setdefault(key, []).append(i)
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for (x, shared, _), members in groups.items():
        if len(members) < 2:
            continue
        if shared[0] == "bnb4":
            replace[members[0]] = _sibling_bnb4(x, [nodes[i] for i in members], shared[1:])
            drop.update(members[1:])
            continue
        inputs, ns = [x], []
        for i in members:
            ins = list(nodes[i].input) + [""] * (6 - len(nodes[i].input))
            inputs += [ins[1], ins[2], ins[3], ins[5]]
            ns.append(next(helper.get_attribute_value(a) for a in nodes[i].attribute if a.name == "N"))
        first = nodes[members[0]]
        replace[members[0]] = helper.make_node(
            "SiblingMatMulNBits",
            inputs,
            [nodes[i].output[0] for i in members],
            name=first.name or first.output[0],
            domain=FUSED_DOMAIN,
            N=ns,
            **dict(zip(NBITS_SHARED, shared)),
        )
        drop.update(members[1:])
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]


def _sibling_bnb4(x: str, members: list[onnx.NodeProto], shared: tuple) -> onnx.NodeProto:
    """The SiblingMatMulBnb4 node of MatMulBnb4 ``members`` reading ``x`` (``shared``: BNB4_SHARED's values)."""
    return helper.make_node(
        "SiblingMatMulBnb4",
        [x, *(name for m in members for name in m.input[1:3])],
        [m.output[0] for m in members],
        name=members[0].name or members[0].output[0],
        domain=FUSED_DOMAIN,
        N=[next(helper.get_attribute_value(a) for a in m.attribute if a.name == "N") for m in members],
        **dict(zip(BNB4_SHARED, shared)),
    )


def fuse_prologue_matmuls(
    nodes: list[onnx.NodeProto], protected: set[str], constants: Mapping[str, np.ndarray | None]
) -> list[onnx.NodeProto]:
    """``nodes`` with each prologue (see :data:`PROLOGUES`) and the one product reading it joined.

    A prologue qualifies when its output 0 is not ``protected`` and is read by
    exactly one node, once, as input 0 of a ``MatMul`` whose weight is a
    packable initializer (non-empty 2-D float32 or float16), of a ``SiblingMatMul`` or
    ``SiblingMatMulNBits`` / ``SiblingMatMulBnb4``, or of a ``MatMulNBits`` with
    initializer weights and no bias or g_idx, or of a ``MatMulBnb4``;
    a norm must have no optional statistics outputs and normalise over the
    last axis.  The ``ai.onnxkv::PrologueMatMul`` node replaces the prologue
    (where it stands, so every reader of its other outputs still follows it)
    and the product; its inputs are the prologue's then the weights, attribute
    ``prologue_inputs`` their count, and its ``body`` holds both nodes.
    """
    readers, _, _ = graph_index(nodes, protected)
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for i, p in enumerate(nodes):
        if (p.op_type, p.domain) not in PROLOGUES or not p.output or not p.output[0] or p.output[0] in protected:
            continue
        stats = p.output[1:3] if p.op_type == "SkipSimplifiedLayerNormalization" else p.output[1:]
        axis = next((a.i for a in p.attribute if a.name == "axis"), -1)
        if any(stats) or axis != -1:
            continue
        r = readers.get(p.output[0], [])
        if len(r) != 1 or r[0] in drop or r[0] in replace:
            continue
        m = nodes[r[0]]
        if list(m.input).count(p.output[0]) != 1 or m.input[0] != p.output[0]:
            continue
        if not (
            (m.op_type in ("SiblingMatMul", "SiblingMatMulNBits", "SiblingMatMulBnb4") and m.domain == FUSED_DOMAIN)
            or (
                default_op(m, "MatMul")
                and len(m.input) == 2
                and len(m.output) == 1
                and _packable(constants.get(m.input[1]))
            )
            or (_nbits_key(m, constants) is not None and len(m.input) <= 4)
        ):
            continue
        outputs = list(m.output) + [o for o in p.output[3:] if o]
        replace[i] = fused_with_body("PrologueMatMul", [p, m], list(p.input), outputs, prologue_inputs=len(p.input))
        drop.add(r[0])
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]
