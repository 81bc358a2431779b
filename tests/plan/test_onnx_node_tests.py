"""ONNX's own backend node tests, run through ``onnxkv.Session``.

The installed ``onnx`` builds its node tests from its case modules
(``onnx.backend.test.case.node.collect_testcases``): one model per test,
inputs and expected outputs.  Each runs here through ``onnxkv.Session`` --
operators with an onnxkv kernel and, for the rest, the ``onnx.reference``
fallback -- and is compared as ONNX's runner compares
(``onnx.backend.test.runner.Runner.assert_similar_outputs``: count, shape,
dtype, then ``rtol``/``atol`` of the case, 1e-3/1e-7, two bfloat16 ulps for
bfloat16).  A test listed in :data:`onnx_node_known.KNOWN` must still fail,
with an onnxkv error or an output mismatch, never a raw Python exception;
one listed in :data:`onnx_node_known.RANDOM_VALUES` (random outputs) must
give outputs of the expected count, shapes and dtypes; every other test must
pass.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx.backend.test.case.node import collect_testcases
from onnx.backend.test.case.test_case import TestCase
from onnx.backend.test.runner import Runner
from onnx_node_known import KNOWN, RANDOM_VALUES

from onnxkv import Session
from onnxkv.errors import OnnxkvError

#: The cases feed infinities and NaN on purpose; NumPy's warnings about them are expected.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _cases() -> list[TestCase]:
    with warnings.catch_warnings(), np.errstate(all="ignore"):  # the case modules divide by zero on purpose
        warnings.simplefilter("ignore")
        return sorted(collect_testcases(), key=lambda case: case.name)


CASES = _cases()


def _value(x):
    return onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x


def run_case(case: TestCase, values: bool = True) -> None:
    """Run ``case`` through onnxkv and compare as ONNX's runner does (AssertionError on a mismatch);
    without ``values`` only the outputs' count, shapes and dtypes."""
    graph = case.model.graph
    session = Session(case.model, threads=1)
    for inputs, expected in case.data_sets:
        got = session.run({vi.name: _value(x) for vi, x in zip(graph.input, inputs)})
        outputs, expected = [got[o.name] for o in graph.output], [_value(x) for x in expected]
        if values:
            Runner.assert_similar_outputs(expected, outputs, rtol=case.rtol, atol=case.atol)
        else:
            assert [(a.shape, a.dtype) for a in outputs] == [(e.shape, e.dtype) for e in expected]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_node(case: TestCase) -> None:
    if case.name in KNOWN:
        with pytest.raises((OnnxkvError, AssertionError)):  # any other exception fails the test
            run_case(case)
    else:
        run_case(case, values=case.name not in RANDOM_VALUES)


def test_every_listed_test_is_collected_and_listed_once() -> None:
    names = {c.name for c in CASES}
    assert sorted((set(KNOWN) | set(RANDOM_VALUES)) - names) == []
    assert set(KNOWN).isdisjoint(RANDOM_VALUES)
