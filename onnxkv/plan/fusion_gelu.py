"""Fusion of the GeGLU gate exports write (Gemma's ``gelu_pytorch_tanh(gate) * up``) into ``GeluTanhMul``.

``torch.onnx.export`` decomposes transformers' ``gelu`` in its tanh form into
nine nodes, then the MLP multiplies it by the up projection::

    g3 = Mul(g, Mul(g, g))                    # g^3 (or Pow(g, 3))
    u  = Mul(a, Add(g, Mul(c, g3)))           # a = sqrt(2 / pi), c = 0.044715
    h  = Mul(half, Mul(g, Add(one, Tanh(u)))) # half = 0.5, one = 1
    y  = Mul(h, up)

(every Mul and Add in either operand order).  :func:`fuse_gelu_tanh_gate`
replaces each such chain by one ``ai.onnxkv::GeluTanhMul(g, up)`` node
(:class:`onnxkv.plan.ops.activation.GeluTanhMul`) with the nodes as its
``body``, when the four constants are those values (to float32 precision) and
every intermediate is read by the chain alone and is not protected (a
constant counts when it is the value rounded to its own type: a float16
export's chain fuses too, and evaluates its body).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from onnxkv.plan.fusion import constant_node_values, default_op, fused_with_body, graph_index

__all__ = ["fuse_gelu_tanh_gate"]

#: The constants of the tanh form, by role.
_CONSTANTS = {"a": np.sqrt(2.0 / np.pi), "c": 0.044715, "one": 1.0, "half": 0.5}


def fuse_gelu_tanh_gate(
    nodes: list[onnx.NodeProto], protected: set[str], constants: Mapping[str, np.ndarray | None]
) -> list[onnx.NodeProto]:
    """``nodes`` with each GeGLU chain replaced by a GeluTanhMul node (see the module docstring)."""
    readers, producer, single = graph_index(nodes, protected)
    values = {**constants, **constant_node_values(nodes)}

    def is_constant(name: str, role: str) -> bool:
        v = values.get(name)
        return (
            isinstance(v, np.ndarray)
            and v.size == 1
            and v.dtype.kind == "f"
            and abs(float(v.reshape(-1)[0]) - _CONSTANTS[role]) <= 2 * float(np.finfo(v.dtype).eps) * _CONSTANTS[role]
        )  # the value rounded to the constant's own type

    def split(i: int | None, op: str, role: str) -> str | None:
        """The operand of binary node ``i`` (of ``op``) beside the constant of ``role``, or None."""
        if i is None or not default_op(nodes[i], op) or len(nodes[i].input) != 2:
            return None
        a, b = nodes[i].input
        return b if is_constant(a, role) else a if is_constant(b, role) else None

    def cube_of(i: int | None) -> tuple[str, list[int]] | None:
        """(g, the square's node or none) when node ``i`` makes g^3 (Mul(g, Mul(g, g)) in any order, or
        Pow(g, 3)), else None."""
        if i is None:
            return None
        n = nodes[i]
        if default_op(n, "Pow") and len(n.input) == 2:
            e = values.get(n.input[1])
            three = isinstance(e, np.ndarray) and e.size == 1 and float(e.reshape(-1)[0]) == 3
            return (n.input[0], []) if three else None
        if not default_op(n, "Mul") or len(n.input) != 2:
            return None
        for g, sq in (n.input, n.input[::-1]):
            j = single(sq, i)
            if j is not None and default_op(nodes[j], "Mul") and list(nodes[j].input) == [g, g]:
                return g, [j]
        return None

    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for t, tanh in enumerate(nodes):
        if not default_op(tanh, "Tanh") or t in drop:
            continue
        chain: list[int] = [t]
        mu = single(tanh.input[0], t)
        inner = split(mu, "Mul", "a")
        add = single(inner, mu) if inner else None
        if add is None or not default_op(nodes[add], "Add"):
            continue
        found = None
        for g, cubed in (nodes[add].input, nodes[add].input[::-1]):
            mc = single(cubed, add)
            g3 = split(mc, "Mul", "c")
            cube = producer.get(g3) if g3 and single(g3, mc) is not None else None
            of = cube_of(cube)
            if of is not None and of[0] == g:
                found = (g, [mc, cube, *of[1]])
                break
        if found is None:
            continue
        g, cubed_nodes = found
        chain += [mu, add, *cubed_nodes]
        r = readers.get(tanh.output[0], [])
        plus = r[0] if len(r) == 1 and tanh.output[0] not in protected else None
        if split(plus, "Add", "one") != tanh.output[0]:
            continue
        r = readers.get(nodes[plus].output[0], [])
        times = r[0] if len(r) == 1 and nodes[plus].output[0] not in protected else None
        if (
            times is None
            or not default_op(nodes[times], "Mul")
            or sorted(nodes[times].input) != sorted([g, nodes[plus].output[0]])
        ):
            continue
        r = readers.get(nodes[times].output[0], [])
        halved = r[0] if len(r) == 1 and nodes[times].output[0] not in protected else None
        if split(halved, "Mul", "half") != nodes[times].output[0]:
            continue
        r = readers.get(nodes[halved].output[0], [])
        last = r[0] if len(r) == 1 and nodes[halved].output[0] not in protected else None
        if last is None or not default_op(nodes[last], "Mul") or len(nodes[last].input) != 2:
            continue
        h = nodes[halved].output[0]
        up = nodes[last].input[1] if nodes[last].input[0] == h else nodes[last].input[0]
        if up == h:
            continue
        chain += [plus, times, halved, last]
        if any(i in drop or i in replace for i in chain):
            continue
        drop.update(i for i in chain if i != last)
        replace[last] = fused_with_body("GeluTanhMul", [nodes[i] for i in sorted(chain)], [g, up])
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]
