"""Run-time switches shared by all onnxkv kernels.

One C global holds the thread count used as ``num_threads=`` of every OpenMP
``prange`` in the kernels; another forces the scalar path.  Other kernel modules
read them through ``okv_threads()`` / ``okv_simd()`` (see ``_runtime.pxd``).
"""
import os

cdef extern from "simd.h" nogil:
    int okv_openmp_enabled()
    int okv_omp_num_procs()
    int okv_simd_compiled()
    int okv_cpu_simd_ok()
    void okv_cpu_flags(int *flags)


def _default_threads():
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, int(n))


cdef int _num_threads = _default_threads()
cdef int _simd_enabled = 1
cdef int _cpu_ok = okv_cpu_simd_ok() and okv_simd_compiled()


cdef int okv_threads() noexcept nogil:
    return _num_threads


cdef int okv_simd() noexcept nogil:
    return _simd_enabled and _cpu_ok


def set_num_threads(n):
    """Set the number of OpenMP threads every kernel uses (``n >= 1``).

    Without OpenMP the value is stored but kernels run on one thread."""
    global _num_threads
    n = int(n)
    if n < 1:
        raise ValueError(f"n: number of threads must be >= 1, got {n}")
    _num_threads = n


def get_num_threads():
    """Number of threads the kernels use (default: CPUs available to the process)."""
    return _num_threads


def openmp_enabled():
    """True when the kernels were compiled with OpenMP."""
    return bool(okv_openmp_enabled())


def set_simd_enabled(flag):
    """Enable (default) or disable the AVX2/FMA/F16C path.  Disabling forces the
    portable scalar path (used by the tests); enabling has no effect on a CPU
    without AVX2+FMA+F16C."""
    global _simd_enabled
    _simd_enabled = 1 if flag else 0


def simd_path():
    """``"avx2+fma+f16c"`` when kernels run the AVX2 path, else ``"scalar"``."""
    return "avx2+fma+f16c" if okv_simd() else "scalar"


def cpu_features():
    """CPU features as detected at run time plus build facts."""
    cdef int f[7]
    okv_cpu_flags(f)
    return {
        "avx": bool(f[0]), "avx2": bool(f[1]), "fma": bool(f[2]), "f16c": bool(f[3]),
        "avx512f": bool(f[4]), "sse4_2": bool(f[5]), "popcnt": bool(f[6]),
        "simd_compiled": bool(okv_simd_compiled()),
        "simd_usable": bool(_cpu_ok),
        "openmp": bool(okv_openmp_enabled()),
        "omp_num_procs": int(okv_omp_num_procs()),
    }
