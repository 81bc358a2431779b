"""The plan's fusion passes, in the order they run over a graph's nodes (``Plan(fuse=True)``).

Each pass rewrites node patterns into one ``ai.onnxkv`` node whose body is the original nodes (see
:mod:`onnxkv.plan.fusion`); none fuses across a value in ``protected`` (graph outputs and values
subgraphs read).  A later pass sees the nodes the earlier ones made: the sibling MatMuls that read one
RMS norm are found after that norm is one node, and the prologue MatMuls (a norm feeding its products)
after both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from onnxkv.plan.fusion import fuse_masked_attention, fuse_repeat_kv_matmul, fuse_silu_gate
from onnxkv.plan.fusion_export import fuse_rms_norm, fuse_rotate_half, fuse_skip_rms_norm
from onnxkv.plan.fusion_export_mask import fuse_export_masks
from onnxkv.plan.fusion_gelu import fuse_gelu_tanh_gate
from onnxkv.plan.fusion_integer import fuse_dynamic_quant_matmuls
from onnxkv.plan.fusion_mask import fuse_mask_lengths
from onnxkv.plan.fusion_matmul import (
    absorb_sibling_biases,
    fuse_prologue_matmuls,
    fuse_sibling_matmuls,
    fuse_sibling_nbits,
)
from onnxkv.plan.fusion_position import fuse_position_tables
from onnxkv.plan.fusion_softcap import fuse_softcaps
from onnxkv.plan.fusion_view import fuse_view_chains

__all__ = ["fuse_graph"]


def fuse_graph(
    nodes: Sequence[onnx.NodeProto], protected: set[str], constants: Mapping[str, np.ndarray | None]
) -> list[onnx.NodeProto]:
    """``nodes`` (topologically ordered) with every fusion applied; ``constants`` the graph's constant
    values (read, never changed: passes that pack weights check their operands are constants)."""
    nodes = fuse_gelu_tanh_gate(fuse_export_masks(list(nodes), protected, constants), protected, constants)
    nodes = fuse_repeat_kv_matmul(fuse_silu_gate(nodes, protected), protected)
    nodes = fuse_softcaps(fuse_masked_attention(nodes, protected), protected)  # attention's caps are its own
    nodes = fuse_sibling_matmuls(fuse_rotate_half(fuse_rms_norm(nodes, protected), protected, constants), constants)
    nodes = absorb_sibling_biases(nodes, protected, constants)
    nodes = fuse_sibling_nbits(nodes, constants)
    nodes = fuse_dynamic_quant_matmuls(nodes, protected, constants)
    nodes = fuse_view_chains(fuse_skip_rms_norm(nodes, protected), protected)
    nodes = fuse_prologue_matmuls(nodes, protected, constants)
    # after fuse_rotate_half, which proves from the rotary nodes that their tables repeat their halves
    nodes = fuse_position_tables(nodes, protected, constants)
    return fuse_mask_lengths(nodes, protected)
