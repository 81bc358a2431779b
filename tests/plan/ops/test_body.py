"""The literal fallback of fused nodes (``Body``) hands what its nodes leave for the run to the fused node's run."""

from __future__ import annotations

import numpy as np
from onnx import helper

from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._body import Body


class _Writer:
    """A body kernel that changes storage outliving the run, as an in-place cache kernel does."""

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, inputs, rt):
        rt.defer(lambda: self.log.append("commit"), lambda: self.log.append("rollback"))
        rt.count(append_copied_bytes=64)
        return [inputs[0] + 1]


def _body(log: list) -> Body:
    body = Body.__new__(Body)
    body.steps = [(helper.make_node("Writer", ["x"], ["y"]), _Writer(log))]
    body.outputs = ["y"]
    return body


def _context() -> RunContext:
    rt = RunContext(lambda _rt, _i, shape, dtype: np.empty(shape, dtype), True, 0, {})
    rt.counters = {}
    return rt


def test_a_failed_run_rolls_back_what_a_body_node_changed():
    log: list = []
    rt = _context()
    (y,) = _body(log).evaluate(["x"], [np.zeros(2, np.float32)], rt)
    np.testing.assert_array_equal(y, [1, 1])
    assert rt.counters == {"append_copied_bytes": 64}
    rt.finish(ok=False)
    assert log == ["rollback"]


def test_a_committed_run_commits_what_a_body_node_changed():
    log: list = []
    rt = _context()
    _body(log).evaluate(["x"], [np.zeros(2, np.float32)], rt)
    rt.finish(ok=True)
    assert log == ["commit"]
