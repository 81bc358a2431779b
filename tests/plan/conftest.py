"""Fixtures for the plan tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def recordings(monkeypatch) -> list:
    """A list that gains an entry each time a compiled step is recorded (``compiled_step.record`` runs)."""
    import onnxkv.plan.compiled_step as compiled_step

    seen: list = []
    real = compiled_step.record
    monkeypatch.setattr(compiled_step, "record", lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen
