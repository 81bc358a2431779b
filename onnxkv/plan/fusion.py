"""Graph fusions applied while a plan is built (the model itself is not changed).

``fuse_silu_gate`` turns the SwiGLU gate of Llama-style MLPs,
``Mul(Mul(g, Sigmoid(g)), u)`` (either operand order), into one
``ai.onnxkv::SiluMul(g, u)`` node run by the compiled ``silu_mul`` kernel:
one pass over memory instead of three, and two nodes fewer to dispatch.

``fuse_repeat_kv_matmul`` removes the ``repeat_kv`` of grouped-query attention
in exported graphs: ``MatMul(Q, [Mul(., s)] Transpose(Reshape(Expand(
Unsqueeze(K)))))`` and ``MatMul(P, Reshape(Expand(Unsqueeze(V))))`` become one
``ai.onnxkv::RepeatKvMatMul`` (absorbing a following ``Mul`` by the attention
scale) that multiplies each group of query heads with its
shared KV head directly (no copy of the cache per query head, no transpose).
Shape nodes reading the repeated V get ``ai.onnxkv::RepeatKvShape``, which
computes the same shape without building the tensor.
The fused node receives the original axes/shape tensors and checks at run time
that they describe a repeat along the head axis; otherwise it computes the
original expression exactly.

``fuse_masked_attention`` (run after ``fuse_repeat_kv_matmul``) replaces the
whole eager attention block, ``Softmax(Q·Kᵀ * scale + mask) · V`` with an
optional NaN guard, by one ``ai.onnxkv::MaskedAttention`` node that runs the
streaming attention kernel on K/V as they are (in a state: the cache, in
place) when the additive mask describes per-row key ranges; the replaced
nodes travel along as its ``body`` graph, evaluated literally otherwise.

A pattern is fused only when the intermediate values have no other reader and
are not graph outputs, so results are unchanged (up to float rounding where a
scalar scale moves from K to the product).  ``fused_with_body`` builds such a
fused node with the replaced nodes as its ``body`` (also used by
:mod:`onnxkv.plan.fusion_export`); :mod:`onnxkv.plan.fusion_matmul` packs
sibling MatMuls and :mod:`onnxkv.plan.fusion_view` runs chains of view
operators as one node.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = [
    "fuse_silu_gate",
    "fuse_repeat_kv_matmul",
    "fuse_masked_attention",
    "MASKED_ATTENTION_INPUTS",
    "FUSED_DOMAIN",
    "kept_nodes",
    "fused_with_body",
    "graph_index",
    "default_op",
    "constant_node_value",
    "constant_node_values",
    "REPEAT_KV_INPUTS",
    "RESHAPE_FROM_X",
    "reshape_from_x",
]

FUSED_DOMAIN = "ai.onnxkv"

#: Input positions of each repeat_kv a fused operator reads: (x, axes, expand shape, reshape target), the
#: target reshaping ``Expand(Unsqueeze(x, axes), expand shape)``.
REPEAT_KV_INPUTS = {
    "RepeatKvMatMul": ((1, 2, 3, 4),),
    "RepeatKvShape": ((0, 1, 2, 3),),
    "MaskedAttention": ((1, 4, 5, 6), (2, 7, 8, 9)),
}
#: Attribute (ints) of ``RepeatKvMatMul`` / ``MaskedAttention``: reshape-target input positions holding a
#: *template* whose 0 entries stand for x's own dim at the same position (written by
#: :meth:`onnxkv.plan.shape_fold.ShapeFolder.rewrite` when it proves the run-time target equals that).
RESHAPE_FROM_X = "reshape_from_x"


def reshape_from_x(template: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The reshape target a template of :data:`RESHAPE_FROM_X` stands for: its 0 entries replaced by
    ``x.shape`` at the same positions (int64 [len(template)]; ``x`` has that rank)."""
    return np.where(template == 0, np.array(x.shape[: template.size], dtype=np.int64), template)


def fuse_silu_gate(nodes: list[onnx.NodeProto], protected: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with each SiLU-gate pattern replaced by one SiluMul node.

    ``protected`` names values that must stay observable (graph outputs and
    anything read by subgraphs); they are never fused away.
    """
    readers: dict[str, list[int]] = defaultdict(list)
    for i, n in enumerate(nodes):
        for x in n.input:
            if x:
                readers[x].append(i)

    def only_reader(value: str) -> int | None:
        r = readers.get(value, [])
        return r[0] if len(r) == 1 and value not in protected else None

    drop: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for i, sig in enumerate(nodes):
        if sig.op_type != "Sigmoid" or sig.domain not in ("", "ai.onnx") or i in drop:
            continue
        gate, s = sig.input[0], sig.output[0]
        j = only_reader(s)
        if j is None or j in drop or j in replace:
            continue
        m1 = nodes[j]
        if m1.op_type != "Mul" or sorted(m1.input) != sorted([gate, s]):
            continue
        k = only_reader(m1.output[0])
        if k is None or k in drop or k in replace:
            continue
        m2 = nodes[k]
        if m2.op_type != "Mul":
            continue
        up = m2.input[1] if m2.input[0] == m1.output[0] else m2.input[0]
        if up == m1.output[0]:
            continue
        drop.update((i, j))
        replace[k] = helper.make_node(
            "SiluMul", [gate, up], [m2.output[0]], name=m2.name or m2.output[0], domain=FUSED_DOMAIN
        )
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]


def _readers(nodes: list[onnx.NodeProto]) -> dict[str, list[int]]:
    readers: dict[str, list[int]] = defaultdict(list)
    for i, n in enumerate(nodes):
        for x in n.input:
            if x:
                readers[x].append(i)
    return readers


def graph_index(nodes: list[onnx.NodeProto], protected: set[str]):
    """(readers, producer, single) of ``nodes``: value -> reader indices, value -> producer index, and
    ``single(value, reader)``: the producer of ``value`` if ``reader`` is its only reader and it is not
    protected, else None."""
    readers = _readers(nodes)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}

    def single(value: str, reader: int) -> int | None:
        if value in protected or readers.get(value) != [reader]:
            return None
        return producer.get(value)

    return readers, producer, single


def kept_nodes(nodes: list[onnx.NodeProto], body: set[int], outputs: set[str], protected: set[str]) -> set[int]:
    """The nodes of ``body`` (indices into ``nodes``) that stay in the graph beside a fused node making
    ``outputs``: those whose value a node outside the body (or the graph: ``protected``) also reads, and the
    body nodes they read from (a value in ``outputs`` is the fused node's)."""
    readers = _readers(nodes)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    keep = {
        i
        for i in body
        if nodes[i].output[0] not in outputs
        and any(o in protected or set(readers.get(o, [])) - body for o in nodes[i].output)
    }
    stack = list(keep)
    while stack:
        for x in nodes[stack.pop()].input:
            j = producer.get(x)
            if j in body and j not in keep and x not in outputs:
                keep.add(j)
                stack.append(j)
    return keep


def fuse_repeat_kv_matmul(nodes: list[onnx.NodeProto], protected: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with repeat_kv + MatMul chains replaced by RepeatKvMatMul nodes (see the module docstring)."""
    readers, producer, single = graph_index(nodes, protected)

    def op(i: int | None, op_type: str) -> bool:
        return i is not None and nodes[i].op_type == op_type and nodes[i].domain in ("", "ai.onnx")

    drop: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for m, mm in enumerate(nodes):
        if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or m in drop:
            continue
        chain: list[int] = []
        scale = ""
        shape_readers: list[int] = []
        cur = single(mm.input[1], m)
        transpose = False
        if cur is None and mm.input[1] not in protected:
            # The repeated V may also be read by Shape nodes (torch exports): they get its shape computed.
            others = [r for r in readers.get(mm.input[1], []) if r != m]
            if others and all(op(r, "Shape") for r in others):
                shape_readers = others
                cur = producer.get(mm.input[1])
        if op(cur, "Mul"):
            mul = nodes[cur]
            # Mul(Transpose(...), scalar) in either operand order.
            t_in = next((x for x in mul.input if op(producer.get(x), "Transpose")), None)
            if t_in is None:
                continue
            scale = mul.input[1] if mul.input[0] == t_in else mul.input[0]
            chain.append(cur)
            cur = single(t_in, cur)
        if op(cur, "Transpose") and not shape_readers:
            perm = next((list(a.ints) for a in nodes[cur].attribute if a.name == "perm"), None)
            if perm != [0, 1, 3, 2]:
                continue
            transpose = True
            chain.append(cur)
            cur = single(nodes[cur].input[0], cur)
        elif scale:
            continue
        if not op(cur, "Reshape"):
            continue
        reshape = nodes[cur]
        chain.append(cur)
        cur = single(reshape.input[0], cur)
        if not op(cur, "Expand"):
            continue
        expand = nodes[cur]
        chain.append(cur)
        cur = single(expand.input[0], cur)
        if not op(cur, "Unsqueeze") or len(nodes[cur].input) != 2:
            continue
        unsq = nodes[cur]
        chain.append(cur)
        if any(i in drop or i in replace for i in chain + shape_readers):
            continue
        # A scalar Mul right after the product (attention scale) is applied in place.
        out_name, post = mm.output[0], ""
        after = readers.get(out_name, [])
        if (
            transpose
            and out_name not in protected
            and len(after) == 1
            and op(after[0], "Mul")
            and after[0] not in drop
            and after[0] not in replace
        ):
            mul = nodes[after[0]]
            post = mul.input[1] if mul.input[0] == out_name else mul.input[0]
            drop.add(after[0])
            out_name = mul.output[0]
        drop.update(chain)
        for r in shape_readers:
            attrs = {a.name: a.i for a in nodes[r].attribute if a.name in ("start", "end")}
            replace[r] = helper.make_node(
                "RepeatKvShape",
                [unsq.input[0], unsq.input[1], expand.input[1], reshape.input[1]],
                list(nodes[r].output),
                name=nodes[r].name or nodes[r].output[0],
                domain=FUSED_DOMAIN,
                **attrs,
            )
        replace[m] = helper.make_node(
            "RepeatKvMatMul",
            [mm.input[0], unsq.input[0], unsq.input[1], expand.input[1], reshape.input[1], scale, post],
            [out_name],
            name=mm.name or mm.output[0],
            domain=FUSED_DOMAIN,
            transpose_b=int(transpose),
        )
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]


#: Positions of the fixed inputs of ``ai.onnxkv::MaskedAttention`` (see :func:`fuse_masked_attention`).
MASKED_ATTENTION_INPUTS = (
    "q",
    "k",
    "v",
    "mask",
    "k_axes",
    "k_expand",
    "k_reshape",
    "v_axes",
    "v_expand",
    "v_reshape",
    "k_scale",
    "score_scale",
    "q_scale",
    "softcap_div",
    "softcap_mul",
)


def constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a ``Constant`` node given as a tensor or a float/int (list), in its ONNX type (float32,
    int64), else None (a sparse, string or missing value)."""
    for a in node.attribute:
        if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
            return numpy_helper.to_array(a.t)
        if a.name in ("value_float", "value_floats"):
            return np.asarray(helper.get_attribute_value(a), np.float32)
        if a.name in ("value_int", "value_ints"):
            return np.asarray(helper.get_attribute_value(a), np.int64)
    return None


def constant_node_values(nodes: list[onnx.NodeProto]) -> dict[str, np.ndarray]:
    """Output name -> value of every ``Constant`` node of ``nodes`` that :func:`constant_node_value` reads."""
    out = {}
    for n in nodes:
        if default_op(n, "Constant") and len(n.output) == 1:
            value = constant_node_value(n)
            if value is not None:
                out[n.output[0]] = value
    return out


def default_op(node: onnx.NodeProto, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def fuse_masked_attention(nodes: list[onnx.NodeProto], protected: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with each eager attention block replaced by one ``ai.onnxkv::MaskedAttention`` node.

    Run after :func:`fuse_repeat_kv_matmul`.  The block, as exported from
    eager attention (``torch.onnx.export`` of Llama-style models and
    :mod:`onnxkv.zoo.concat`)::

        scores = S(Q, K)                      # see below
        capped = Mul(Tanh(Div(scores, c)), c) # optional: Gemma 2's softcap (either Mul operand order)
        P      = Softmax(Add(capped, mask))   # mask: either Add operand
        P'     = Where(IsNaN(P), fill, P)     # optional NaN guard of fully masked rows
        P''    = Cast(...Cast(P'))            # optional Casts (transformers' softmax(dtype=float32).to(q.dtype))
        Y      = RepeatKvMatMul(P'', V, ...)  # transpose_b=0, or MatMul(P'', V)

    where ``S`` is ``RepeatKvMatMul(Q, K, axes, expand, reshape, [k_scale],
    [post])`` with ``transpose_b=1``, or ``MatMul(Q, [Mul(., k_scale)]
    Transpose(K, perm=[0, 1, 3, 2]))``, either optionally followed by a
    ``Mul``/``Div`` by ``score_scale``; ``Q`` may be ``Mul(q, q_scale)`` (the
    query scaling of exports) where exactly one operand, ``q_scale``, is made
    by no node (an initializer or graph input) or by a ``Constant``.  The fused node reads
    ``MASKED_ATTENTION_INPUTS`` by position (empty name = absent), then every
    other value the block reads; attribute ``score_div=1`` when the score
    scale divides; attribute ``body`` holds the replaced nodes as a graph
    whose inputs are the fused node's inputs, so the kernel can evaluate the
    original expression literally whenever the streaming kernel cannot
    express it.  Every intermediate must have the block as its only reader
    and not be protected; the final output keeps its name.
    """
    readers, producer, single = graph_index(nodes, protected)

    def is_op(i: int | None, op_type: str, domain: str = "") -> bool:
        if i is None:
            return False
        return (
            default_op(nodes[i], op_type) if not domain else (nodes[i].op_type == op_type and nodes[i].domain == domain)
        )

    def transpose_b(i: int) -> int:
        return next((a.i for a in nodes[i].attribute if a.name == "transpose_b"), 0)

    def scores(i: int | None) -> tuple[list[int], dict[str, str], int] | None:
        """(nodes, roles, score_div) of the Q·K product ending at node ``i``."""
        chain, roles, div = [], {}, 0
        if is_op(i, "Mul") or is_op(i, "Div"):
            node = nodes[i]
            inner = [
                x
                for x in (node.input if node.op_type == "Mul" else node.input[:1])
                if is_op(single(x, i), "MatMul") or is_op(single(x, i), "RepeatKvMatMul", FUSED_DOMAIN)
            ]
            if len(inner) != 1:
                return None
            roles["score_scale"] = node.input[1] if node.input[0] == inner[0] else node.input[0]
            div = int(node.op_type == "Div")
            chain.append(i)
            i = single(inner[0], i)
        if is_op(i, "RepeatKvMatMul", FUSED_DOMAIN) and transpose_b(i):
            ins = list(nodes[i].input) + [""] * (7 - len(nodes[i].input))
            if ins[6] and roles:
                return None  # a product scale inside and outside: not a pattern exports make
            roles.update(q=ins[0], k=ins[1], k_axes=ins[2], k_expand=ins[3], k_reshape=ins[4], k_scale=ins[5])
            if ins[6]:
                roles["score_scale"] = ins[6]
            return chain + [i] + scaled_query(i, roles), roles, div
        if not is_op(i, "MatMul"):
            return None
        mm = nodes[i]
        chain.append(i)
        cur = single(mm.input[1], i)
        if is_op(cur, "Mul"):
            mul = nodes[cur]
            t_in = next((x for x in mul.input if is_op(single(x, cur), "Transpose")), None)
            if t_in is None:
                return None
            roles["k_scale"] = mul.input[1] if mul.input[0] == t_in else mul.input[0]
            chain.append(cur)
            cur = single(t_in, cur)
        if not is_op(cur, "Transpose") or next(
            (list(a.ints) for a in nodes[cur].attribute if a.name == "perm"), None
        ) != [0, 1, 3, 2]:
            return None
        roles.update(q=mm.input[0], k=nodes[cur].input[0])
        return chain + [cur] + scaled_query(i, roles), roles, div

    def scaled_query(product: int, roles: dict[str, str]) -> list[int]:
        """[the Mul node] when the product's query is ``Mul(q, constant)`` read by it alone (roles q and
        q_scale are then set), else []."""
        m = single(roles["q"], product)
        if not is_op(m, "Mul") or len(nodes[m].input) != 2:
            return []
        constant = [producer.get(x) is None or is_op(producer.get(x), "Constant") for x in nodes[m].input]
        if constant.count(True) != 1:
            return []
        scale = constant.index(True)
        roles.update(q=nodes[m].input[1 - scale], q_scale=nodes[m].input[scale])
        return [m]

    def softcapped(i: int | None) -> tuple[list[int], dict[str, str], int | None] | None:
        """(nodes, roles, the product's node) of Gemma 2's ``Mul(Tanh(Div(scores, c)), c')`` ending at ``i``."""
        if not is_op(i, "Mul"):
            return None
        mul = nodes[i]
        for t_in, c in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
            t = single(t_in, i)
            d = single(nodes[t].input[0], t) if is_op(t, "Tanh") else None
            if is_op(d, "Div"):
                return [i, t, d], {"softcap_div": nodes[d].input[1], "softcap_mul": c}, single(nodes[d].input[0], d)
        return None

    drop: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for s, sm in enumerate(nodes):
        if not default_op(sm, "Softmax") or s in drop:
            continue
        add = single(sm.input[0], s)
        if not is_op(add, "Add"):
            continue
        found = None
        a, b = nodes[add].input
        for x, mask in ((a, b), (b, a)):  # noqa: B007  (mask is read after the loop)
            capped = softcapped(single(x, add))
            found = scores(single(x, add) if capped is None else capped[2])
            if found is not None:
                break
        if found is None:
            continue
        chain, roles, div = found
        if capped is not None:
            chain += capped[0]
            roles.update(capped[1])
        roles["mask"] = mask
        chain += [add, s]
        probs = sm.output[0]
        after = readers.get(probs, [])
        if probs in protected:
            continue
        if len(after) == 2 and sorted(nodes[r].op_type for r in after) == ["IsNaN", "Where"]:
            isnan, where = sorted(after, key=lambda r: nodes[r].op_type != "IsNaN")
            w = nodes[where]
            if not (
                default_op(nodes[isnan], "IsNaN")
                and default_op(w, "Where")
                and single(nodes[isnan].output[0], where) == isnan
                and list(w.input)[::2] == [nodes[isnan].output[0], probs]
            ):
                continue
            chain += [isnan, where]
            probs = w.output[0]
            after = readers.get(probs, []) if probs not in protected else []
        while len(after) == 1 and is_op(after[0], "Cast"):  # softmax(..., dtype=float32).to(query.dtype)
            chain.append(after[0])
            probs = nodes[after[0]].output[0]
            after = readers.get(probs, []) if probs not in protected else []
        if len(after) != 1:
            continue
        pv = after[0]
        pvn = nodes[pv]
        if (
            is_op(pv, "RepeatKvMatMul", FUSED_DOMAIN)
            and not transpose_b(pv)
            and pvn.input[0] == probs
            and not any(pvn.input[5:])
        ):
            roles.update(v=pvn.input[1], v_axes=pvn.input[2], v_expand=pvn.input[3], v_reshape=pvn.input[4])
        elif is_op(pv, "MatMul") and pvn.input[0] == probs:
            roles["v"] = pvn.input[1]
        else:
            continue
        chain.append(pv)
        if any(i in drop or i in replace for i in chain):
            continue
        drop.update(i for i in chain if i != pv)
        replace[pv] = fused_with_body(
            "MaskedAttention",
            [nodes[i] for i in sorted(chain)],
            [roles.get(r, "") for r in MASKED_ATTENTION_INPUTS],
            score_div=div,
        )
    return [replace.get(i, n) for i, n in enumerate(nodes) if i not in drop]


def fused_with_body(
    op_type: str, body_nodes: list[onnx.NodeProto], fixed_inputs: list[str], outputs: list[str] | None = None, **attrs
) -> onnx.NodeProto:
    """A ``FUSED_DOMAIN`` node replacing ``body_nodes`` (in graph order).

    Its outputs are ``outputs`` (values the body makes; an empty name is an
    absent output, kept by position), by default the last body node's outputs.
    Its inputs are ``fixed_inputs`` by position (empty name = absent), then
    every other value the body reads; attribute ``body`` holds the nodes as a
    graph over those inputs with the non-empty outputs as graph outputs (see
    :class:`onnxkv.plan.ops._body.Body`), so the fused kernel can evaluate
    them literally when it cannot express a call.  The node takes the last
    body node's name (or first output).
    """
    last = body_nodes[-1]
    outputs = [o for o in last.output if o] if outputs is None else outputs
    made = {o for n in body_nodes for o in n.output}
    inputs = list(fixed_inputs)
    for n in body_nodes:
        inputs += [x for x in n.input if x and x not in made and x not in inputs]
    body_inputs = [helper.make_empty_tensor_value_info(x) for x in dict.fromkeys(x for x in inputs if x)]
    name = last.name or last.output[0]
    body = helper.make_graph(
        body_nodes, f"{name}_body", body_inputs, [helper.make_empty_tensor_value_info(o) for o in outputs if o]
    )
    return helper.make_node(op_type, inputs, outputs, name=name, domain=FUSED_DOMAIN, body=body, **attrs)
