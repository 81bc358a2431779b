"""onnxkv._kernels -- compiled (Cython + C, OpenMP, AVX2/FMA/F16C) kernels.

This package imports nothing else from onnxkv and knows nothing of ONNX.
Every kernel writes into caller-provided ``out`` arrays (C-contiguous, native
byte order) and checks all arguments (raising ``ValueError`` that names the
argument) before writing anything.  Every kernel has a NumPy reference twin in
:mod:`onnxkv._kernels.reference`.

Run-time switches: :func:`set_num_threads` / :func:`get_num_threads` (OpenMP
threads of every kernel), :func:`set_simd_enabled` / :func:`simd_path` (AVX2 or
scalar path), :func:`openmp_enabled`, :func:`cpu_features`.
"""
import importlib as _importlib

_MODULES = {
    "_runtime": ("set_num_threads", "get_num_threads", "openmp_enabled", "simd_path",
                 "set_simd_enabled", "cpu_features"),
    "norm": ("rms_norm", "skip_rms_norm"),
    "softmax": ("softmax",),
    "activation": ("sigmoid", "silu", "silu_mul"),
    "rotary": ("rotary_embedding",),
    "attention": ("attention",),
    "convert": ("f16_to_f32", "f32_to_f16", "bf16_to_f32", "f32_to_bf16", "read_sum"),
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

del _importlib, _mod, _names, _m, _n
