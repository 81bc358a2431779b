"""Test work run from two Python threads at once, in barrier-synchronised rounds."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["side_by_side"]


def side_by_side(work, rounds: int, timeout: float = 60.0) -> None:
    """Call ``work(i, r)`` for i = 0 and 1 in two Python threads, round r of
    both starting together, for r in range(rounds).  A failure in one thread
    stops both and is raised here (before the broken barrier it causes in the
    other)."""
    barrier = threading.Barrier(2, timeout=timeout)

    def loop(i):
        try:
            for r in range(rounds):
                barrier.wait()
                work(i, r)
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(loop, i) for i in range(2)]
    errors = [f.exception() for f in futures if f.exception() is not None]
    errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
    if errors:
        raise errors[0]
