"""``onnxkv.kernels``: the public switches of the compiled kernels and the level each family runs.

Settings (thread count, instruction-set level, AMX) belong to the calling
Python thread and travel with each kernel call:

* :class:`KernelSettings` -- an immutable value (``threads``, ``simd`` =
  ``"auto" | "avx512" | "avx2" | "scalar"``, ``amx``, ``prefill_precision`` =
  ``"float32" | "bf16"``: prompt products in bfloat16 where
  :func:`bf16_available`);
* :func:`use_settings` -- a context manager installing one for the calling
  thread (restored on exit); :func:`current_settings`; :func:`simd_levels`
  (the levels this CPU and OS run, lowest first);
* :func:`set_num_threads` / :func:`get_num_threads`;
* the single switches, each acting on the calling thread's settings only:
  :func:`set_simd_enabled` (False: the portable scalar path everywhere),
  :func:`set_attention_avx512` and :func:`set_packed_avx512` (one switch:
  the AVX-512 tiles of attention and of the packed matmuls, or AVX2 only),
  :func:`set_attention_amx` (quantized pages' keys scored on AMX-INT8 inside
  the AVX-512 paged attention tiles);
* :func:`kernel_levels` -- the level each kernel family runs under the
  calling thread's settings (``onnxkv.show_config()`` prints it).

Everything here is a thin view of :mod:`onnxkv._kernels`; sessions keep the
calling thread's SIMD level and AMX choice and set only the thread count
around their runs.
"""

from __future__ import annotations

import importlib

from onnxkv._kernels import (
    KernelSettings,
    bf16_available,
    current_settings,
    get_num_threads,
    set_num_threads,
    set_simd_enabled,
    simd_levels,
    use_settings,
)

__all__ = [
    "KernelSettings",
    "use_settings",
    "current_settings",
    "simd_levels",
    "bf16_available",
    "set_num_threads",
    "get_num_threads",
    "set_simd_enabled",
    "set_attention_avx512",
    "set_packed_avx512",
    "set_attention_amx",
    "kernel_levels",
    "KERNEL_FAMILIES",
]

# The compiled modules themselves (the package attributes of the same names are their kernel functions).
_attention = importlib.import_module("onnxkv._kernels.attention")
_matmul = importlib.import_module("onnxkv._kernels.matmul")
_qmatmul = importlib.import_module("onnxkv._kernels.qmatmul")

set_attention_avx512 = _attention.set_attention_avx512
set_packed_avx512 = _matmul.set_packed_avx512
set_attention_amx = _attention.set_attention_amx

#: Kernel families of :func:`kernel_levels`, with what each covers.
KERNEL_FAMILIES = {
    "attention": "decode and prefill attention over contiguous caches, decode_token",
    "paged_attention": "attention through page tables; '+amx': quantized pages' keys on AMX-INT8",
    "matmul_packed": "float32 MatMul on weights packed into panels",
    "matmul_nbits_int8": "MatMulNBits with int8 activations (decode rows)",
    "matmul_nbits_float": "MatMulNBits with float32 activations, dequantized panels of prompt chunks",
    "quant": "page quantize / dequantize",
    "elementwise": "RMSNorm, softmax, activations, rotary, f16/bf16 conversion",
}


def kernel_levels() -> dict[str, str]:
    """The instruction-set level each family of :data:`KERNEL_FAMILIES` runs now in the calling thread.

    Levels: ``"scalar"``, ``"avx2"`` (AVX2+FMA+F16C), ``"avx512"`` (the
    AVX-512 F/BW/VL/DQ tiles), ``"avx512+amx"`` (paged attention: AVX-512
    tiles, quantized keys on AMX-INT8), and for the int8 products
    ``"avx512-vnni"`` / ``"avx-vnni"`` (VNNI dot products) or ``"avx2"``.
    Page quantization and the element-wise kernels have an AVX2 and a scalar
    path only.  The answer follows the thread's current settings
    (:func:`use_settings`, the switches above).
    """
    level = current_settings().simd
    vector = "scalar" if level == "scalar" else "avx2"
    return {
        "attention": level,
        "paged_attention": _attention.attention_simd_level(),
        "matmul_packed": level,
        "matmul_nbits_int8": _qmatmul.int8_path(),
        "matmul_nbits_float": level,
        "quant": vector,
        "elementwise": vector,
    }
