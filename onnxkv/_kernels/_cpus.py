"""How many threads the kernels use by default: the CPUs this process may use.

``default_threads()`` is read once, when ``onnxkv._kernels`` is imported (the
process default of every thread's kernel settings, ``_runtime``):

1. ``OMP_NUM_THREADS`` when it holds a positive integer (OpenMP's list form
   ``"4,2"``: its first entry, the outermost level), capped at
   ``MAX_THREADS``.  Any other value is ignored, as the OpenMP runtime ignores
   it (and reports it).
2. Otherwise the CPUs of the process's affinity mask, limited by the CPU
   quota of its cgroup rounded up: cgroup v2 ``cpu.max`` (``"<quota>
   <period>"`` or ``"max <period>"``) or cgroup v1 ``cpu.cfs_quota_us`` /
   ``cpu.cfs_period_us`` (quota -1: none), the smallest quota of the
   process's cgroup and its ancestors.  A container limited to 1.5 CPUs on a
   64-core host gets 2 threads, not 64.

Every file is read defensively: a missing, unreadable or malformed file
means "no limit from it", never an error.  The paths are parameters so that
the tests can point them at fake cgroup trees.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["MAX_THREADS", "cgroup_cpu_quota", "default_threads", "omp_num_threads"]

#: Largest thread count a kernel setting accepts.
MAX_THREADS = 1 << 16

_CGROUP_ROOT = "/sys/fs/cgroup"
_SELF_CGROUP = "/proc/self/cgroup"


def omp_num_threads(environ: Mapping[str, str]) -> int | None:
    """The thread count ``OMP_NUM_THREADS`` in ``environ`` asks for (its
    first entry, at most MAX_THREADS), or None when it is unset or not a
    positive integer."""
    value = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if not value.isdigit() or int(value) < 1:  # isdigit: no sign, no spaces inside
        return None
    return min(int(value), MAX_THREADS)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _ratio(quota: str, period: str) -> float | None:
    """CPUs of a quota and period in microseconds; None for "max", -1 or garbage."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _quota_v2(folder: Path) -> float | None:
    fields = (_read(folder / "cpu.max") or "").split()
    return _ratio(*fields) if len(fields) == 2 else None


def _quota_v1(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    return _ratio(quota, period) if quota is not None and period is not None else None


def cgroup_cpu_quota(
    root: str | os.PathLike = _CGROUP_ROOT, self_cgroup: str | os.PathLike = _SELF_CGROUP
) -> float | None:
    """The CPU quota (in CPUs, e.g. 1.5) of the process's cgroup: the
    smallest of its own and its ancestors' (a child never gets more than its
    parent), or None when none of them sets one.

    ``self_cgroup`` is the process's membership file (lines
    ``"<id>:<controllers>:<path>"``): the cgroup v2 line (id 0, no
    controllers) names a folder under ``root`` holding ``cpu.max``; a v1 line
    whose controllers include ``cpu`` names one under ``root/cpu`` holding
    ``cpu.cfs_quota_us``.  Folders that do not exist are skipped: inside a
    container the process's own cgroup is usually mounted at the root."""
    root = Path(root)
    quotas = []
    for line in (_read(Path(self_cgroup)) or "").splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            base, read = root, _quota_v2
        elif "cpu" in controllers.split(","):
            base, read = root / "cpu", _quota_v1
        else:
            continue
        folder = base / path.strip("/")
        for level in (folder, *folder.parents):
            quota = read(level)
            if quota is not None:
                quotas.append(quota)
            if level == base:
                break
    return min(quotas, default=None)


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_threads(
    environ: Mapping[str, str] | None = None,
    root: str | os.PathLike = _CGROUP_ROOT,
    self_cgroup: str | os.PathLike = _SELF_CGROUP,
    affinity: int | None = None,
) -> int:
    """The kernels' default thread count (see the module docstring): at least
    1, at most MAX_THREADS.  ``environ`` defaults to ``os.environ``,
    ``affinity`` to the size of the process's affinity mask."""
    requested = omp_num_threads(os.environ if environ is None else environ)
    if requested is not None:
        return requested
    n = _affinity() if affinity is None else affinity
    quota = cgroup_cpu_quota(root, self_cgroup)
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, min(n, MAX_THREADS))
