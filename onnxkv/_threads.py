"""One thread setting for the OpenMP kernels and the BLAS under NumPy.

:class:`ThreadControl` is entered around every run: it sets the OpenMP thread
count of ``onnxkv._kernels`` and limits the BLAS/OpenMP pools NumPy uses
(through ``threadpoolctl``), so the two never oversubscribe the cores.
Leaving restores the previous BLAS limits.

Decode-sized runs (few tokens) do their heavy work in onnxkv's own OpenMP
kernels; there BLAS gets one thread, because BLAS worker threads that wake
for a small product and then busy-wait hold the cores the OpenMP kernels need
next (measured: 2-3 ms stalls per kernel call on 2 cores).  Larger runs
(prefill) give BLAS every thread.
"""

from __future__ import annotations

import functools
import os

from threadpoolctl import ThreadpoolController

from onnxkv import _kernels
from onnxkv.errors import InputError

__all__ = ["ThreadControl", "default_threads"]


def default_threads() -> int:
    """Threads used when none are given: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=1)
def _controller() -> ThreadpoolController:
    return ThreadpoolController()


class ThreadControl:
    """Context manager applying one thread count to kernels and BLAS."""

    def __init__(self, threads: int | None) -> None:
        if threads is None:
            threads = default_threads()
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InputError(f"threads must be a positive int or None, got {threads!r}")
        self.threads = threads
        self._blas = threads
        self._limiter = None
        self._previous = 0

    def __call__(self, blas_threads: int | None = None) -> ThreadControl:
        """Use ``blas_threads`` for BLAS in the next ``with`` block (default: ``threads``)."""
        self._blas = self.threads if blas_threads is None else max(1, min(blas_threads, self.threads))
        return self

    def __enter__(self) -> ThreadControl:
        self._previous = _kernels.get_num_threads()
        _kernels.set_num_threads(self.threads)
        self._limiter = _controller().limit(limits=self._blas)
        self._blas = self.threads
        return self

    def __exit__(self, *exc) -> None:
        if self._limiter is not None:
            self._limiter.restore_original_limits()
            self._limiter = None
        _kernels.set_num_threads(self._previous)
