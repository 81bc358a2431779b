"""One thread setting for the OpenMP kernels and the BLAS under NumPy.

:class:`ThreadControl` is entered around every run.  The kernels get its
thread count through :func:`onnxkv._kernels.use_settings`: the settings of the
calling Python thread only (its other settings -- SIMD level, AMX -- stay as
they are), so sessions with different ``threads`` run side by side in two
Python threads without seeing each other's count.

The BLAS/OpenMP pools NumPy uses are limited through ``threadpoolctl``, and
that limit is process-wide by nature (OpenBLAS has one pool; threadpoolctl
lets one Python thread at a time change it): a run that starts while no
other run holds the limit sets it and restores it when it ends; runs that
start meanwhile leave it alone.  Only speed depends on it, never a result.

Decode-sized runs (few tokens) do their heavy work in onnxkv's own OpenMP
kernels; there BLAS gets one thread, because BLAS worker threads that wake
for a small product and then busy-wait hold the cores the OpenMP kernels need
next, stalling every kernel call.  Larger runs (prefill) give BLAS every
thread.  A session's run takes that limit only when a node that may call BLAS
runs in Python (``ThreadControl(..., lazy_blas=True)``, the ``on_python`` hook
of :meth:`onnxkv.plan.plan.Plan.run`; ``Op.uses_blas``): a replayed compiled
step calls onnxkv's kernels alone, and the Python nodes around it in a decode
step (an export's mask, shape values, casts) never call BLAS, so such a run
leaves every library's thread count as it is and pays none of threadpoolctl's
calls.
"""

from __future__ import annotations

import functools
import threading

from threadpoolctl import ThreadpoolController

from onnxkv import _kernels
from onnxkv.errors import InputError

__all__ = ["ThreadControl", "default_threads"]


def default_threads() -> int:
    """Threads used when none are given: the kernels' process default
    (``OMP_NUM_THREADS``, else the CPUs this process may run on within its
    cgroup's CPU quota; ``onnxkv._kernels._cpus``)."""
    return _kernels.KernelSettings().threads


@functools.lru_cache(maxsize=1)
def _controller() -> ThreadpoolController:
    return ThreadpoolController()


class _BlasLimit:
    """The process-wide BLAS thread limit, held by one run at a time (see the module docstring).

    It drives threadpoolctl's per-library controllers directly (the thread
    count of each library is read, set where it differs, and put back), so a
    run whose limits are already right changes nothing; ``ThreadpoolController.limit``
    would set and restore every library on every run, a cost a small model's
    decode step feels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = False
        self._restore: list = []

    def take(self, threads: int) -> bool:
        """Limit BLAS to ``threads`` unless a run holds the limit; True when this call took it."""
        with self._lock:
            if self._held:
                return False
            restore = []
            try:
                for lib in _controller().lib_controllers:
                    old = lib.get_num_threads()
                    if old is not None and old != threads:
                        lib.set_num_threads(threads)
                        restore.append((lib, old))
            except BaseException:
                for lib, old in restore:
                    lib.set_num_threads(old)
                raise
            self._held, self._restore = True, restore
            return True

    def release(self) -> None:
        """Restore the limit a ``take`` of the calling thread set."""
        with self._lock:
            restore, self._restore, self._held = self._restore, [], False
            for lib, old in restore:
                lib.set_num_threads(old)
                # threadpoolctl >= 3.6 lets one Python thread at a time set OpenBLAS' process-wide limit:
                # hand that control back, as leaving ``ThreadpoolController.limit`` does
                clear = getattr(type(lib), "clear_controlling_thread", None)
                if clear is not None:
                    clear()


_BLAS = _BlasLimit()


class ThreadControl:
    """Applies one thread count to the kernels and BLAS around each run:
    ``with control(blas_threads):`` (see the module docstring)."""

    def __init__(self, threads: int | None, prefill_precision: str | None = None) -> None:
        if threads is None:
            threads = default_threads()
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= _kernels.MAX_THREADS:
            raise InputError(
                f"threads must be a positive int (at most {_kernels.MAX_THREADS}) or None, got {threads!r}"
            )
        self.threads = threads
        #: The kernels' prefill_precision around each run (None: the calling thread's).
        self.precision = prefill_precision

    def decode_loop(self) -> _BlasHold:
        """A context manager around a loop of decode-sized runs (a generation loop): BLAS
        keeps the one thread a decode run gives it for the whole loop, instead of each run
        setting and restoring the limit (three threadpoolctl calls per token).  Runs inside
        that are not decode-sized then also see BLAS at one thread: only their speed changes."""
        return _BlasHold(1)

    def __call__(self, blas_threads: int | None = None, lazy_blas: bool = False) -> _Run:
        """A context manager for one run: the calling thread's kernels use
        ``threads``, BLAS ``blas_threads`` (default: ``threads``); with ``lazy_blas``
        the BLAS limit is taken only when :meth:`_Run.python_nodes` is called."""
        blas = self.threads if blas_threads is None else max(1, min(blas_threads, self.threads))
        return _Run(self.threads, blas, self.precision, lazy_blas)


class _BlasHold:
    """Holds the BLAS limit from enter to exit, unless a run or a loop holds it already
    (``ThreadControl.decode_loop``, and the BLAS part of each run)."""

    __slots__ = ("_blas", "_holds")

    def __init__(self, blas: int) -> None:
        self._blas = blas
        self._holds = False

    def __enter__(self) -> _BlasHold:
        self._holds = _BLAS.take(self._blas)
        return self

    def __exit__(self, *exc) -> None:
        if self._holds:
            self._holds = False
            _BLAS.release()


class _Run:
    """The settings of one run (``ThreadControl.__call__``)."""

    __slots__ = ("_scope", "_blas", "_lazy")

    def __init__(self, threads: int, blas: int, precision: str | None = None, lazy: bool = False) -> None:
        settings = _kernels.current_settings().replace(threads=threads)
        if precision is not None:
            settings = settings.replace(prefill_precision=precision)
        self._scope = _kernels.use_settings(settings)
        self._blas = _BlasHold(blas)
        self._lazy = lazy

    def __enter__(self) -> _Run:
        self._scope.__enter__()
        if not self._lazy:
            try:
                self._blas.__enter__()
            except BaseException:
                self._scope.__exit__(None, None, None)
                raise
        return self

    def python_nodes(self) -> None:
        """A lazy run's first node to run in Python starts: take the BLAS limit now (until the run ends)."""
        self._blas.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            self._blas.__exit__(*exc)
        finally:
            self._scope.__exit__(*exc)
