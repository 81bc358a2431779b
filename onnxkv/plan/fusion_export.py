"""Plan-time fusions of the elementwise chains ``torch.onnx.export`` writes for Llama-style models.

The model proto is unchanged; each fused node keeps the nodes it replaced as
its ``body`` graph (:func:`onnxkv.plan.fusion.fused_with_body`), and its
kernel evaluates them literally whenever a run-time check of the arithmetic
fails.  A pattern is fused only when every intermediate value has the
pattern as its only reader and is neither a graph output nor otherwise
protected.

``fuse_rms_norm``: the eager RMSNorm of an export::

    c = Cast(x, to=FLOAT)                       # optional
    y = Mul(w, Cast(Mul(c, Div(one, Sqrt(Add(ReduceMean(Pow(c, p), axes), eps)))), to=FLOAT))

(every Mul/Add in either operand order, the inner Cast optional, ``Div(one,
.)`` or ``Reciprocal(.)``, as onnxkv's own Concat-cache builder writes it)
becomes one ``ai.onnxkv::RMSNormChain(x, w, p, axes, eps, one)`` node, run by
the compiled ``rms_norm`` kernel when ``p == 2``, ``one == 1``, the mean is over
the last axis only, and ``x``/``w`` are float32 (see
:class:`onnxkv.plan.ops.norm_chain.RMSNormChain`).

``fuse_rotate_half``: the rotary embedding of an export (``rotate_half`` form)::

    y = Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, h, end)), Slice(x, 0, h), axis=-1), sin))

becomes one ``ai.onnxkv::RotateHalf(x, cos, sin, <first-half slice inputs>,
<second-half slice inputs>)`` node, run by the compiled ``rotary_embedding``
kernel when the slices split the last axis in halves and ``cos``/``sin``
hold one angle per pair (see :class:`onnxkv.plan.ops.rotary.RotateHalf`).
Attribute ``halves_equal=1`` records that the graph proves the last pair
(:func:`repeats_halves`: both are made from ``Concat([f, f], axis=-1)``), so
the kernel need not compare the halves on every call.

``fuse_skip_rms_norm`` (after ``fuse_rms_norm``): the residual add feeding a
fused norm::

    s = Add(a, b)
    c = Cast(s, to=FLOAT)                       # optional
    y = RMSNormChain(c, w, ...)                 # c may have other readers (the residual stream)

becomes one ``ai.onnxkv::SkipRMSNormChain(a, b, w, ...)`` node with outputs
``(y, c)`` (``c`` empty when nothing else reads it), run by the compiled
``skip_rms_norm`` kernel, which writes the sum and the norm in one pass (see
:class:`onnxkv.plan.ops.norm.SkipRMSNormChain`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from onnxkv.plan.fusion import FUSED_DOMAIN, constant_node_value, default_op, fused_with_body, graph_index

__all__ = [
    "fuse_rms_norm",
    "fuse_rotate_half",
    "fuse_skip_rms_norm",
    "repeats_halves",
    "RMS_NORM_INPUTS",
    "ROTATE_HALF_INPUTS",
    "SKIP_RMS_NORM_INPUTS",
]

#: Positions of the inputs of ``ai.onnxkv::RMSNormChain`` (empty name = absent).
RMS_NORM_INPUTS = ("x", "weight", "exponent", "axes", "eps", "one")
#: Positions of the inputs of ``ai.onnxkv::SkipRMSNormChain``: the two addends, then the RMSNormChain's
#: inputs after ``x``.
SKIP_RMS_NORM_INPUTS = ("a", "b") + RMS_NORM_INPUTS[1:]
#: Positions of the inputs of ``ai.onnxkv::RotateHalf``: x, cos, sin, then (starts, ends, axes, steps) of
#: the Slice giving the first half and of the Slice giving the (negated) second half.
ROTATE_HALF_INPUTS = (
    "x",
    "cos",
    "sin",
    "lo_starts",
    "lo_ends",
    "lo_axes",
    "lo_steps",
    "hi_starts",
    "hi_ends",
    "hi_axes",
    "hi_steps",
)

_FLOAT = onnx.TensorProto.FLOAT
#: Elementwise operators of one input: equal elements in, equal elements out.
_UNARY = ("Cast", "Cos", "Sin", "Neg", "Identity", "Abs", "Exp", "Sqrt", "Reciprocal", "Relu", "Sigmoid", "Tanh")
#: Elementwise operators of two broadcast inputs.
_BINARY = ("Mul", "Add", "Sub", "Div")
#: How far :func:`repeats_halves` follows producers.
_PROOF_DEPTH = 16


def _other(node: onnx.NodeProto, value: str) -> str | None:
    """The input of a two-input ``node`` that is not ``value`` (None if ``value`` is not an input)."""
    a, b = node.input
    return b if a == value else a if b == value else None


def _reads_own(nodes: list[onnx.NodeProto], chain: list[int], inputs) -> bool:
    """Whether one of the fused node's ``inputs`` is a value the ``chain`` itself produces."""
    made = {o for i in chain for o in nodes[i].output}
    return any(x in made for x in inputs)


def _cast_to_float(node: onnx.NodeProto) -> bool:
    return default_op(node, "Cast") and next((a.i for a in node.attribute if a.name == "to"), 0) == _FLOAT


def fuse_rms_norm(nodes: list[onnx.NodeProto], protected: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with each exported RMSNorm chain replaced by an RMSNormChain node (see the module docstring)."""
    readers, producer, single = graph_index(nodes, protected)

    def is_op(i: int | None, op_type: str) -> bool:
        return i is not None and default_op(nodes[i], op_type) and len(nodes[i].output) == 1

    def only_reader(value: str, op_type: str) -> int | None:
        r = readers.get(value, [])
        return r[0] if value not in protected and len(r) == 1 and is_op(r[0], op_type) else None

    drop: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for p, pw in enumerate(nodes):
        if not is_op(p, "Pow") or len(pw.input) != 2:
            continue
        c, exponent = pw.input
        rm = only_reader(pw.output[0], "ReduceMean")
        add = only_reader(nodes[rm].output[0], "Add") if rm is not None else None
        sq = only_reader(nodes[add].output[0], "Sqrt") if add is not None else None
        if sq is None:
            continue
        div = only_reader(nodes[sq].output[0], "Div")
        if div is None:
            div = only_reader(nodes[sq].output[0], "Reciprocal")
        elif nodes[div].input[1] != nodes[sq].output[0]:
            continue
        if div is None:
            continue
        mul = only_reader(nodes[div].output[0], "Mul")
        if mul is None or _other(nodes[mul], nodes[div].output[0]) != c:
            continue
        chain = [p, rm, add, sq, div, mul]
        cur = mul
        cast = only_reader(nodes[mul].output[0], "Cast")
        if cast is not None:
            if not _cast_to_float(nodes[cast]):
                continue
            chain.append(cast)
            cur = cast
        mw = only_reader(nodes[cur].output[0], "Mul")
        if mw is None:
            continue
        weight = _other(nodes[mw], nodes[cur].output[0])
        chain.append(mw)
        # c is read by the Pow and the Mul only: absorb the Cast producing it.
        x = c
        src = producer.get(c)
        if (
            c not in protected
            and src is not None
            and _cast_to_float(nodes[src])
            and sorted(readers.get(c, [])) == sorted([p, mul])
        ):
            chain.append(src)
            x = nodes[src].input[0]
        eps = _other(nodes[add], nodes[rm].output[0])
        axes = nodes[rm].input[1] if len(nodes[rm].input) > 1 else ""
        roles = {
            "x": x,
            "weight": weight,
            "exponent": exponent,
            "axes": axes,
            "eps": eps,
            "one": nodes[div].input[0] if nodes[div].op_type == "Div" else "",
        }
        if _reads_own(nodes, chain, roles.values()) or any(i in drop or i in replace for i in chain):
            continue
        drop.update(i for i in chain if i != mw)
        replace[mw] = fused_with_body(
            "RMSNormChain", [nodes[i] for i in sorted(chain)], [roles[r] for r in RMS_NORM_INPUTS]
        )
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]


def _periodic(value: np.ndarray) -> bool:
    """Whether ``value`` has the property of :func:`repeats_halves` (a scalar has it)."""
    if value.ndim == 0:
        return True
    n = value.shape[-1]
    if value.size == 0:
        return False
    period = n // 2 if n % 2 == 0 else 1
    rows = value.reshape(value.shape[:-1] + (n // period, period))
    return bool((rows == rows[..., :1, :]).all())


def repeats_halves(value: str, nodes: list[onnx.NodeProto], constants: Mapping[str, np.ndarray] | None = None) -> bool:
    """Whether the graph ``nodes`` proves that ``value``, with ``n`` the length of its last axis, repeats
    with period ``n / 2`` along that axis when ``n`` is even (``v[..., i] == v[..., i + n/2]``), and is
    constant along it when ``n`` is odd.

    Proven for: ``Concat([f, f], axis=-1)``; constants (``constants`` or
    ``Constant`` nodes) checked by value; elementwise operators of one input
    (Cast, Cos, Sin, Neg, ...) of such a value; Mul/Add/Sub/Div of two such
    values (broadcasting keeps the property: an axis of length 1 is
    constant); Unsqueeze and Expand of one (the last axis stays, or becomes
    a new axis of length 1, or a broadcast copy of one); Gather over another
    axis than the last of a constant.  Anything else, or a chain deeper than
    :data:`_PROOF_DEPTH`, is not proven.
    """
    constants = constants or {}
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}

    def proven(v: str, depth: int) -> bool:
        if v in constants:
            return _periodic(np.asarray(constants[v]))
        i = producer.get(v)
        if i is None or depth > _PROOF_DEPTH:
            return False
        n = nodes[i]
        if default_op(n, "Constant"):
            c = constant_node_value(n)
            return c is not None and _periodic(c)
        if n.domain not in ("", "ai.onnx") or len(n.output) != 1 or not n.input:
            return False
        if n.op_type == "Concat":
            axis = next((a.i for a in n.attribute if a.name == "axis"), None)
            return axis == -1 and len(n.input) == 2 and n.input[0] == n.input[1] != ""
        if n.op_type in _UNARY or n.op_type in ("Unsqueeze", "Expand"):
            return proven(n.input[0], depth + 1)
        if n.op_type in _BINARY:
            return len(n.input) == 2 and proven(n.input[0], depth + 1) and proven(n.input[1], depth + 1)
        if n.op_type == "Gather" and len(n.input) == 2:
            data = constants.get(n.input[0])
            if data is None and n.input[0] in producer and default_op(nodes[producer[n.input[0]]], "Constant"):
                data = constant_node_value(nodes[producer[n.input[0]]])
            axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
            return (
                data is not None
                and np.ndim(data) >= 2
                and axis % np.ndim(data) != np.ndim(data) - 1
                and _periodic(np.asarray(data))
            )
        return False

    return proven(value, 0)


def fuse_rotate_half(
    nodes: list[onnx.NodeProto], protected: set[str], constants: Mapping[str, np.ndarray] | None = None
) -> list[onnx.NodeProto]:
    """``nodes`` with each exported rotate_half rotary embedding replaced by a RotateHalf node
    (see the module docstring); ``constants`` (initializers) help prove ``halves_equal``."""
    _, _, single = graph_index(nodes, protected)

    def op_of(value: str, reader: int, op_type: str) -> int | None:
        i = single(value, reader)
        return i if i is not None and default_op(nodes[i], op_type) and len(nodes[i].output) == 1 else None

    def slice_of(value: str, reader: int, x: str | None) -> int | None:
        """The Slice (with starts/ends inputs) of ``x`` producing ``value`` for ``reader`` only."""
        i = op_of(value, reader, "Slice")
        if i is None or len(nodes[i].input) < 3 or (x is not None and nodes[i].input[0] != x):
            return None
        return i

    def rotated(value: str, reader: int) -> tuple[list[int], str, int, int] | None:
        """(chain, x, lo_slice, hi_slice) of ``value = Concat(Neg(Slice(x)), Slice(x))`` for ``reader``."""
        cat = op_of(value, reader, "Concat")
        if cat is None or len(nodes[cat].input) != 2:
            return None
        neg = op_of(nodes[cat].input[0], cat, "Neg")
        hi = slice_of(nodes[neg].input[0], neg, None) if neg is not None else None
        if hi is None:
            return None
        x = nodes[hi].input[0]
        lo = slice_of(nodes[cat].input[1], cat, x)
        return None if lo is None else ([cat, neg, hi, lo], x, lo, hi)

    drop: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for a, add in enumerate(nodes):
        if not default_op(add, "Add") or len(add.input) != 2:
            continue
        found = None
        for direct, turned in (add.input, add.input[::-1]):
            m1, m2 = op_of(direct, a, "Mul"), op_of(turned, a, "Mul")
            if m1 is None or m2 is None or m1 == m2:
                continue
            for rot_in in nodes[m2].input:
                rot = rotated(rot_in, m2)
                if rot is None:
                    continue
                cos, sin = _other(nodes[m1], rot[1]), _other(nodes[m2], rot_in)
                if cos is not None and cos != rot[1] and sin != rot_in:
                    found = (m1, m2, cos, sin, rot)
                    break
            if found:
                break
        if found is None:
            continue
        m1, m2, cos, sin, (rot_chain, x, lo, hi) = found
        chain = [m1, m2, *rot_chain, a]
        lo_in = list(nodes[lo].input[1:]) + [""] * (5 - len(nodes[lo].input))
        hi_in = list(nodes[hi].input[1:]) + [""] * (5 - len(nodes[hi].input))
        if _reads_own(nodes, chain, [x, cos, sin, *lo_in, *hi_in]) or any(i in drop or i in replace for i in chain):
            continue
        drop.update(i for i in chain if i != a)
        halves = repeats_halves(cos, nodes, constants) and repeats_halves(sin, nodes, constants)
        replace[a] = fused_with_body(
            "RotateHalf", [nodes[i] for i in sorted(chain)], [x, cos, sin, *lo_in, *hi_in], halves_equal=int(halves)
        )
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]


def fuse_skip_rms_norm(nodes: list[onnx.NodeProto], protected: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with each residual ``Add`` [+ ``Cast``] feeding an RMSNormChain replaced by a SkipRMSNormChain
    node (see the module docstring); run after :func:`fuse_rms_norm`."""
    readers, producer, single = graph_index(nodes, protected)

    drop: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for r, norm in enumerate(nodes):
        if norm.op_type != "RMSNormChain" or norm.domain != FUSED_DOMAIN or len(norm.input) > len(RMS_NORM_INPUTS):
            continue
        c = norm.input[0]
        cur = producer.get(c)
        if cur is None:
            continue
        # The norm's input may have other readers (the residual stream): then it is the second output, made
        # where the norm was, so every other reader must come later.
        stream = c if c in protected or readers.get(c) != [r] else ""
        if any(i < r for i in readers.get(c, [])):
            continue
        chain = [r]
        if _cast_to_float(nodes[cur]):
            chain.append(cur)
            cur = single(nodes[cur].input[0], cur)
        if cur is None or not default_op(nodes[cur], "Add") or len(nodes[cur].input) != 2:
            continue
        chain.append(cur)
        fixed = [*nodes[cur].input, *norm.input[1:]]
        if _reads_own(nodes, chain, fixed) or any(i in drop or i in replace for i in chain):
            continue
        drop.update(chain[1:])
        replace[r] = fused_with_body(
            "SkipRMSNormChain", [nodes[i] for i in sorted(chain)], fixed, outputs=[norm.output[0], stream]
        )
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]
