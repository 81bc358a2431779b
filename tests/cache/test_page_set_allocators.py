"""PageSet payloads from allocators that break their contract or whose free fails."""

import gc
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hostile_allocators import MODES, Hostile

from onnxkv.cache.page_set import PageSet, PlaneTarget

P, H, BS, D = 6, 2, 4, 8


def _int8(n):
    return PlaneTarget("int8", np.full((n, H), 0.1, np.float32), np.zeros((n, H), np.float32))


def _state(handle, tensor):
    return tensor.tobytes(), handle.ptrs.copy(), handle.formats.copy(), list(handle.groups), handle.payload_bytes


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_broken_payload_is_rejected_and_nothing_is_published(mode):
    t = np.random.default_rng(1).standard_normal((P, 2, H, BS, D)).astype(np.float32)
    alloc = Hostile()
    handle = PageSet.attach(t, alloc)
    handle.convert(np.array([5]), [_int8(1), _int8(1)])  # a live payload the new ones could collide with
    before, live = _state(handle, t), alloc.inner.stats().live
    alloc.mode = mode
    with pytest.raises(MODES[mode][0], match=MODES[mode][1]) as e:
        handle.convert(np.array([0, 2]), [_int8(2), PlaneTarget("float16")])
    assert str(e.value).startswith("PageSet: a ")
    for a, b in zip(_state(handle, t), before):
        np.testing.assert_array_equal(a, b)
    assert alloc.inner.stats().live == live
    handle.audit()
    alloc.mode = None
    handle.convert(np.array([0, 2]), [_int8(2), PlaneTarget("float16")])
    handle.audit()


def test_failing_frees_are_logged_and_the_handle_stays_whole(caplog):
    t = np.random.default_rng(2).standard_normal((P, 2, H, BS, D)).astype(np.float32)
    alloc = Hostile()
    handle = PageSet.attach(t, alloc)
    handle.convert(np.array([0, 1, 2]), [_int8(3), None])
    alloc.free_raises = True
    with caplog.at_level(logging.WARNING, logger="onnxkv.alloc"):
        handle.convert(np.array([0]), [PlaneTarget("float16"), None])  # replaces page 0's payload
        staged = handle.convert(np.array([1]), [PlaneTarget("float32"), None], staged=True)
        staged.rollback()  # page 1 keeps its int8 payload
        staged = handle.convert(np.array([2]), [PlaneTarget("float32"), None], staged=True)
        staged.commit()  # page 2 is back in its slot: its payload goes
        handle.audit()
        assert handle.formats[0].tolist() == [10, 3, 1, 1, 1, 1]
        assert _refused(caplog) == 2  # page 0's int8 payload, page 2's payload
        del t, handle, staged
        gc.collect()  # the tensor is gone: its payloads go
        assert _refused(caplog) == 2 + 2  # pages 0 and 1


def _refused(caplog) -> int:
    return sum("hostile free refuses" in r.getMessage() for r in caplog.records)


COLLECTED_WHILE_LOCKED = textwrap.dedent("""
    import gc
    import numpy as np
    import onnxkv.cache.page_set as page_set
    from onnxkv.cache.page_set import PageSet

    t = np.zeros((2, 2, 2, 4, 8), np.float32)
    PageSet.attach(t)
    cycle = [t]
    cycle.append(cycle)
    del t, cycle  # a dead page tensor in a reference cycle: its payloads go at the next collection
    gc.disable()
    with page_set._lock:  # held by attach while it makes a handle, when an allocation may collect
        gc.collect()
    print("collected")
""")


def test_a_page_tensor_collected_while_the_registry_is_locked_does_not_deadlock(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", COLLECTED_WHILE_LOCKED], capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip() == "collected", done.stderr[-2000:]
