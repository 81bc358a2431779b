"""RunBuffers with allocators that break their contract or whose free fails."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hostile_allocators import MODES, Hostile

from onnxkv.errors import StateError
from onnxkv.plan.buffers import RunBuffers


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_broken_temporary_is_rejected_and_nothing_is_held(mode):
    alloc = Hostile()
    bufs = RunBuffers(alloc)
    bufs.take(0, (4, 4), np.dtype(np.float32))
    alloc.mode = mode
    with pytest.raises(MODES[mode][0], match=MODES[mode][1]) as e:
        bufs.take(1, (2, 8), np.dtype(np.float32))
    assert str(e.value).startswith(f"Plan temporaries: Hostile({mode!r}).allocate(64, 64) for uint8[64]")
    assert list(bufs.held) == [0] and alloc.inner.stats().live == 64
    bufs.close()
    assert alloc.inner.stats().live == 0


def test_a_temporary_given_back_mid_run_whose_free_fails_fails_the_run():
    alloc = Hostile()
    bufs = RunBuffers(alloc, pool_limit=100)
    bufs.take(0, (16,), np.dtype(np.float32))
    bufs.take(1, (16,), np.dtype(np.float32))
    bufs.release(0)  # pooled
    alloc.free_raises = True
    with pytest.raises(StateError, match=r"Plan temporaries: Hostile\(None\)\.free raised RuntimeError"):
        bufs.release(1)  # past the pool limit: freed at once
    assert bufs.held == {} and bufs.pooled == 64


def test_the_end_of_a_run_logs_failing_frees_and_holds_nothing(caplog):
    alloc = Hostile()
    bufs = RunBuffers(alloc)
    out, _ = bufs.take(0, (4,), np.dtype(np.float32))
    bufs.take(1, (8,), np.dtype(np.float32))
    bufs.release(1)
    alloc.free_raises = True
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
        bufs.recycle([out])  # slot 0 is viewed by an output: freed; slot 1's buffer stays for the next run
        assert bufs.held == {} and bufs.pooled == 64  # its 32 bytes in the 64-byte size class
        bufs.take(2, (32,), np.dtype(np.float32))  # another size class: a buffer of its own
        bufs.close()
    assert bufs.held == {} and bufs.free_lists == {} and bufs.pooled == 0
    assert sum("hostile free refuses" in r.getMessage() for r in caplog.records) == 3
