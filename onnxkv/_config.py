"""``onnxkv.show_config()``: version, OpenMP, threads and the level each kernel family runs."""

from __future__ import annotations

import platform
import sys

__all__ = ["config", "show_config"]


def config() -> dict:
    """The build and run-time configuration as a dict.

    ``simd`` is the calling thread's instruction-set level (``"avx512"``,
    ``"avx2"`` or ``"scalar"``, see :class:`onnxkv.kernels.KernelSettings`),
    ``simd_levels`` the levels this CPU and OS run, ``amx`` whether paged
    attention may use AMX-INT8, and ``kernels`` the level each kernel family
    really runs under the current settings (:func:`onnxkv.kernels.kernel_levels`).
    """
    import numpy
    import onnx

    from onnxkv import __version__, _kernels, kernels
    from onnxkv._threads import default_threads

    settings = kernels.current_settings()
    return {
        "onnxkv": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "onnx": onnx.__version__,
        "openmp": _kernels.openmp_enabled(),
        "threads": settings.threads,
        "default_threads": default_threads(),
        "simd": settings.simd,
        "simd_levels": list(kernels.simd_levels()),
        "amx": settings.amx,
        "kernels": kernels.kernel_levels(),
        "cpu_features": _kernels.cpu_features(),
    }


def show_config(file=None) -> None:
    """Print :func:`config` as ``key: value`` lines (the kernel levels one family per line)."""
    out = file or sys.stdout
    for k, v in config().items():
        if k == "kernels":
            print("kernels:", file=out)
            for family, level in v.items():
                print(f"  {family}: {level}", file=out)
        else:
            print(f"{k}: {v}", file=out)
