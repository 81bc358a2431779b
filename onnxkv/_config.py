"""``onnxkv.show_config()``: version, OpenMP, threads and SIMD path in use."""

from __future__ import annotations

import platform
import sys

__all__ = ["config", "show_config"]


def config() -> dict:
    """The build and run-time configuration as a dict."""
    import numpy
    import onnx

    from onnxkv import __version__, _kernels
    from onnxkv._threads import default_threads

    return {
        "onnxkv": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "onnx": onnx.__version__,
        "openmp": _kernels.openmp_enabled(),
        "threads": _kernels.get_num_threads(),
        "default_threads": default_threads(),
        "simd": _kernels.simd_path(),
        "cpu_features": _kernels.cpu_features(),
    }


def show_config(file=None) -> None:
    """Print :func:`config` as ``key: value`` lines."""
    for k, v in config().items():
        print(f"{k}: {v}", file=file or sys.stdout)
