"""Plan fusions of com.microsoft::MatMulNBits: siblings sharing A become one SiblingMatMulNBits, and an
RMS norm or SiluMul before them joins them in a PrologueMatMul; outputs bit for bit those of the separate
nodes, and ONNX Runtime's within the int8 tolerance."""

from __future__ import annotations

import numpy as np
import pytest
from nbits_weights import make_weight
from onnx import TensorProto, helper, numpy_helper

from onnxkv import Session
from onnxkv import _kernels as K
from onnxkv.alloc import SystemAllocator
from onnxkv.errors import ModelError
from onnxkv.plan.ops.matmul_nbits import MatMulNBits, SiblingMatMulNBits
from onnxkv.plan.ops.prologue_matmul import PrologueMatMul
from onnxkv.plan.plan import Plan

ort = pytest.importorskip("onnxruntime")


MEMBERS = ((64, 32, False), (24, 32, True), (24, 32, False), (40, 64, False))
#: The second member 32 wide: every fused output starts on a panel (16 columns), the last ends inside one.
ALIGNED = ((64, 32, False), (32, 32, True), (24, 32, False), (40, 64, False))


def sibling_model(level=4, norm=False, members=MEMBERS):
    """Four MatMulNBits reading x (or, with ``norm``, an RMS norm of x): three of one layout (q/k/v-like:
    different N, one with a bias, uint8 zero points) that fuse, and one of another block size that does not
    (``members``: N, block size and bias of each)."""
    rng = np.random.default_rng(11)
    K, nodes, inits, outs = 128, [], [], []
    a = "x"
    if norm:
        a = "h"
        inits.append(numpy_helper.from_array((1 + 0.1 * rng.standard_normal(K)).astype(np.float32), "gamma"))
        nodes.append(
            helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["h"], name="norm", epsilon=1e-5, axis=-1)
        )
    for i, (N, bs, bias) in enumerate(members):
        B, s, z = make_weight(rng, K, N, 4, bs, "uint8")
        names = [f"B{i}", f"s{i}", f"z{i}"] + ([f"b{i}"] if bias else [])
        inits += [
            numpy_helper.from_array(B, f"B{i}"),
            numpy_helper.from_array(s, f"s{i}"),
            numpy_helper.from_array(z, f"z{i}"),
        ]
        if bias:
            names = [f"B{i}", f"s{i}", f"z{i}", "", f"b{i}"]
            inits.append(numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), f"b{i}"))
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                [a, *names],
                [f"y{i}"],
                name=f"m{i}",
                domain="com.microsoft",
                K=K,
                N=N,
                bits=4,
                block_size=bs,
                accuracy_level=level,
            )
        )
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])], outs, inits
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )


def _products(plan):
    """The MatMulNBits-family kernels of a plan, also inside PrologueMatMul nodes."""
    return [
        k.product if isinstance(k, PrologueMatMul) else k
        for k in plan.kernels
        if isinstance(k, (MatMulNBits, PrologueMatMul))
    ]


@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("members", [MEMBERS, ALIGNED], ids=["copies", "per-output"])
def test_siblings_fuse_into_one_product(level, norm, members):
    """Outputs equal the separate nodes' bit for bit at 1 row (views of one product) and at several: copies
    of the one product's columns, or with every output on a panel boundary one product per output."""
    model = sibling_model(level, norm, members)
    s = Session(model, threads=2)
    fused = [k for k in _products(s.plan) if isinstance(k, SiblingMatMulNBits)]
    n0, n1 = members[0][0], members[0][0] + members[1][0]
    assert len(fused) == 1 and fused[0].bounds == [(0, n0), (n0, n1), (n1, n1 + 24)]
    assert (fused[0].members is not None) == (members is ALIGNED)
    assert sum(type(k) is MatMulNBits for k in _products(s.plan)) == 1
    # with a norm before them, the norm joins the sibling product (the other reader keeps the norm's output)
    assert sum(isinstance(k, PrologueMatMul) for k in s.plan.kernels) == 0
    unfused = Plan(model, SystemAllocator(), fuse=False)
    assert not any(isinstance(k, SiblingMatMulNBits) for k in unfused.kernels)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for rows in (1, 4, 20, 70):
        x = np.random.default_rng(rows).standard_normal((1, rows, 128)).astype(np.float32)
        got = s.run({"x": x})
        h = x
        if norm:  # the norm node's own kernel
            gamma = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "gamma"))
            h = np.empty_like(x)
            K.rms_norm(x.reshape(rows, 128), gamma, 1e-5, h.reshape(rows, 128))
        want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
        for name in want:
            # one product per weight or one for all: the same arithmetic per column, bit for bit
            ref = np.empty_like(got[name])
            node = next(k for k in unfused.kernels if isinstance(k, MatMulNBits) and k.node.output[0] == name)
            bias = next(
                (
                    numpy_helper.to_array(i)
                    for i in model.graph.initializer
                    if len(node.node.input) > 5 and i.name == node.node.input[5]
                ),
                None,
            )
            ref[...] = node._product(h, bias, None, None).reshape(ref.shape)
            np.testing.assert_array_equal(got[name], ref)
            tol = 2e-2 if level == 4 else 1e-4
            np.testing.assert_allclose(got[name], want[name], rtol=tol, atol=tol * np.abs(want[name]).max())


def prologue_model(level=4):
    """x -> SkipSimplifiedLayerNormalization(x, skip) -> MatMulNBits (no bias) -> y, and the sum output read."""
    rng = np.random.default_rng(21)
    K, N = 96, 80
    B, s, z = make_weight(rng, K, N, 4, 32, "none")
    inits = [
        numpy_helper.from_array(B, "B"),
        numpy_helper.from_array(s, "s"),
        numpy_helper.from_array((1 + 0.1 * rng.standard_normal(K)).astype(np.float32), "gamma"),
    ]
    nodes = [
        helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "skip", "gamma"],
            ["h", "", "", "sum"],
            name="norm",
            domain="com.microsoft",
            epsilon=1e-5,
        ),
        helper.make_node(
            "MatMulNBits",
            ["h", "B", "s"],
            ["y"],
            name="mm",
            domain="com.microsoft",
            K=K,
            N=N,
            bits=4,
            block_size=32,
            accuracy_level=level,
        ),
    ]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", f, ["B", "S", K]), helper.make_tensor_value_info("skip", f, ["B", "S", K])],
        [helper.make_tensor_value_info("y", f, None), helper.make_tensor_value_info("sum", f, None)],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )


@pytest.mark.parametrize("level", [0, 4])
def test_norm_joins_the_quantized_product(level):
    model = prologue_model(level)
    s = Session(model, threads=2)
    (k,) = [k for k in s.plan.kernels if isinstance(k, PrologueMatMul)]
    assert isinstance(k.product, MatMulNBits) and len(s.plan.kernels) == 1
    unfused = Session(model, threads=2)
    unfused.plan = Plan(model, SystemAllocator(), fuse=False)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for rows in (1, 5, 12):
        feeds = {n: rng.standard_normal((1, rows, 96)).astype(np.float32) for n in ("x", "skip")}
        got, ref = s.run(feeds), unfused.plan.run(feeds)
        want = dict(zip(["y", "sum"], sess.run(["y", "sum"], feeds)))
        for name in ("y", "sum"):
            np.testing.assert_array_equal(got[name], ref[name])
            tol = 2e-2 if level == 4 and name == "y" else 1e-5
            np.testing.assert_allclose(got[name], want[name], rtol=tol, atol=tol * np.abs(want[name]).max())


def test_a_sibling_of_the_wrong_layout_is_not_fused_and_names_itself():
    """A member whose B has the right size but not its shape stays alone, so its load error names it and
    its B, not the group's first member and a NumPy message."""
    model = sibling_model()
    (b1,) = [i for i in model.graph.initializer if i.name == "B1"]
    B = numpy_helper.to_array(b1)
    b1.CopyFrom(numpy_helper.from_array(B.reshape(B.shape[0] // 2, B.shape[1] * 2, B.shape[2]), "B1"))
    with pytest.raises(ModelError, match=r"MatMulNBits node 'm1': B: expected shape \[N=24, 4 blocks, 16 bytes\]"):
        Session(model)
