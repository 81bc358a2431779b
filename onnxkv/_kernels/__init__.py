"""onnxkv._kernels -- compiled (Cython + C, OpenMP, AVX2/FMA/F16C/AVX-512) kernels.

This package imports nothing else from onnxkv and knows nothing of ONNX.
Every kernel writes into caller-provided ``out`` arrays (C-contiguous, native
byte order) and checks all arguments (raising ``ValueError`` that names the
argument) before writing anything.  Every kernel has a NumPy reference twin in
:mod:`onnxkv._kernels.reference`.

Settings (thread count, instruction set, AMX) belong to the calling Python
thread and travel with each kernel call: :class:`KernelSettings` (an immutable
value), :func:`use_settings` (a context manager installing one for the calling
thread, restoring the previous settings on exit), :func:`current_settings`,
:func:`simd_levels`.  A new thread starts with the process defaults
(``OMP_NUM_THREADS`` threads, else every CPU the process may use within its
cgroup's CPU quota; the best level the build, CPU and OS run, capped by
``ONNXKV_MAX_SIMD``; AMX where available).
The older switches act on the calling thread's settings too:
:func:`set_num_threads` / :func:`get_num_threads` (OpenMP threads of every
kernel), :func:`set_simd_enabled` (False: the scalar path everywhere) and
:func:`simd_path` (``"avx2+fma+f16c"`` whenever a SIMD level is on, AVX-512
included, else ``"scalar"``; ``onnxkv.kernels.kernel_levels()`` reports the
level each kernel family actually runs).  The public view of these switches is
:mod:`onnxkv.kernels`.
Build facts: :func:`openmp_enabled`, :func:`cpu_features`.  Importing this
package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it
(see the comment below).
"""

import importlib as _importlib
import os as _os

# OpenMP wait policy.  libgomp's default lets a worker spin ~300k iterations
# after each parallel region: on cores shared with other processes (or with
# BLAS's own pool) a spinning worker holds a core another thread needs, and 2
# threads can become slower than 1.  Fully PASSIVE workers sleep at once and pay
# a futex wake-up per kernel call, a noticeable share of decode time when the
# cores are free (about 100 parallel regions per token).  A short bounded spin
# keeps both cases good: a worker waits through the gap between the kernel
# calls of one token, not through another process's time slice.  The OpenMP runtime reads these once, when it is loaded --
# i.e. when the first compiled module below is imported -- so they are set
# before them; an explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT is respected.
# Process-global: it also applies to other libgomp users in the same process.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "50000")

_MODULES = {
    "_runtime": (
        "KernelSettings",
        "current_settings",
        "use_settings",
        "simd_levels",
        "bf16_available",
        "MAX_THREADS",
        "set_num_threads",
        "get_num_threads",
        "openmp_enabled",
        "simd_path",
        "set_simd_enabled",
        "cpu_features",
    ),
    "norm": ("rms_norm", "skip_rms_norm"),
    "softmax": ("softmax",),
    "activation": ("sigmoid", "silu", "silu_mul", "gelu_tanh_mul", "add", "mul_scalar", "div_scalar", "softcap", "erf"),
    "rotary": ("rotary_embedding",),
    "attention": ("attention", "paged_attention", "decode_token", "decode_token_paged"),
    "convert": (
        "f16_to_f32",
        "f32_to_f16",
        "copy_f32",
        "concat_pair",
        "copy_rows",
        "bf16_to_f32",
        "f32_to_bf16",
        "read_sum",
    ),
    "matmul": ("matmul_rows",),
    "qmatmul": ("pack_nbits", "matmul_nbits"),
    "imatmul": ("pack_int8_weight", "matmul_integer", "dynamic_quantize_linear", "matmul_dynamic"),
    "quant": ("quantize_page", "dequantize_page"),
    "pages": ("page_write",),
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
