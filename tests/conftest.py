"""Suite-wide checks: after every test, every live page pool is whole again."""

from __future__ import annotations

import gc

import fuzzing  # noqa: F401  (registers and loads the Hypothesis profile of the suite)
import pytest

from onnxkv.cache.paged import live_pools


@pytest.fixture(autouse=True)
def pool_is_whole():
    """Every page of every live BlockPool is referenced exactly by live page tables (no leak, no double free)."""
    yield
    if live_pools():
        gc.collect()
        for pool in live_pools():
            pool.audit()  # raises StateError naming the first page whose count is wrong
