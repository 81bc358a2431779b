"""MatMul with an initializer weight: packed once at build time, same results as np.matmul."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxkv
from onnxkv import Session
from onnxkv.plan.ops import matmul as matmul_op
from onnxkv.plan.ops.matmul import STEP_M, MatMul

F = np.float32


def weight_model(w: np.ndarray, x_rank: int = 2) -> onnx.ModelProto:
    """y = MatMul(x, w) with w an initializer and x of rank x_rank (last dim symbolic)."""
    dims = ["B", "S", "K"][-x_rank:]
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def matmul_kernel(session: Session) -> MatMul:
    (kernel,) = [k for k in session.plan.kernels if isinstance(k, MatMul)]
    return kernel


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("Kd,N", [(64, 100), (33, 16), (100, 7)])
def test_initializer_weight_is_packed(Kd, N, threads):
    rng = np.random.default_rng([Kd, N])
    w = rng.standard_normal((Kd, N)).astype(F)
    session = Session(weight_model(w), threads=threads)
    kernel = matmul_kernel(session)
    assert kernel.packed is not None and kernel.packed.shape == (-(-N // 16), Kd, 16)
    for M in [*range(1, 17), 17, 40, STEP_M + 1]:
        x = rng.standard_normal((M, Kd)).astype(F)
        got = session.run({"x": x})["y"]
        assert got.shape == (M, N) and got.dtype == F
        np.testing.assert_allclose(got, np.matmul(x.astype(np.float64), w), rtol=1e-5, atol=1e-4)


def test_batched_and_vector_inputs():
    """Leading batch dims are flattened into rows; a 1-D input gives a 1-D result."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((24, 40)).astype(F)
    x3 = rng.standard_normal((3, 5, 24)).astype(F)
    got = Session(weight_model(w, x_rank=3), threads=1).run({"x": x3})["y"]
    np.testing.assert_allclose(got, np.matmul(x3, w), rtol=1e-5, atol=1e-5)
    x1 = rng.standard_normal(24).astype(F)
    got = Session(weight_model(w, x_rank=1), threads=1).run({"x": x1})["y"]
    assert got.shape == (40,)
    np.testing.assert_allclose(got, np.matmul(x1, w), rtol=1e-5, atol=1e-5)


def test_bad_rows_still_raise():
    w = np.random.default_rng(6).standard_normal((8, 4)).astype(F)
    session = Session(weight_model(w), threads=1)
    with pytest.raises(onnxkv.errors.OperatorError, match=r"shapes \(2, 9\) and \(8, 4\) do not align"):
        session.run({"x": np.ones((2, 9), F)})


def test_external_weight_packed_from_memmap(tmp_path):
    """A weight mapped from external data is packed; results match np.matmul."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((300, 70)).astype(F)
    path = tmp_path / "m.onnx"
    onnx.save(weight_model(w), str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    model = onnxkv.load(path)
    session = Session(model, threads=1)
    assert matmul_kernel(session).packed is not None
    for M in (1, 4, 16):
        x = rng.standard_normal((M, 300)).astype(F)
        np.testing.assert_allclose(session.run({"x": x})["y"], np.matmul(x.astype(np.float64), w), rtol=1e-5, atol=1e-4)


def test_many_rows_run_the_packed_kernel(monkeypatch):
    """Above STEP_M rows (a prompt chunk) the product is the packed kernel's too: NumPy's BLAS is never
    called."""
    rng = np.random.default_rng(8)
    w = rng.standard_normal((40, 100)).astype(F)
    session = Session(weight_model(w), threads=2)
    calls = []
    real = matmul_op.matmul_packed
    monkeypatch.setattr(matmul_op, "matmul_packed", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(matmul_op.np, "matmul", lambda *a, **k: pytest.fail("NumPy's matmul was called"))
    x = rng.standard_normal((STEP_M + 3, 40)).astype(F)
    got = session.run({"x": x})["y"]
    monkeypatch.undo()
    np.testing.assert_allclose(got, np.matmul(x.astype(np.float64), w), rtol=1e-5, atol=1e-4)
    assert calls == [(STEP_M + 3, 40)]


def test_plan_drops_its_copy_of_an_absorbed_weight():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 24)).astype(F)
    session = Session(weight_model(w), threads=1)
    plan = session.plan
    assert plan._template[plan.slot_of["w"]] is None  # only the packed copy remains
    x = rng.standard_normal((3, 32)).astype(F)
    np.testing.assert_allclose(session.run({"x": x})["y"], x @ w, rtol=1e-5, atol=1e-5)
    with pytest.raises(onnxkv.OperatorError, match="do not align"):
        session.run({"x": rng.standard_normal((3, 31)).astype(F)})


def test_a_weight_read_elsewhere_is_kept():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 8)).astype(F)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("Add", ["y", "w"], ["z"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), threads=1)
    assert session.plan._template[session.plan.slot_of["w"]] is not None
    x = rng.standard_normal((8, 8)).astype(F)
    np.testing.assert_allclose(session.run({"x": x})["z"], x @ w + w, rtol=1e-5, atol=1e-5)


def float16_model(w: np.ndarray, x_rank: int = 2) -> onnx.ModelProto:
    """weight_model with float16 x, weight and y (as every MatMul of a float16 model)."""
    model = weight_model(w, x_rank)
    for vi in (*model.graph.input, *model.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("Kd,N", [(64, 100), (33, 16), (300, 7)])
def test_float16_weight_is_packed_as_float16_with_onnxruntimes_result(Kd, N, threads):
    """A float16 initializer is packed in float16 (half the bytes); Y is the float32 product of the float16
    operands rounded once to float16, as ONNX Runtime's CPU MatMul gives it."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng([Kd, N, 16])
    w = rng.standard_normal((Kd, N)).astype(np.float16)
    model = float16_model(w, x_rank=3)
    session = Session(model, threads=threads)
    kernel = matmul_kernel(session)
    assert kernel.packed.dtype == np.float16 and kernel.packed.shape == (-(-N // 16), Kd, 16)
    assert session.run({"x": rng.standard_normal((1, 1, Kd)).astype(np.float16)})["y"].dtype == np.float16
    peer = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for M in (1, 3, 17, STEP_M + 1):
        x = rng.standard_normal((2, M, Kd)).astype(np.float16)
        got = session.run({"x": x})["y"]
        want = (x.astype(np.float64) @ w.astype(np.float64)).astype(np.float32).astype(np.float16)
        assert got.dtype == np.float16 and got.shape == (2, M, N)
        # float32 sums in another order than float64's: at most one float16 step apart
        np.testing.assert_array_less(np.abs(got.astype(np.float64) - want), np.abs(want) * 2.0**-10 + 1e-6)
        np.testing.assert_allclose(
            got.astype(np.float32), peer.run(None, {"x": x})[0].astype(np.float32), rtol=2e-3, atol=1e-3
        )


def test_float16_product_refuses_float32_rows():
    w = np.ones((8, 4), np.float16)
    session = Session(float16_model(w), threads=1)
    with pytest.raises(onnxkv.InputError, match="float16"):
        session.run({"x": np.ones((2, 8), F)})


@pytest.mark.parametrize("shapes", [((5, 32), (32, 7)), ((2, 3, 9, 16), (2, 3, 16, 11)), ((4, 8), (2, 8, 3))])
def test_float16_run_time_weights_sum_in_float32_through_blas(shapes):
    """float16 A and B both fed: float32 sums rounded once to float16 (NumPy's float16 matmul has no BLAS),
    within a float16 step of the float64 product."""
    rng = np.random.default_rng(len(shapes[0]) * 10 + shapes[1][-1])
    a, b = (rng.standard_normal(s).astype(np.float16) for s in shapes)
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
    )
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), threads=1)
    got = session.run({"a": a, "b": b})["y"]
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert got.dtype == np.float16 and got.shape == want.shape
    np.testing.assert_array_less(np.abs(got - want), np.abs(want) * 2.0**-10 + 1e-6)
