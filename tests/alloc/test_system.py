"""SystemAllocator: fresh NumPy memory per buffer, accounting of requested bytes."""

from __future__ import annotations

import random
import threading
from itertools import pairwise

import numpy as np
import pytest

from onnxkv.alloc import SystemAllocator


@pytest.mark.parametrize("alignment", [1 << k for k in range(13)])
@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 1000])
def test_addresses_are_aligned(alignment, nbytes):
    alloc = SystemAllocator()
    bufs = [alloc.allocate(nbytes, alignment) for _ in range(8)]
    for buf in bufs:
        assert buf.address % alignment == 0
        assert buf.nbytes == nbytes
    for buf in bufs:
        alloc.free(buf)


def test_default_alignment_is_64():
    alloc = SystemAllocator()
    assert all(alloc.allocate(n).address % 64 == 0 for n in range(1, 50))


def test_views_are_writable_and_independent():
    alloc = SystemAllocator()
    bufs = [alloc.allocate(256, 32) for _ in range(10)]
    for i, buf in enumerate(bufs):
        buf.view(np.uint8, 256)[:] = i
    for i, buf in enumerate(bufs):
        assert np.all(buf.view(np.uint8, 256) == i)
    two = bufs[0].view(np.int32, 64)
    two[:] = -1
    assert np.all(bufs[0].view(np.uint8, 256) == 255)
    assert np.all(bufs[1].view(np.uint8, 256) == 1)


def test_stats_accounting():
    alloc = SystemAllocator()
    s = alloc.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (0, 0, 0, 0, 0)
    a = alloc.allocate(100)
    b = alloc.allocate(28, 4096)
    s = alloc.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (128, 128, 128, 2, 0)
    alloc.free(a)
    c = alloc.allocate(10)
    s = alloc.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (38, 38, 128, 3, 1)
    alloc.free(b)
    alloc.free(c)
    s = alloc.stats()
    assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (0, 0, 128, 3, 3)


def test_random_sequence_matches_model():
    rng = random.Random(1234)
    alloc = SystemAllocator()
    live: list = []
    model_live = model_peak = allocations = frees = 0
    for step in range(2000):
        if live and rng.random() < 0.45:
            buf, fill = live.pop(rng.randrange(len(live)))
            assert np.all(buf.view(np.uint8, buf.nbytes) == fill)
            model_live -= buf.nbytes
            frees += 1
            alloc.free(buf)
        else:
            n = rng.randrange(0, 5000)
            buf = alloc.allocate(n, 1 << rng.randrange(0, 10))
            buf.view(np.uint8, n)[:] = step % 251
            live.append((buf, step % 251))
            model_live += n
            model_peak = max(model_peak, model_live)
            allocations += 1
        s = alloc.stats()
        assert (s.committed, s.live, s.peak, s.allocations, s.frees) == (
            model_live,
            model_live,
            model_peak,
            allocations,
            frees,
        )
    spans = sorted((b.address, b.address + b.nbytes) for b, _ in live)
    assert all(end <= start for (_, end), (start, _) in pairwise(spans))


def test_threads_share_one_allocator():
    alloc = SystemAllocator()
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = random.Random(seed)
            for _ in range(2000):
                buf = alloc.allocate(rng.randrange(1, 512))
                buf.view(np.uint8, buf.nbytes)[:] = seed
                assert np.all(buf.view(np.uint8, buf.nbytes) == seed)
                alloc.free(buf)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = alloc.stats()
    assert (s.live, s.allocations, s.frees) == (0, 4000, 4000)
