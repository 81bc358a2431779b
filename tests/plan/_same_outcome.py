"""The outcome of a run, and the check that a fused plan's outcome is the unfused plan's (fusion fuzz tests)."""

from __future__ import annotations

import numpy as np

import onnxkv


def outcome(session: onnxkv.Session, feeds: dict):
    """The run's outputs, or the type of the onnxkv error it raised."""
    try:
        return session.run(feeds)
    except onnxkv.OnnxkvError as e:
        return type(e)


def assert_same_outcome(got, want, context: str) -> None:
    """The same outputs bit for bit, or the same onnxkv error."""
    if isinstance(want, dict):
        assert isinstance(got, dict), context
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=context)
    else:
        assert got is want, context


def fused_and_plain(model, monkeypatch, fusion: str):
    """Sessions of ``model`` with and without the fusion pass ``fusion`` (a name in
    :mod:`onnxkv.plan.fusion_passes`), or None when onnxkv refuses the model as it builds the plan."""
    import onnxkv.plan.fusion_passes as fusion_passes

    try:
        fused = onnxkv.Session(model, threads=1)
    except onnxkv.OnnxkvError:
        return None
    with monkeypatch.context() as m:
        m.setattr(fusion_passes, fusion, lambda nodes, *args: nodes)
        return fused, onnxkv.Session(model, threads=1)


def mutants(base, mutate, rng, count: int, monkeypatch, fusion: str):
    """``count`` mutated copies of ``base`` (``mutate(model, rng)`` changes one in place and says how):
    yields (iteration, what, fused session, unfused session) for those onnxkv builds."""
    import onnx

    for iteration in range(count):
        model = onnx.ModelProto()
        model.CopyFrom(base)
        what = mutate(model, rng)
        sessions = fused_and_plain(model, monkeypatch, fusion)
        if sessions is not None:  # None: a graph onnxkv refuses when it builds the plan (shapes that cannot be)
            yield iteration, what, model, *sessions
