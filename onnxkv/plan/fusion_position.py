"""Fusion of the rotary tables exports compute from ``position_ids`` every run into ``ai.onnxkv::PositionTable``.

:func:`fuse_position_tables` takes each cone of
:func:`onnxkv.plan.position_cone.position_cones` that computes a ``Cos`` or a
``Sin`` (the rotary cosines and sines of ``torch.onnx.export`` graphs, about a
dozen nodes per run) and replaces its nodes by one ``PositionTable`` node
(:mod:`onnxkv.plan.ops.position_table`) with the nodes as its ``body``, which
reads the outputs from tables of :data:`TABLE_ROWS` positions built once.  The
fused node stands where the cone starts (it reads the positions, a graph
input, and initializers; the Constant nodes the cone reads are copied into its
body); a cone node whose value something outside the cone also reads stays
too.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

from onnxkv.plan.fusion import FUSED_DOMAIN, graph_index, kept_nodes
from onnxkv.plan.position_cone import position_cones

__all__ = ["TABLE_ROWS", "fuse_position_tables"]

#: Positions a table covers (float32 rows of the features: 8,192 x 128 x 4 bytes = 4 MiB per distinct output);
#: a run at a later position evaluates the nodes instead.
TABLE_ROWS = 8192


def fuse_position_tables(
    nodes: list[onnx.NodeProto], protected: set[str], constants: Mapping[str, np.ndarray | None]
) -> list[onnx.NodeProto]:
    """``nodes`` with each rotary cone replaced by a PositionTable node (see the module docstring)."""
    _, producer, _ = graph_index(nodes, protected)
    made = set(producer)
    inputs = {x for n in nodes for x in n.input if x and x not in made and x not in constants}
    constant_nodes = {n.output[0]: i for i, n in enumerate(nodes) if n.op_type == "Constant" and len(n.output) == 1}
    at: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for cone in position_cones(nodes, constants, inputs, protected):
        members = set(cone.nodes)
        if not any(nodes[i].op_type in ("Cos", "Sin") for i in members):
            continue
        outputs = [name for name, _ in cone.outputs]
        inside = {nodes[i].output[0] for i in members}
        reads = dict.fromkeys(x for i in cone.nodes for x in nodes[i].input if x and x not in inside)
        # the Constant nodes the cone reads join its body (they may stand after its first output)
        copied = [nodes[constant_nodes[x]] for x in reads if x in constant_nodes]
        extra = [x for x in reads if x != cone.source and x not in constant_nodes]
        graph = helper.make_graph(
            copied + [nodes[i] for i in cone.nodes],
            "position_table_body",
            [helper.make_empty_tensor_value_info(x) for x in [cone.source, *extra]],
            [helper.make_empty_tensor_value_info(o) for o in outputs],
        )
        axes = [a for _, layout in cone.outputs for a in (layout.a0, layout.a1)]
        fused = helper.make_node(
            "PositionTable",
            [cone.source, *extra],
            outputs,
            name=f"{outputs[0]}_table",
            domain=FUSED_DOMAIN,
            body=graph,
            rows=TABLE_ROWS,
            position_axes=axes,
        )
        keep = kept_nodes(nodes, members, set(outputs), protected)
        # it reads the source (a graph input) and initializers only: it may stand where the cone starts
        at[min(members)] = fused
        drop |= members - keep
    if not at:
        return nodes
    out: list[onnx.NodeProto] = []
    for i, n in enumerate(nodes):
        if i in at:
            out.append(at[i])
        if i not in drop:
            out.append(n)
    return out
