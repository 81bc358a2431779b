"""Fixtures for the plan tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def recordings(monkeypatch) -> list:
    """A list that gains an entry each time a compiled step is recorded (the step pool calls ``record``)."""
    import onnxkv.plan.step_pool as step_pool

    seen: list = []
    real = step_pool.record
    monkeypatch.setattr(step_pool, "record", lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen
