"""onnxkv._kernels -- compiled (Cython + C, OpenMP, AVX2/FMA/F16C) kernels.

This package imports nothing else from onnxkv and knows nothing of ONNX.
Every kernel writes into caller-provided ``out`` arrays (C-contiguous, native
byte order) and checks all arguments (raising ``ValueError`` that names the
argument) before writing anything.  Every kernel has a NumPy reference twin in
:mod:`onnxkv._kernels.reference`.

Run-time switches: :func:`set_num_threads` / :func:`get_num_threads` (OpenMP
threads of every kernel), :func:`set_simd_enabled` / :func:`simd_path` (AVX2 or
scalar path), :func:`openmp_enabled`, :func:`cpu_features`.  Importing this
package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it
(see the comment below).
"""
import importlib as _importlib
import os as _os

# OpenMP wait policy.  Spin-waiting worker threads (libgomp's default) are
# pathological when the cores are shared with other processes: a worker that
# spins at the end-of-region barrier or waits for a time slice on a busy core
# turns a 0.3 ms decode step into 10-20 ms, and 2 threads become slower than 1.
# PASSIVE (workers sleep on a futex between regions, costing a wake-up of a few
# microseconds per kernel call) is the robust default for an inference runtime.
# The OpenMP runtime reads this once, when it is loaded -- i.e. when the first
# compiled module below is imported -- so it is set before them; an explicit
# OMP_WAIT_POLICY in the environment is respected.  Process-global: it also
# applies to other libgomp users loaded later into the same process.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_MODULES = {
    "_runtime": ("set_num_threads", "get_num_threads", "openmp_enabled", "simd_path",
                 "set_simd_enabled", "cpu_features"),
    "norm": ("rms_norm", "skip_rms_norm"),
    "softmax": ("softmax",),
    "activation": ("sigmoid", "silu", "silu_mul"),
    "rotary": ("rotary_embedding",),
    "attention": ("attention",),
    "convert": ("f16_to_f32", "f32_to_f16", "bf16_to_f32", "f32_to_bf16", "read_sum"),
    "matmul": ("matmul_rows",),
}

__all__ = [name for names in _MODULES.values() for name in names]

for _mod, _names in _MODULES.items():
    try:
        _m = _importlib.import_module(f"{__name__}.{_mod}")
    except ImportError as _e:  # pragma: no cover - depends on the build
        raise ImportError(
            f"onnxkv._kernels: the compiled module 'onnxkv._kernels.{_mod}' failed to import. "
            "onnxkv must be built with a C compiler (and Cython), e.g. `pip install .` "
            "from a source checkout or a binary wheel. "
            f"Original error: {type(_e).__name__}: {_e}"
        ) from _e
    for _n in _names:
        globals()[_n] = getattr(_m, _n)

del _importlib, _os, _mod, _names, _m, _n
