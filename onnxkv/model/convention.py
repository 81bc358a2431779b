"""Recognising how a decoder graph threads its KV cache.

A *cache convention* says which graph inputs carry the past keys/values,
which outputs carry the present ones, and which operator joins them:

* ``group_query_attention`` -- ONNX Runtime GenAI builder graphs:
  ``com.microsoft.GroupQueryAttention`` reads ``past_key_values.N.key/value``
  and writes ``present.N.key/value`` (inputs 3/4, outputs 1/2);
* ``attention`` -- ONNX opset-23/24 ``Attention`` with ``past_key`` /
  ``past_value`` (inputs 4/5) and ``present_key`` / ``present_value``;
* ``tensor_scatter`` -- opset-24 static caches: ``TensorScatter(past, update,
  write_indices) -> present`` of fixed capacity;
* ``concat`` -- plain exports where ``past -> Concat -> present``;
* ``none`` -- no recognised cache (the model still runs).

This module imports only ``onnx``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import onnx
from onnx import helper

__all__ = ["CacheLayer", "CacheConvention", "recognize_cache"]

KINDS = ("group_query_attention", "attention", "tensor_scatter", "concat", "none")


@dataclass(frozen=True)
class CacheLayer:
    """One layer's cache values: graph input and output names, and the joining node.

    ``window``: the number of most recent keys (the query's own included) the
    layer's attention sees, None for every key; known for GroupQueryAttention
    layers (``local_window_size``, or a window :func:`onnxkv.model.load.load`
    applied from ``genai_config.json``).  ``window_cache``: the layer's
    past/present are window-sized buffers (``sliding_window_cache=1``: the
    past holds only the most recent positions, see
    :mod:`onnxkv.plan.ops.attention_gqa`).
    """

    index: int
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    nodes: tuple[str, ...]
    window: int | None = None
    window_cache: bool = False


@dataclass
class CacheConvention:
    """How the graph threads its cache (see the module docstring).

    ``attributes``: GroupQueryAttention's ``do_rotary``, ``rotary_interleaved``,
    ``local_window_size`` and ``softcap`` (one value when every node has the
    same, else the list of the nodes' values in graph order; the per-layer
    window is also in :attr:`CacheLayer.window`), and ``nonpad_kv_seqlen``
    for Attention graphs that feed it.
    """

    kind: str
    layers: list[CacheLayer] = field(default_factory=list)
    num_heads: int | None = None
    kv_heads: int | None = None
    head_size: int | None = None
    capacity: int | None = None
    attributes: dict = field(default_factory=dict)

    @property
    def past_inputs(self) -> list[str]:
        return [n for layer in self.layers for n in (layer.past_key, layer.past_value)]

    @property
    def present_outputs(self) -> list[str]:
        return [n for layer in self.layers for n in (layer.present_key, layer.present_value)]

    def describe(self) -> str:
        if self.kind == "none":
            return "cache: none recognised (the KV cache, if any, is not threaded as past/present pairs)"
        parts = [f"cache: {self.kind}", f"layers={len(self.layers)}"]
        for k in ("num_heads", "kv_heads", "head_size", "capacity"):
            v = getattr(self, k)
            if v is not None:
                parts.append(f"{k}={v}")
        parts.extend(f"{k}={v}" for k, v in sorted(self.attributes.items()))
        if any(layer.window is not None for layer in self.layers):
            parts.append(f"windows={[layer.window for layer in self.layers]}")
        if any(layer.window_cache for layer in self.layers):
            parts.append(f"window_caches={[i for i, layer in enumerate(self.layers) if layer.window_cache]}")
        first = self.layers[0]
        parts.append(f"names={first.past_key}->{first.present_key}")
        return " ".join(parts)


def _layer_number(name: str, fallback: int) -> int:
    m = re.findall(r"\d+", name)
    return int(m[0]) if m else fallback


def _static_dim(vi: onnx.ValueInfoProto | None, axis: int) -> int | None:
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    dims = vi.type.tensor_type.shape.dim
    if axis >= len(dims) or not dims[axis].HasField("dim_value"):
        return None
    return int(dims[axis].dim_value)


def _head_counts(node: onnx.NodeProto, names: tuple[str, ...]) -> dict:
    """Attribute name -> value of ``node``'s attributes; the head counts in ``names`` must be positive INTs."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    for name in names:
        v = a.get(name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise onnx.checker.ValidationError(
                f"{node.op_type} node '{node.name}': attribute '{name}' must be a positive int, got {v!r:.60}"
            )
    return a


def recognize_cache(model: onnx.ModelProto) -> CacheConvention:
    """Find the past/present pairs of ``model`` and the operator family joining them."""
    g = model.graph
    inputs = {i.name: i for i in g.input}
    outputs = {o.name: o for o in g.output}
    found: list[tuple] = []
    attrs: dict = {}
    num_heads = kv_heads = None
    from_input, to_output = _casts(g, inputs, outputs)

    def graph_names(ins: list, outs: list) -> tuple[list, list]:
        """ins / outs with each value a Cast makes from a graph input, or casts to a graph output, named by it."""
        return [from_input.get(x, x) for x in ins], [to_output.get(x, x) for x in outs]

    for n in g.node:
        if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft":
            ins, outs = graph_names(list(n.input) + [""] * 9, list(n.output) + [""] * 3)
            if ins[3] in inputs and outs[1] in outputs:
                a = _head_counts(n, ("num_heads", "kv_num_heads"))
                window = a.get("local_window_size", -1)
                found.append(
                    (
                        "group_query_attention",
                        ins[3],
                        ins[4],
                        outs[1],
                        outs[2],
                        n.name,
                        window if isinstance(window, int) and window > 0 else None,
                        a.get("sliding_window_cache", 0) == 1,
                    )
                )
                num_heads, kv_heads = a.get("num_heads"), a.get("kv_num_heads")
                for k in ("do_rotary", "rotary_interleaved", "local_window_size", "softcap"):
                    if k in a:
                        attrs.setdefault(k, []).append(a[k])
        elif n.op_type == "Attention" and n.domain in ("", "ai.onnx"):
            ins, outs = graph_names(list(n.input) + [""] * 7, list(n.output) + [""] * 4)
            if ins[4] in inputs and outs[1] in outputs:
                found.append(("attention", ins[4], ins[5], outs[1], outs[2], n.name))
                a = _head_counts(n, ("q_num_heads", "kv_num_heads"))
                num_heads, kv_heads = a.get("q_num_heads", num_heads), a.get("kv_num_heads", kv_heads)
                if ins[6]:
                    attrs["nonpad_kv_seqlen"] = True
    kinds = {f[0] for f in found}
    for k, values in attrs.items():  # one value when every node agrees, else each node's (in graph order)
        if isinstance(values, list):
            attrs[k] = values[0] if all(v == values[0] for v in values) else values

    if not found:
        scatter: list[tuple[str, str, str]] = []
        concat: list[tuple[str, str, str]] = []
        for n in g.node:
            if n.op_type == "TensorScatter" and n.input and n.input[0] in inputs and n.output[0] in outputs:
                scatter.append((n.input[0], n.output[0], n.name))
            elif n.op_type == "Concat" and n.output:
                # a float16 export with float32 inputs and outputs casts around the Concat
                present = n.output[0] if n.output[0] in outputs else to_output.get(n.output[0])
                pasts = [x if x in inputs else from_input[x] for x in n.input if x in inputs or x in from_input]
                if present and pasts:
                    concat.append((pasts[0], present, n.name))
        for kind, singles in (("tensor_scatter", scatter), ("concat", concat)):
            if singles:
                kinds = {kind}
                found = _pair_singles(kind, singles)
                break

    if not found:
        return CacheConvention("none")
    if len(kinds) > 1:
        raise onnx.checker.ValidationError(f"graph mixes cache conventions {sorted(kinds)}")
    layers = []
    for i, (_kind, pk, pv, ok, ov, node, *window) in enumerate(found):
        layers.append(CacheLayer(_layer_number(pk, i), pk, pv, ok, ov, tuple(x for x in node.split("|") if x), *window))
    layers.sort(key=lambda layer: layer.index)
    kind = found[0][0]
    first = inputs[layers[0].past_key]
    head_size = _static_dim(first, 3)
    if head_size is None and kind == "group_query_attention":
        head_size = _gqa_head_size(g, layers[0].past_key, num_heads, kv_heads, from_input)
    kv = _static_dim(first, 1) or kv_heads
    capacity = _static_dim(first, 2) if kind == "tensor_scatter" else None
    return CacheConvention(kind, layers, num_heads, kv, head_size, capacity, attrs)


def _gqa_head_size(
    g: onnx.GraphProto, past_key: str, num_heads: int | None, kv_heads: int | None, from_input: dict
) -> int | None:
    """The head size of the GroupQueryAttention node reading ``past_key`` (or a Cast of it: ``from_input``),
    read from the weight of the product making its query (the builder's past inputs leave it symbolic,
    ``kv_cache_dim``, and state it only in ``genai_config.json``): the last dim of a MatMul's constant weight
    or MatMulNBits' ``N``, past an ``Add`` of a constant bias, divided by the heads that query carries
    (``num_heads``, plus twice ``kv_heads`` when it packs q, k and v).  None when no such product makes it or
    the width does not divide into those heads."""
    node = next(
        (
            n
            for n in g.node
            if n.op_type == "GroupQueryAttention" and [from_input.get(x, x) for x in n.input[3:4]] == [past_key]
        ),
        None,
    )
    if node is None or not num_heads or not kv_heads:
        return None
    producers = {o: n for n in g.node for o in n.output if o}
    constants = {t.name: t for t in g.initializer}
    name, width = node.input[0], None
    for _ in range(2):  # the product, or an Add of a constant bias to it
        n = producers.get(name)
        if n is None:
            return None
        if n.op_type == "Add" and len(n.input) == 2:
            rest = [x for x in n.input if x not in constants]
            if len(rest) != 1:
                return None
            name = rest[0]
            continue
        if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and len(n.input) == 2:
            w = constants.get(n.input[1])
            width = int(w.dims[-1]) if w is not None and len(w.dims) == 2 else None
        elif n.op_type == "MatMulNBits" and n.domain == "com.microsoft":
            width = next((a.i for a in n.attribute if a.name == "N" and a.type == onnx.AttributeProto.INT), None)
        break
    packed = len(node.input) < 2 or not node.input[1]
    heads = num_heads + 2 * kv_heads if packed else num_heads
    if width is None or not heads <= width < 2**31 or width % heads:
        return None
    return width // heads


def _is_key(name: str) -> bool:
    """Whether a past input ``name`` holds keys: the later of the words 'key' and 'value' in it decides
    (``past_key_values.0.value`` holds values), else a ``.k`` component."""
    low = name.lower()
    k, v = low.rfind("key"), low.rfind("value")
    if k >= 0 or v >= 0:
        return k > v
    return re.search(r"\.k(\b|_|$)", name) is not None


def _casts(g: onnx.GraphProto, inputs: dict, outputs: dict) -> tuple[dict, dict]:
    """({Cast output: the graph input it casts}, {value: the graph output a Cast of it makes}): the Casts a
    float16 export with float32 inputs and outputs puts around its cache Concats."""
    from_input, to_output = {}, {}
    for n in g.node:
        if n.op_type == "Cast" and n.input and n.output:
            if n.input[0] in inputs:
                from_input[n.output[0]] = n.input[0]
            if n.output[0] in outputs:
                to_output[n.input[0]] = n.output[0]
    return from_input, to_output


def _pair_singles(kind: str, singles: list[tuple[str, str, str]]) -> list[tuple]:
    """Pair key and value entries (by 'key'/'value' in the names, else in order)."""
    keys = [s for s in singles if _is_key(s[0])]
    values = [s for s in singles if s not in keys]
    if len(keys) != len(values):
        keys, values = singles[0::2], singles[1::2]
    by_layer = {_layer_number(v[0], i): v for i, v in enumerate(values)}
    out = []
    for i, k in enumerate(keys):
        v = by_layer.get(_layer_number(k[0], i), values[i] if i < len(values) else None)
        if v is None:
            continue
        out.append((kind, k[0], v[0], k[1], v[1], f"{k[2]}|{v[2]}"))
    return out
