"""Helpers for the attention-family operator tests (imported as a top-level module by pytest).

Build one-node models, run ONNX Runtime or onnx.reference on them, and run an Op class.
"""

from __future__ import annotations

import mmap

import numpy as np
import onnx
from onnx import helper

from onnxkv.plan.context import RunContext
from onnxkv.plan.registry import BuildContext, Op


def make_model(
    op_type: str,
    inputs: dict[str, np.ndarray | None],
    outputs: list[str],
    opsets: dict[str, int],
    domain: str = "",
    **attrs,
) -> onnx.ModelProto:
    """A one-node model; ``None`` inputs become omitted optional inputs (trailing ones dropped)."""
    names = [n if a is not None else "" for n, a in inputs.items()]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op_type, names, outputs, domain=domain, name="n0", **attrs)
    vis = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in inputs.items()
        if a is not None
    ]
    outs = [helper.make_empty_tensor_value_info(o) for o in outputs if o]
    graph = helper.make_graph([node], "g", vis, outs)
    ops = [helper.make_opsetid(d, v) for d, v in opsets.items()]
    return helper.make_model(graph, opset_imports=ops, ir_version=10)


def feeds(inputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    return {n: a for n, a in inputs.items() if a is not None}


def run_ort(model: onnx.ModelProto, inputs: dict[str, np.ndarray | None]) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds(inputs))


def run_reference(model: onnx.ModelProto, inputs: dict[str, np.ndarray | None]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds(inputs))


def build_op(cls: type[Op], model: onnx.ModelProto) -> Op:
    opsets = {o.domain: o.version for o in model.opset_import}
    return cls(model.graph.node[0], BuildContext(opsets=opsets))


def run_op(cls: type[Op], model: onnx.ModelProto, inputs: dict[str, np.ndarray | None]) -> tuple[list, RunContext]:
    """Run the node through ``cls``; return (outputs, run context with counters)."""
    op = build_op(cls, model)
    rt = RunContext(lambda node, index, shape, dtype: np.empty(shape, dtype), recording=True, step=0)
    args = list(inputs.values())
    n = len(model.graph.node[0].input)
    return list(op.run(args[:n], rt)), rt


def owned_zeros(shape, dtype, offset: int = 0) -> np.ndarray:
    """Zeros in a buffer the array owns (mmap, page aligned) at ``offset`` bytes past a page: 0 gives the
    64-byte aligned pages the paged kernel reads in place, 16 pages it cannot (the gather path)."""
    count = int(np.prod(shape))
    buffer = mmap.mmap(-1, offset + max(count * np.dtype(dtype).itemsize, 1))
    return np.frombuffer(buffer, dtype, count, offset).reshape(shape)
