"""Caches a float16 model threads through Casts, moved inside the graph's float16.

A float16 model converted with float32 inputs and outputs (ONNX Runtime's
float16 converter with ``keep_io_types=True``: the ``model_fp16.onnx`` and
``model_q4f16.onnx`` of Transformers.js repositories) declares every
``past`` input and ``present`` output float32, and casts them around the node
that joins them: ``past (float32) -> Cast(to=float16) -> joiner -> present16
-> Cast(to=float32) -> present``.  No binding can run such a pair in place
(the joiner reads and writes float16 values the graph inputs and outputs never
hold), so each step would convert and copy the whole cache twice.

:func:`lift_cache_casts` rewrites a copy of such a graph so that the pairs are
float16 graph values the joiner reads and writes directly: the past input is
declared float16 and read where the Cast's result was, the present output is
the joiner's float16 result.  The Casts it removes convert exactly what the
caller converts at the boundary instead (:class:`CastBoundary`): a float32 past
fed to the session is rounded to float16 as the removed Cast rounded it, a
present returned is widened to float32 (exactly), so ``Session.run`` keeps the
model's declared types and values.  A pair is lifted only when that is
provably invisible:

* the past input is read only by Casts to float16 and by ``Shape`` / ``Size``
  (which see the same shape);
* the present output is made by a Cast to float32 of a float16 value, and no
  node reads the output;
* every layer's pair qualifies (else nothing is lifted).

This module imports only ``onnx``, ``numpy`` and its own package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from onnxkv.errors import InputError
from onnxkv.model.convention import CacheConvention
from onnxkv.model.scopes import scope_names, subgraphs

__all__ = ["CastBoundary", "lift_cache_casts"]

_F32, _F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
_SHAPE_ONLY = ("Shape", "Size")


@dataclass(frozen=True)
class CastBoundary:
    """The conversions :func:`lift_cache_casts` moved out of the graph.

    ``inputs`` / ``outputs``: graph value name -> the dtype the model declares
    (float32); the rewritten graph holds them as float16.
    """

    inputs: dict[str, np.dtype] = field(default_factory=dict)
    outputs: dict[str, np.dtype] = field(default_factory=dict)

    def graph_feeds(self, feeds: Mapping, api: str) -> dict:
        """``feeds`` with each lifted input as the graph holds it: a float32 array rounded to float16 as the
        removed Cast rounded it (a float16 one, the values that Cast makes, taken as it is).  Raises
        InputError naming ``api`` for an array of another dtype; other feeds are left to the plan."""
        out = dict(feeds)
        for name in self.inputs.keys() & out.keys():
            value = out[name]
            dtype = getattr(value, "dtype", None)
            if dtype == np.float32:
                out[name] = np.asarray(value).astype(np.float16)
            elif dtype != np.float16:
                raise InputError(
                    f"{api}: input '{name}' must be float32 (the model's type; float16 is taken as its cast), "
                    f"got {dtype if dtype is not None else type(value).__name__}"
                )
        return out

    def model_outputs(self, outputs: dict) -> dict:
        """``outputs`` with each lifted output in the model's declared dtype (float16 widened exactly)."""
        for name in self.outputs.keys() & outputs.keys():
            outputs[name] = outputs[name].astype(self.outputs[name])
        return outputs


def _cast_to(node: onnx.NodeProto) -> int | None:
    """The ``to`` of an ONNX Cast node, else None."""
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return None
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _elem(values, name: str) -> int | None:
    vi = next((v for v in values if v.name == name), None)
    return None if vi is None or not vi.type.HasField("tensor_type") else vi.type.tensor_type.elem_type


def lift_cache_casts(
    model: onnx.ModelProto, convention: CacheConvention
) -> tuple[onnx.ModelProto, CastBoundary] | None:
    """A copy of ``model`` whose cast cache pairs are float16 graph values, and the boundary conversions it
    moved out; None when no pair is cast or any pair does not qualify (module docstring).  ``model`` is not
    changed."""
    g = model.graph
    if convention.kind == "none" or not convention.layers:
        return None
    nodes = list(g.node)
    readers: dict[str, list[int]] = {}  # value -> indices of the nodes reading it
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for x in n.input:
            readers.setdefault(x, []).append(i)
        for o in n.output:
            producer[o] = i
    outputs = [o.name for o in g.output]
    rename: dict[str, str] = {}  # value -> the graph input or output it becomes
    dropped: set[int] = set()  # indices of the Cast nodes removed
    for past in convention.past_inputs:
        if _elem(g.input, past) != _F32:
            return None
        casts = [i for i in readers.get(past, []) if nodes[i].op_type not in _SHAPE_ONLY]
        if not casts or any(_cast_to(nodes[i]) != _F16 or nodes[i].input[0] != past for i in casts):
            return None
        for i in casts:
            if nodes[i].output[0] in outputs:
                return None
            rename[nodes[i].output[0]] = past
            dropped.add(i)
    for present in convention.present_outputs:
        at = producer.get(present)
        if _elem(g.output, present) != _F32 or at is None or _cast_to(nodes[at]) != _F32 or readers.get(present):
            return None
        source = nodes[at].input[0]
        if source in rename or source in outputs or source not in producer or outputs.count(present) != 1:
            return None
        rename[source] = present
        dropped.add(at)
    if any(name in rename for n in nodes for sub in subgraphs(n) for name in scope_names(sub)):
        return None  # control flow reads a value the rewrite renames
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    kept = [n for i, n in enumerate(nodes) if i not in dropped]
    del graph.node[:]
    for n in kept:
        m = graph.node.add()
        m.CopyFrom(n)
        for i, x in enumerate(m.input):
            if x in rename:
                m.input[i] = rename[x]
        for i, x in enumerate(m.output):
            if x in rename:
                m.output[i] = rename[x]
    lifted = set(convention.past_inputs) | set(convention.present_outputs)
    for vi in (*graph.input, *graph.output):
        if vi.name in lifted:
            vi.type.tensor_type.elem_type = _F16
    stale = set(rename)
    keep_info = [vi for vi in graph.value_info if vi.name not in stale and vi.name not in lifted]
    del graph.value_info[:]
    graph.value_info.extend(keep_info)
    f32 = np.dtype(np.float32)
    return out, CastBoundary(
        {name: f32 for name in convention.past_inputs}, {name: f32 for name in convention.present_outputs}
    )
