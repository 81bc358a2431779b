"""Compiled steps against the node-by-node runs on random graphs (onnxkv.plan.compiled_step).

Each graph starts from a product of its input (a recorded call, so that later
nodes can join segments) and chains random nodes over heads [1, H, 1, D]:
strided and contiguous Slices, two-input Concats, scales and quotients by
one value (either operand order), sums, Gemma 2's tanh cap, transposes,
products and softmaxes (whose arithmetic depends on their input's layout: a
recording must not pack a Slice they read), and Neg (no compiled kernel: a
Python node between segments).  A session with
compiled steps and one without run it on fresh arrays several times: the
outputs must be equal bit for bit, or both runs raise the same onnxkv error.
"""

from __future__ import annotations

import numpy as np
import onnx
from _same_outcome import assert_same_outcome, outcome
from fuzzing import examples
from onnx import TensorProto, helper, numpy_helper

import onnxkv
from onnxkv.plan.compiled_step import Segment

_INT_MAX = np.iinfo(np.int64).max


class _Graph:
    """A random graph under construction: its nodes, initializers and float32 values by name and shape."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.n = 0

    def name(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    def const(self, value: np.ndarray) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], shape: tuple[int, ...], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        self.shapes[out] = shape
        return out

    def pick(self, ok=lambda shape: True) -> str | None:
        names = [n for n, s in self.shapes.items() if ok(s)]
        return str(self.rng.choice(names)) if names else None


def _grow(g: _Graph) -> str:
    """Add one random node over the graph's values; returns what it added."""
    rng = g.rng
    kind = str(
        rng.choice(["slice", "concat", "scale", "quotient", "add", "neg", "cap", "transpose", "matmul", "softmax"])
    )
    v = g.pick(lambda s: len(s) == 4 and s[3] >= 2)
    if v is None:
        return "nothing"
    s = g.shapes[v]
    if kind == "slice":
        axis = int(rng.choice([3, 1])) if s[1] >= 2 else 3
        start = int(rng.integers(0, s[axis] - 1))
        end = _INT_MAX if rng.random() < 0.3 else int(rng.integers(start + 1, s[axis] + 1))
        shape = list(s)
        shape[axis] = min(end, s[axis]) - start
        ins = [v, g.const([start]), g.const([end]), g.const([axis if rng.random() < 0.5 else axis - 4])]
        g.node("Slice", ins, tuple(shape))
    elif kind == "concat":
        axis = int(rng.choice([3, 1]))
        w = g.pick(lambda t: len(t) == 4 and all(t[i] == s[i] for i in range(4) if i != axis))
        g.node("Concat", [v, w] if rng.random() < 0.5 else [w, v], tuple(
            s[i] + g.shapes[w][i] if i == axis else s[i] for i in range(4)), axis=axis if rng.random() < 0.5 else axis - 4)  # fmt: skip
    elif kind in ("scale", "quotient"):
        c = g.const(
            np.array(rng.uniform(0.5, 3.0) * rng.choice([-1, 1]), np.float32).reshape((1,) * int(rng.integers(0, 3)))
        )
        ins = [v, c] if kind == "quotient" or rng.random() < 0.5 else [c, v]
        g.node("Div" if kind == "quotient" else "Mul", ins, s)
    elif kind == "add":
        w = g.pick(lambda t: t == s)
        g.node("Add", [v, w], s)
    elif kind == "neg":
        g.node("Neg", [v], s)
    elif kind == "matmul":  # a product whose kernel (packed, C-contiguous A) and NumPy's path round differently
        w = g.const((rng.standard_normal((s[3], s[3])) / np.sqrt(s[3])).astype(np.float32))
        g.node("MatMul", [v, w], s)
    elif kind == "softmax":  # the same: the kernel for a C-contiguous input, NumPy otherwise
        g.node("Softmax", [v], s, axis=-1)
    elif kind == "cap":
        c = g.const(np.array([rng.uniform(1.0, 5.0)], np.float32))
        d = g.node("Div", [v, c], s)
        t = g.node("Tanh", [d], s)
        g.node("Mul", [t, c] if rng.random() < 0.5 else [c, t], s)
    else:
        g.node("Transpose", [v], (s[0], s[2], s[1], s[3]), perm=[0, 2, 1, 3])
    return kind


def _model(rng: np.random.Generator) -> tuple[onnx.ModelProto, int, int]:
    heads, head = int(rng.integers(1, 4)), int(rng.choice([4, 6, 8]))
    g = _Graph(rng)
    w = g.const(rng.standard_normal((8, heads * head)).astype(np.float32))
    p = g.node("MatMul", ["inp", w], (1, 1, heads * head))
    r = g.node("Reshape", [p, g.const(np.array([1, 1, heads, head], np.int64))], (1, 1, heads, head))
    g.node("Transpose", [r], (1, heads, 1, head), perm=[0, 2, 1, 3])
    g.shapes["side"] = (1, heads, 1, head)
    for _ in range(int(rng.integers(3, 10))):
        _grow(g)
    made = [n.output[0] for n in g.nodes]
    outputs = sorted({made[-1], made[-2], str(rng.choice(made))})
    inputs = [
        helper.make_tensor_value_info("inp", TensorProto.FLOAT, [1, 1, 8]),
        helper.make_tensor_value_info("side", TensorProto.FLOAT, [1, heads, 1, head]),
    ]
    graph = helper.make_graph(
        g.nodes, "fuzz", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], g.inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), heads, head


def test_compiled_steps_equal_the_node_by_node_runs_on_random_graphs():
    rng = np.random.default_rng(2026)
    compiled = 0
    for iteration in range(examples(60)):
        model, heads, head = _model(rng)
        threads = int(rng.integers(1, 3))
        try:
            sess = onnxkv.Session(model, threads=threads)
        except onnxkv.OnnxkvError:
            continue
        plain = onnxkv.Session(model, threads=threads, compiled_steps=False)
        for run in range(4):
            feeds = {
                "inp": rng.standard_normal((1, 1, 8)).astype(np.float32),
                "side": rng.standard_normal((1, heads, 1, head)).astype(np.float32) * 4,
            }
            context = f"iteration {iteration}, run {run}: {[n.op_type for n in model.graph.node]}"
            assert_same_outcome(outcome(sess, feeds), outcome(plain, feeds), context)
        steps = sess.plan.steps.idle if sess.plan.steps else []
        compiled += any(isinstance(item, Segment) for step in steps for item in step.items)
    assert compiled >= examples(60) // 2  # most graphs replay segments: the comparison is not vacuous
