"""A small helper over ``onnx.helper`` that the builders share: nodes, constants,
initializers, graph inputs/outputs and the final ``ModelProto``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

Dim = int | str | None


class GraphBuilder:
    """Accumulates a graph. ``node`` returns its output name (or names when ``outputs > 1``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._constants: set[str] = set()

    def input(self, name: str, elem_type: int, shape: Sequence[Dim]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, name: str, elem_type: int, shape: Sequence[Dim]) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def initializer(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def constant(self, value: int | float | Sequence[int], dtype: type = np.int64) -> str:
        """A ``Constant`` node named like the GenAI builder's, e.g. ``/model/constants/INT64/[1]``;
        created once per dtype and value."""
        array = np.asarray(value, dtype=dtype)
        type_name = TensorProto.DataType.Name(helper.np_dtype_to_tensor_dtype(array.dtype))
        out = f"/model/constants/{type_name}/{array.tolist()}"
        if out not in self._constants:
            self._constants.add(out)
            self.nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [out],
                    name=out.replace("constants", "constant_nodes"),
                    value=numpy_helper.from_array(array),
                )
            )
        return out

    def node(
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str,
        *,
        outputs: Sequence[str] | int = 1,
        domain: str = "",
        **attrs: object,
    ) -> str | list[str]:
        """Add a node called ``name``; default output names are ``{name}/output_{k}``."""
        names = [f"{name}/output_{k}" for k in range(outputs)] if isinstance(outputs, int) else list(outputs)
        while inputs and inputs[-1] == "":
            inputs = inputs[:-1]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=name, domain=domain or None, **attrs))
        return names[0] if len(names) == 1 else names

    def model(self, opsets: dict[str, int], ir_version: int = 10) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        return helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
            ir_version=ir_version,
            producer_name="onnxkv.zoo",
        )


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
BOOL = TensorProto.BOOL


def causal_padding_mask(g: GraphBuilder, input_ids: str, attention_mask: str) -> str:
    """Boolean ``[batch, 1, seq, total]`` mask: query ``i`` sees key ``j`` iff
    ``attention_mask[b, j] == 1`` and ``j <= total - seq + i`` (queries are the last ``seq`` keys)."""
    base = "/model/attn_mask"
    seq = g.node(
        "Gather", [g.node("Shape", [input_ids], f"{base}/Shape_ids"), g.constant(1)], f"{base}/Gather_seq", axis=0
    )
    total = g.node(
        "Gather",
        [g.node("Shape", [attention_mask], f"{base}/Shape_mask"), g.constant(1)],
        f"{base}/Gather_total",
        axis=0,
    )
    keys = g.node("Range", [g.constant(0), total, g.constant(1)], f"{base}/Range_keys")  # [T]
    first = g.node("Sub", [total, seq], f"{base}/Sub")
    queries = g.node("Range", [first, total, g.constant(1)], f"{base}/Range_queries")  # [S]
    queries = g.node("Unsqueeze", [queries, g.constant([1])], f"{base}/Unsqueeze_queries")  # [S, 1]
    causal = g.node("LessOrEqual", [keys, queries], f"{base}/LessOrEqual")  # [S, T]
    padding = g.node("Cast", [attention_mask], f"{base}/Cast", to=BOOL)
    padding = g.node("Unsqueeze", [padding, g.constant([1, 2])], f"{base}/Unsqueeze_padding")  # [B, 1, 1, T]
    return g.node("And", [padding, causal], f"{base}/And")  # [B, 1, S, T]
