"""If, Loop and Scan: ONNX's node tests, semantics against ONNX Runtime, captures, and the errors they raise."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper
from onnx.backend.test.runner import Runner

from onnxkv import Session
from onnxkv.alloc import SystemAllocator
from onnxkv.errors import InputError, ModelError, OperatorError
from onnxkv.model.scopes import subgraphs
from onnxkv.plan.ops.control_flow import If
from onnxkv.plan.plan import Plan
from onnxkv.plan.registry import BuildContext

CONTROL_FLOW = {"If", "Loop", "Scan"}

#: Node tests whose values are sequences or optionals, which onnxkv does not run: the error each must raise.
NOT_TENSORS = {
    "test_if_seq": r"If node .*'then_branch': subgraph output 'then_out' is a sequence; onnxkv runs tensor values",
    "test_if_opt": r"If node .*'then_branch': subgraph output 'optional_empty' is an optional; onnxkv runs tensor",
    "test_loop13_seq": r"graph input 'seq_empty' is a sequence; onnxkv runs tensor values only",
    "test_loop16_seq_none": r"graph input 'opt_seq' is an optional; onnxkv runs tensor values only",
    **{
        f"test_sequence_map_{case}_expanded": rf"graph input '{name}' is a sequence; onnxkv runs tensor values only"
        for case, name in (
            ("identity_1_sequence", "x"),
            ("identity_2_sequences", "x0"),
            ("identity_1_sequence_1_tensor", "x0"),
            ("add_2_sequences", "x0"),
            ("add_1_sequence_1_tensor", "x0"),
            ("extract_shapes", "in_seq"),
        )
    },
}


def _uses_control_flow(graph: onnx.GraphProto) -> bool:
    return any(n.op_type in CONTROL_FLOW or any(_uses_control_flow(g) for g in subgraphs(n)) for n in graph.node)


def _node_tests() -> list:
    import onnx.backend.test.case.node as node_tests

    with warnings.catch_warnings():  # building some cases casts out-of-range values on purpose
        warnings.simplefilter("ignore")
        cases = node_tests.collect_testcases()
    return sorted((c for c in cases if c.model is not None and _uses_control_flow(c.model.graph)), key=lambda c: c.name)


NODE_TESTS = _node_tests()


def test_the_node_tests_include_every_control_flow_operator():
    names = {c.name for c in NODE_TESTS}
    assert {"test_if", "test_loop11", "test_scan_sum", "test_scan9_sum"} <= names
    assert set(NOT_TENSORS) <= names


def _array(value) -> np.ndarray:
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)


@pytest.mark.parametrize("case", NODE_TESTS, ids=lambda c: c.name)
def test_onnx_node_test(case):
    """Every ONNX backend node test with an If, Loop or Scan (at any depth) runs like the backend runner checks it."""
    if case.name in NOT_TENSORS:
        with pytest.raises(ModelError, match=NOT_TENSORS[case.name]):
            Session(case.model, threads=1)
        return
    session = Session(case.model, threads=1)
    names = [vi.name for vi in case.model.graph.input]
    for inputs, expected in case.data_sets:
        outputs = session.run(dict(zip(names, map(_array, inputs))))
        got = [outputs[vi.name] for vi in case.model.graph.output]
        Runner.assert_similar_outputs([_array(e) for e in expected], got, rtol=case.rtol, atol=case.atol)


# -- helpers ----------------------------------------------------------------------------------------------


def _vi(name: str, elem: int = T.FLOAT, shape=None) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, initializers=(), opset: int = 17) -> onnx.ModelProto:
    graph = h.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=8 if opset > 8 else 7)


def _both(model: onnx.ModelProto, feeds: dict) -> tuple[dict, dict]:
    """(onnxkv outputs, ONNX Runtime outputs) for ``feeds``."""
    ours = Session(model, threads=1).run(feeds)
    peer = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return ours, dict(zip(names, peer.run(names, feeds)))


def _assert_same(model: onnx.ModelProto, feeds: dict) -> dict:
    ours, theirs = _both(model, feeds)
    for name, want in theirs.items():
        assert ours[name].dtype == want.dtype and ours[name].shape == want.shape, (name, ours[name], want)
        np.testing.assert_allclose(ours[name], want, rtol=1e-6, atol=1e-6, err_msg=name)
    return ours


def _loop_body(nodes, carried, scans=(), cond_out="cond_in") -> onnx.GraphProto:
    """A Loop body with inputs (i, cond_in, carried...) and outputs (cond_out, carried outputs..., scans...)."""
    inputs = [_vi("i", T.INT64, []), _vi("cond_in", T.BOOL, [])] + [_vi(f"{c}_in", T.FLOAT) for c in carried]
    outputs = [_vi(cond_out, T.BOOL, [])] + [_vi(f"{c}_out", T.FLOAT) for c in carried] + list(scans)
    return h.make_graph(nodes, "body", inputs, outputs)


# -- If -----------------------------------------------------------------------------------------------


def test_if_runs_the_chosen_branch_over_captured_outer_values():
    then_branch = h.make_graph(
        [h.make_node("Mul", ["t", "x"], ["prod"]), h.make_node("Identity", ["t"], ["same"])],
        "then",
        [],
        [_vi("prod"), _vi("same")],
    )
    else_branch = h.make_graph(
        [h.make_node("Concat", ["x", "x"], ["both"], axis=0), h.make_node("Neg", ["t"], ["neg"])],
        "else",
        [],
        [_vi("both"), _vi("neg")],
    )
    nodes = [
        h.make_node("Add", ["x", "x"], ["t"]),
        h.make_node("If", ["c"], ["a", "b"], name="pick", then_branch=then_branch, else_branch=else_branch),
        h.make_node("Sub", ["x", "x"], ["z"]),
    ]
    model = _model(nodes, [_vi("c", T.BOOL, []), _vi("x", T.FLOAT, [3])], [_vi("a"), _vi("b"), _vi("z")])
    x = np.array([1, 2, 3], np.float32)
    for c in (True, False):
        out = _assert_same(model, {"c": np.array(c), "x": x})
        assert out["a"].shape == ((3,) if c else (6,))  # the branches' shapes differ
    kernel = Session(model).plan.kernels[1]
    assert isinstance(kernel, If) and kernel.captures == ("t", "x")


def test_a_branch_returning_an_outer_value_keeps_its_buffer_alive_past_the_if():
    """The If output is the captured 't': 't' must not go back to the run's buffers after the If (views count).

    (ONNX Runtime rejects a subgraph output that names an outer value; ONNX allows it.)
    """
    branch = h.make_graph([], "b", [], [_vi("t")])
    nodes = [
        h.make_node("Mul", ["x", "two"], ["t"]),
        h.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch),
        h.make_node("Neg", ["x"], ["n"]),
        h.make_node("Add", ["n", "n"], ["z"]),
    ]
    two = numpy_helper.from_array(np.array(2, np.float32), "two")
    model = _model(nodes, [_vi("c", T.BOOL, []), _vi("x", T.FLOAT, [64])], [_vi("y"), _vi("z")], [two])
    session = Session(model, threads=1)
    x = np.arange(64, dtype=np.float32)
    for _ in range(3):
        out = session.run({"c": np.array(True), "x": x})
        np.testing.assert_array_equal(out["y"], 2 * x)
        np.testing.assert_array_equal(out["z"], -2 * x)


def test_a_value_only_a_subgraph_reads_lives_until_the_node_runs():
    branch = h.make_graph([h.make_node("Add", ["t", "t"], ["u"])], "b", [], [_vi("u")])
    nodes = [
        h.make_node("Neg", ["x"], ["t"]),
        h.make_node("Abs", ["x"], ["a"]),
        h.make_node("Mul", ["a", "a"], ["m"]),
        h.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch),
    ]
    model = _model(nodes, [_vi("c", T.BOOL, []), _vi("x", T.FLOAT, [16])], [_vi("y"), _vi("m")])
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    np.testing.assert_array_equal(Session(model, threads=1).run({"c": np.array(False), "x": x})["y"], -2 * x)


def test_constants_a_branch_reads_are_folded_into_its_plan_and_defaults_a_feed_may_override_are_not():
    branch = h.make_graph(
        [h.make_node("Mul", ["w", "w"], ["w2"]), h.make_node("Add", ["w2", "d"], ["y"])], "b", [], [_vi("y")]
    )
    w = numpy_helper.from_array(np.array([3, 4], np.float32), "w")
    d = numpy_helper.from_array(np.array([1, 1], np.float32), "d")
    node = h.make_node("If", ["c"], ["y"], name="pick", then_branch=branch, else_branch=branch)
    model = _model([node], [_vi("c", T.BOOL, []), _vi("d", T.FLOAT, [2])], [_vi("y")], [w, d])
    session = Session(model, threads=1)
    kernel = session.plan.kernels[0]
    assert kernel.captures == ("d",)  # 'w' is a constant of the branch's plan; 'd' is an input with a default
    assert kernel.then_plan.folded_nodes == 1  # w * w
    np.testing.assert_array_equal(session.run({"c": np.array(True)})["y"], [10, 17])
    np.testing.assert_array_equal(session.run({"c": np.array(True), "d": np.array([0, 2], np.float32)})["y"], [9, 18])


@pytest.mark.parametrize(
    "cond, message",
    [
        (
            np.array(1, np.int64),
            r"If node 'pick': cond 'c' must be a tensor of one bool element, got int64 of shape \(\)",
        ),
        (
            np.array([True, False]),
            r"If node 'pick': cond 'c' must be a tensor of one bool element, got bool of "
            r"shape \(2,\)",
        ),
    ],
)
def test_if_rejects_a_condition_that_is_no_single_bool(cond, message):
    branch = h.make_graph([h.make_node("Identity", ["x"], ["y"])], "b", [], [_vi("y")])
    node = h.make_node("If", ["c"], ["y"], name="pick", then_branch=branch, else_branch=branch)
    model = _model(
        [node], [_vi("c", T.INT64 if cond.dtype != bool else T.BOOL, None), _vi("x", T.FLOAT, [1])], [_vi("y")]
    )
    with pytest.raises(InputError, match=message):
        Session(model).run({"c": cond, "x": np.ones(1, np.float32)})


def test_if_accepts_a_one_element_condition_of_rank_one():
    then_branch = h.make_graph([h.make_node("Neg", ["x"], ["y"])], "t", [], [_vi("y")])
    else_branch = h.make_graph([h.make_node("Abs", ["x"], ["y2"])], "e", [], [_vi("y2")])
    node = h.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)
    model = _model([node], [_vi("c", T.BOOL, [1]), _vi("x", T.FLOAT, [2])], [_vi("y")])
    _assert_same(model, {"c": np.array([True]), "x": np.array([1, -2], np.float32)})


def test_if_branches_with_other_output_counts_are_a_model_error():
    then_branch = h.make_graph([h.make_node("Neg", ["x"], ["y"])], "t", [], [_vi("y")])
    else_branch = h.make_graph(
        [h.make_node("Neg", ["x"], ["y2"]), h.make_node("Abs", ["x"], ["y3"])], "e", [], [_vi("y2"), _vi("y3")]
    )
    node = h.make_node("If", ["c"], ["y"], name="pick", then_branch=then_branch, else_branch=else_branch)
    with pytest.raises(ModelError, match=r"If node 'pick': has 1 outputs but its else_branch has 2"):
        Session(_model([node], [_vi("c", T.BOOL, []), _vi("x", T.FLOAT, [2])], [_vi("y")]))


def test_a_failing_branch_node_names_the_if_the_branch_and_the_node():
    branch = h.make_graph([h.make_node("Reshape", ["x", "shape"], ["y"], name="bad_reshape")], "b", [], [_vi("y")])
    node = h.make_node("If", ["c"], ["y"], name="pick", then_branch=branch, else_branch=branch)
    model = _model([node], [_vi("c", T.BOOL, []), _vi("x", T.FLOAT, [4]), _vi("shape", T.INT64, [1])], [_vi("y")])
    with pytest.raises(OperatorError, match=r"If node 'pick', else_branch: Reshape node 'bad_reshape' failed"):
        Session(model).run({"c": np.array(False), "x": np.ones(4, np.float32), "shape": np.array([3])})


def test_a_subgraph_writing_a_captured_value_in_place_is_a_model_error():
    update = h.make_node("CacheUpdate", ["cache", "new", "pos"], ["updated"], name="write", domain="ai.onnxkv")
    branch = h.make_graph([update], "b", [], [_vi("updated")])
    node = h.make_node("If", ["c"], ["y"], name="pick", then_branch=branch, else_branch=branch)
    model = _model(
        [node],
        [
            _vi("c", T.BOOL, []),
            _vi("cache", T.FLOAT, [1, 1, 4, 2]),
            _vi("new", T.FLOAT, [1, 1, 1, 2]),
            _vi("pos", T.INT64, []),
        ],
        [_vi("y")],
    )
    model.opset_import.append(h.make_opsetid("ai.onnxkv", 1))
    with pytest.raises(
        ModelError,
        match=r"CacheUpdate node 'write' writes 'cache' in place \(MUST_ALIAS\) inside a "
        r"subgraph, but that value comes from outside it",
    ):
        Session(model)


# -- Loop -----------------------------------------------------------------------------------------------


def _counting_loop(m: str, cond: str, opset: int = 17) -> onnx.ModelProto:
    """y += 1 per iteration, scan output y * i; cond_out = max(y) < limit."""
    body = _loop_body(
        [
            h.make_node("Add", ["y_in", "one"], ["y_out"]),
            h.make_node("Cast", ["i"], ["fi"], to=T.FLOAT),
            h.make_node("Mul", ["y_out", "fi"], ["scan"]),
            h.make_node("ReduceMax", ["y_out"], ["top"], keepdims=0),
            h.make_node("Less", ["top", "limit"], ["cond_out"]),
        ],
        ["y"],
        [_vi("scan", T.FLOAT, [2])],
        cond_out="cond_out",
    )
    one = numpy_helper.from_array(np.ones(2, np.float32), "one")
    limit = numpy_helper.from_array(np.array(5, np.float32), "limit")
    node = h.make_node("Loop", [m, cond, "y0"], ["y", "scans"], name="loop", body=body)
    inputs = [_vi("y0", T.FLOAT, [2])] + ([_vi(m, T.INT64, [])] if m else [])
    inputs += [_vi(cond, T.BOOL, [])] if cond else []
    return _model([node], inputs, [_vi("y"), _vi("scans")], [one, limit], opset)


@pytest.mark.parametrize(
    "m, cond",
    [(3, None), (10, None), (None, None), (None, True), (None, False), (10, True), (2, True), (0, True), (-4, None)],
)
def test_loop_trip_count_and_condition_follow_onnx_runtime(m, cond):
    model = _counting_loop("M" if m is not None else "", "c" if cond is not None else "")
    feeds = {"y0": np.array([0, 1], np.float32)}
    if m is not None:
        feeds["M"] = np.array(m, np.int64)
    if cond is not None:
        feeds["c"] = np.array(cond)
    _assert_same(model, feeds)


def test_a_loop_of_zero_iterations_gives_its_inputs_and_empty_scan_outputs_of_the_declared_shape():
    out = _assert_same(_counting_loop("M", ""), {"y0": np.array([7, 8], np.float32), "M": np.array(0, np.int64)})
    assert out["scans"].shape == (0, 2) and out["scans"].dtype == np.float32


def test_loop_carried_values_may_change_shape_and_bodies_capture_outer_values_through_nested_ifs():
    then_branch = h.make_graph([h.make_node("Add", ["acc_in", "x"], ["grown"])], "t", [], [_vi("grown")])
    else_branch = h.make_graph([h.make_node("Sub", ["acc_in", "x"], ["shrunk"])], "e", [], [_vi("shrunk")])
    body = _loop_body(
        [
            h.make_node("Concat", ["acc_in", "acc_in"], ["acc_out"], axis=0),
            h.make_node("Mod", ["i", "two"], ["parity"]),
            h.make_node("Equal", ["parity", "zero"], ["even"]),
            h.make_node("If", ["even"], ["mixed"], then_branch=then_branch, else_branch=else_branch),
            h.make_node("ReduceSum", ["mixed"], ["total"], keepdims=0),
        ],
        ["acc"],
        [_vi("total", T.FLOAT, [])],
    )
    consts = [
        numpy_helper.from_array(np.array(2, np.int64), "two"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
    ]
    node = h.make_node("Loop", ["M", "", "acc0"], ["acc", "totals"], body=body)
    model = _model(
        [node],
        [_vi("M", T.INT64, []), _vi("acc0", T.FLOAT, [1]), _vi("x", T.FLOAT, [1])],
        [_vi("acc"), _vi("totals")],
        consts,
    )
    out = _assert_same(
        model, {"M": np.array(4, np.int64), "acc0": np.array([1], np.float32), "x": np.array([0.5], np.float32)}
    )
    assert out["acc"].shape == (16,) and out["totals"].shape == (4,)


@pytest.mark.parametrize(
    "feeds, message",
    [
        (
            {"M": np.array(2.0, np.float32)},
            r"Loop node 'loop': trip count M 'M' must be a tensor of one int64 element, "
            r"got float32 of shape \(\)",
        ),
        (
            {"M": np.array([1, 2], np.int64)},
            r"trip count M 'M' must be a tensor of one int64 element, got int64 of shape",
        ),
        (
            {"c": np.array([1], np.int32)},
            r"Loop node 'loop': condition 'c' must be a tensor of one bool element, "
            r"got int32",
        ),
        (
            {"y0": np.zeros(2, np.float64)},
            r"Loop node 'loop': loop-carried input 'y0' is float64, but the body input "
            r"'y_in' it feeds is float32",
        ),
    ],
)
def test_loop_rejects_fed_values_naming_the_node_the_value_and_what_it_expected(feeds, message):
    model = _counting_loop("M", "c")
    for vi in model.graph.input:  # let the plan take the wrong types so the Loop sees them
        vi.type.tensor_type.ClearField("shape")
    full = {"M": np.array(3, np.int64), "c": np.array(True), "y0": np.zeros(2, np.float32), **feeds}
    for vi in model.graph.input:
        vi.type.tensor_type.elem_type = onnx.helper.np_dtype_to_tensor_dtype(full[vi.name].dtype)
    with pytest.raises(InputError, match=message):
        Session(model).run(full)


def test_a_body_condition_that_is_no_single_bool_is_an_operator_error():
    body = _loop_body(
        [
            h.make_node("Identity", ["y_in"], ["y_out"]),
            h.make_node("Cast", ["i"], ["flag"], to=T.BOOL),
            h.make_node("Unsqueeze", ["flag", "axis"], ["row"]),
            h.make_node("Concat", ["row", "row"], ["two"], axis=0),
        ],
        ["y"],
        cond_out="two",
    )
    body.output[0].type.tensor_type.ClearField("shape")
    body.initializer.append(numpy_helper.from_array(np.array([0], np.int64), "axis"))
    node = h.make_node("Loop", ["", "c", "y0"], ["y"], name="loop", body=body)
    model = _model([node], [_vi("c", T.BOOL, []), _vi("y0", T.FLOAT, [1])], [_vi("y")])
    with pytest.raises(
        OperatorError,
        match=r"Loop node 'loop': iteration 0: body output 'two' must be a tensor of "
        r"one bool element, got bool of shape \(2,\)",
    ):
        Session(model).run({"c": np.array(True), "y0": np.ones(1, np.float32)})


def test_a_scan_output_changing_shape_between_iterations_is_an_operator_error():
    body = _loop_body(
        [h.make_node("Concat", ["y_in", "y_in"], ["y_out"], axis=0), h.make_node("Identity", ["y_out"], ["s"])],
        ["y"],
        [_vi("s")],
    )
    node = h.make_node("Loop", ["M", "", "y0"], ["y", "s"], name="loop", body=body)
    model = _model([node], [_vi("M", T.INT64, []), _vi("y0", T.FLOAT, [1])], [_vi("y"), _vi("s")])
    with pytest.raises(
        OperatorError,
        match=r"Loop node 'loop', iteration 1: scan output 's' is float32 of shape "
        r"\(4,\), but the first iteration's was float32 of shape \(2,\)",
    ):
        Session(model).run({"M": np.array(3, np.int64), "y0": np.ones(1, np.float32)})


def test_a_failing_body_node_names_the_loop_the_iteration_and_the_node():
    body = _loop_body(
        [
            h.make_node("Sub", ["y_in", "one"], ["y_out"]),
            h.make_node("Reshape", ["y_out", "shape"], ["r"], name="bad_reshape"),
        ],
        ["y"],
        [_vi("r")],
    )
    body.initializer.extend(
        [
            numpy_helper.from_array(np.array([1], np.int64), "shape"),
            numpy_helper.from_array(np.array([0], np.float32), "one"),
        ]
    )
    node = h.make_node("Loop", ["M", "", "y0"], ["y", "r"], name="loop", body=body)
    model = _model([node], [_vi("M", T.INT64, []), _vi("y0", T.FLOAT, [2])], [_vi("y"), _vi("r")])
    with pytest.raises(OperatorError, match=r"Loop node 'loop', iteration 0: Reshape node 'bad_reshape' failed"):
        Session(model).run({"M": np.array(3, np.int64), "y0": np.ones(2, np.float32)})


def test_a_body_that_does_not_fit_the_loop_is_a_model_error():
    body = _loop_body([h.make_node("Identity", ["y_in"], ["y_out"])], ["y"])
    node = h.make_node("Loop", ["M", "", "y0", "y0"], ["y"], name="loop", body=body)
    model = _model([node], [_vi("M", T.INT64, []), _vi("y0", T.FLOAT, [1])], [_vi("y")])
    with pytest.raises(ModelError, match=r"Loop.*loop"):  # ONNX shape inference sees it first
        Session(model)
    with pytest.raises(
        ModelError,
        match=r"Loop node 'loop': has 4 inputs \(M, cond and 2 loop-carried values\), so "
        r"its body needs 4 inputs and at least 3 outputs; it has 3 and 2",
    ):
        Plan(model, SystemAllocator(), fold_shapes=False)


# -- Scan -------------------------------------------------------------------------------------------------


def _scan_model(opset: int, states: int, inputs: list[tuple], outputs: int, **attrs) -> onnx.ModelProto:
    """A Scan whose body adds every scan slice to each state and emits state * (k + 1) per scan output k.

    ``inputs`` are the scan inputs' declared shapes; slices must broadcast to the state shape [2].
    """
    body_nodes, total = [], "x0"
    for j in range(1, len(inputs)):
        body_nodes.append(h.make_node("Add", [total, f"x{j}"], [f"sum{j}"]))
        total = f"sum{j}"
    body_outputs = []
    for k in range(states):
        body_nodes.append(h.make_node("Add", [f"s{k}", total], [f"s{k}_out"]))
        body_outputs.append(_vi(f"s{k}_out", T.FLOAT, [2]))
    for k in range(outputs):
        body_nodes.append(h.make_node("Mul", ["s0_out" if states else total, f"c{k}"], [f"o{k}"]))
        body_outputs.append(_vi(f"o{k}", T.FLOAT, [2]))
    body = h.make_graph(
        body_nodes,
        "body",
        [_vi(f"s{k}", T.FLOAT, [2]) for k in range(states)] + [_vi(f"x{j}", T.FLOAT, [2]) for j in range(len(inputs))],
        body_outputs,
        [numpy_helper.from_array(np.array(k + 1, np.float32), f"c{k}") for k in range(outputs)],
    )
    lead = [""] if opset == 8 else []
    node = h.make_node(
        "Scan",
        lead + [f"init{k}" for k in range(states)] + [f"seq{j}" for j in range(len(inputs))],
        [f"final{k}" for k in range(states)] + [f"out{k}" for k in range(outputs)],
        name="scan",
        body=body,
        num_scan_inputs=len(inputs),
        **attrs,
    )
    graph_inputs = [_vi(f"init{k}", T.FLOAT, [1, 2] if opset == 8 else [2]) for k in range(states)] + [
        _vi(f"seq{j}", T.FLOAT, shape) for j, shape in enumerate(inputs)
    ]
    if opset == 8:
        graph_inputs.insert(0, _vi("lens", T.INT64, [1]))
        node.input[0] = "lens"
    return _model([node], graph_inputs, [_vi(o) for o in node.output], opset=opset)


@pytest.mark.parametrize(
    "axes, directions, out_axes, out_directions",
    [
        ([0, 0], [0, 0], [0, 0], [0, 0]),
        ([1, 0], [1, 0], [1, 0], [0, 1]),
        ([-2, 1], [0, 1], [-1, -2], [1, 1]),
    ],
)
def test_scan_axes_and_directions_follow_onnx_runtime(axes, directions, out_axes, out_directions):
    shapes = [[3, 2] if a % 2 == 0 else [2, 3] for a in axes]  # slices along the scan axis are [2]
    model = _scan_model(
        17,
        1,
        shapes,
        2,
        scan_input_axes=axes,
        scan_input_directions=directions,
        scan_output_axes=out_axes,
        scan_output_directions=out_directions,
    )
    rng = np.random.default_rng(0)
    feeds = {"init0": rng.standard_normal(2).astype(np.float32)}
    feeds.update({f"seq{j}": rng.standard_normal(s).astype(np.float32) for j, s in enumerate(shapes)})
    _assert_same(model, feeds)


def test_scan_without_states_and_a_scan_of_length_zero():
    model = _scan_model(17, 0, [[4, 2]], 1)
    _assert_same(model, {"seq0": np.arange(8, dtype=np.float32).reshape(4, 2)})
    empty = Session(_scan_model(17, 1, [["n", 2]], 1)).run(
        {"init0": np.ones(2, np.float32), "seq0": np.zeros((0, 2), np.float32)}
    )
    np.testing.assert_array_equal(empty["final0"], [1, 1])
    assert empty["out0"].shape == (0, 2)


@pytest.mark.parametrize("lens, directions", [(None, [0]), ([2], [0]), ([3], [1]), ([1], [1])])
def test_scan8_sequence_lengths_and_directions_follow_onnx_runtime(lens, directions):
    model = _scan_model(8, 1, [[1, 3, 2]], 1, directions=directions)
    feeds = {"init0": np.array([[1, -1]], np.float32), "seq0": np.arange(6, dtype=np.float32).reshape(1, 3, 2) + 1}
    if lens is None:
        model.graph.node[0].input[0] = ""
        del model.graph.input[0]
    else:
        feeds["lens"] = np.array(lens, np.int64)
    _assert_same(model, feeds)


def _batched_scan8() -> onnx.ModelProto:
    model = _scan_model(8, 1, [["b", 3, 2]], 1, directions=[1])
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "b"
    model.graph.input[1].type.tensor_type.shape.dim[0].dim_param = "b"
    return model


def test_scan8_runs_each_batch_row_over_its_own_length():
    x = np.arange(18, dtype=np.float32).reshape(3, 3, 2)
    _assert_same(
        _batched_scan8(), {"lens": np.array([3, 1, 2], np.int64), "init0": np.zeros((3, 2), np.float32), "seq0": x}
    )


def test_scan8_rows_of_length_zero_keep_their_state_and_give_zeros():
    """ONNX Runtime rejects a sequence length of zero; onnxkv scans nothing for that row."""
    init = np.array([[1, 2], [3, 4]], np.float32)
    x = np.arange(12, dtype=np.float32).reshape(2, 3, 2) + 1
    out = Session(_batched_scan8()).run({"lens": np.array([0, 1], np.int64), "init0": init, "seq0": x})
    np.testing.assert_array_equal(out["final0"], [[1, 2], [3 + 7, 4 + 8]])
    np.testing.assert_array_equal(out["out0"], [np.zeros((3, 2)), [[10, 12], [0, 0], [0, 0]]])


def test_scan_inputs_of_different_lengths_or_axes_outside_their_rank_are_input_errors():
    model = _scan_model(17, 1, [[3, 2], [None, 2]], 1)
    with pytest.raises(
        InputError,
        match=r"Scan node 'scan': scan input 'seq1' has length 4 along axis 0, but 'seq0' "
        r"has 3; every scan input needs the same length",
    ):
        Session(model).run(
            {
                "init0": np.zeros(2, np.float32),
                "seq0": np.zeros((3, 2), np.float32),
                "seq1": np.zeros((4, 2), np.float32),
            }
        )
    model = _scan_model(17, 1, [[3, 2]], 1, scan_input_axes=[2])
    with pytest.raises(
        InputError,
        match=r"Scan node 'scan': scan input 'seq0' of shape \(3, 2\) has no axis 2 "
        r"\(scan_input_axes must lie in \[-2, 1\]\)",
    ):
        Session(model).run({"init0": np.zeros(2, np.float32), "seq0": np.zeros((3, 2), np.float32)})


def test_scan8_sequence_lengths_outside_the_sequence_are_input_errors():
    model = _scan_model(8, 1, [[1, 3, 2]], 1)
    feeds = {"init0": np.zeros((1, 2), np.float32), "seq0": np.zeros((1, 3, 2), np.float32)}
    with pytest.raises(InputError, match=r"Scan node 'scan': sequence_lens 'lens' is \[4\]; each must lie in \[0, 3\]"):
        Session(model).run({**feeds, "lens": np.array([4], np.int64)})


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({"num_scan_inputs": 0}, r"num_scan_inputs must be an int in \[1, 2\]"),
        ({"num_scan_inputs": 1, "scan_input_axes": [0, 1]}, r"attribute 'scan_input_axes' has 2 entries, expected 1"),
        (
            {"num_scan_inputs": 1, "scan_output_directions": [2]},
            r"attribute 'scan_output_directions' must hold 0 \(forward\) or 1 \(reverse\), got \[2\]",
        ),
    ],
)
def test_scan_attributes_that_do_not_fit_are_model_errors(attrs, message):
    model = _scan_model(17, 1, [[3, 2]], 1)
    node = model.graph.node[0]
    del node.attribute[1:]
    node.attribute.extend(h.make_attribute(k, v) for k, v in attrs.items())
    with pytest.raises(ModelError, match=r"Scan node 'scan': " + message):
        Session(model)


# -- building and buffers ----------------------------------------------------------------------------------


def test_an_error_building_a_subgraph_names_the_node_and_attribute():
    body = _loop_body([h.make_node("Frobnicate", ["y_in"], ["y_out"], name="odd", domain="ai.onnxkv")], ["y"])
    node = h.make_node("Loop", ["M", "", "y0"], ["y"], name="loop", body=body)
    model = _model([node], [_vi("M", T.INT64, []), _vi("y0", T.FLOAT, [1])], [_vi("y")])
    model.opset_import.append(h.make_opsetid("ai.onnxkv", 1))
    with pytest.raises(
        ModelError,
        match=r"Loop node 'loop': attribute 'body': 1 node\(s\) use operators onnxkv has no "
        r"implementation for: 'odd' \(ai.onnxkv::Frobnicate\)",
    ):
        Session(model)


def test_a_callers_allocator_gets_every_body_temporary_back_after_a_run_and_after_a_failure():
    body = _loop_body(
        [
            h.make_node("Mul", ["y_in", "y_in"], ["sq"]),
            h.make_node("Add", ["sq", "y_in"], ["y_out"]),
            h.make_node("Reshape", ["y_out", "shape"], ["r"], name="bad_reshape"),
        ],
        ["y"],
        [_vi("r")],
    )
    node = h.make_node("Loop", ["M", "", "y0"], ["y", "r"], name="loop", body=body)
    model = _model(
        [node], [_vi("M", T.INT64, []), _vi("y0", T.FLOAT, [4]), _vi("shape", T.INT64, [1])], [_vi("y"), _vi("r")]
    )
    allocator = SystemAllocator()
    session = Session(model, allocator=allocator)
    out = session.run({"M": np.array(2, np.int64), "y0": np.ones(4, np.float32), "shape": np.array([4])})
    np.testing.assert_array_equal(out["y"], np.full(4, 6))
    assert allocator.stats().allocations > 0 and allocator.stats().live == 0
    with pytest.raises(OperatorError, match=r"Loop node 'loop', iteration 0: Reshape node 'bad_reshape' failed"):
        session.run({"M": np.array(2, np.int64), "y0": np.ones(4, np.float32), "shape": np.array([3])})
    assert allocator.stats().live == 0


def test_a_control_flow_kernel_needs_a_plan_to_build_its_subgraphs():
    branch = h.make_graph([], "b", [], [_vi("x")])
    node = h.make_node("If", ["c"], ["y"], name="pick", then_branch=branch, else_branch=branch)
    with pytest.raises(ModelError, match=r"If node 'pick': subgraphs are built by a Plan"):
        If(node, BuildContext({"": 17}))
