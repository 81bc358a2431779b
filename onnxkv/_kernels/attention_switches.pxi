# onnxkv/_kernels/attention_switches.pxi: the instruction-set switches of attention / paged_attention
# (AVX-512 tiles, AMX key scores, the level in use) and the private tuning switches of the work units.
# Included by attention.pyx (a Cython include: it shares that module's names).

cdef int _avx512_usable = okv_avx512_usable()


def set_attention_avx512(enabled: bool) -> bool:
    """Let the calling thread's attention / paged_attention calls run their
    AVX-512 tiles (when the process may run the avx512 level: the CPU and OS
    support AVX-512 F/BW/VL/DQ and ONNXKV_MAX_SIMD allows it; the default
    there) or only the AVX2 ones (to test and compare both on one machine).
    One switch of the thread's settings with ``matmul.set_packed_avx512``
    (``KernelSettings(simd=...)``); other threads keep theirs.  The SIMD
    switch (``set_simd_enabled``) still selects the scalar path.  Returns
    whether the AVX-512 tiles are now in use."""
    okv_settings_mine().avx512 = _avx512_usable if enabled else 0
    return bool(okv_settings_mine().avx512)


cdef int _amx_usable = okv_amx_usable()


def set_attention_amx(enabled: bool) -> bool:
    """Let paged_attention score the keys of quantized pages (8-, 4- and 2-bit
    codes with per-head scales, 8-bit codes with per-channel scales) on the
    AMX-INT8 tiles inside its AVX-512 tiles (the default where the CPU has AMX-TILE and
    AMX-INT8 and the OS grants the tile state; attention_amx.h), or with
    AVX-512 FMAs only (to
    test and compare both on one machine).  Takes effect only while the
    AVX-512 tiles run (``set_attention_avx512``, ``set_simd_enabled``).  Acts
    on the calling thread's settings only (``KernelSettings(amx=...)``).
    Returns whether AMX is now enabled (False where it is not usable)."""
    okv_settings_mine().amx = _amx_usable if enabled else 0
    return bool(okv_settings_mine().amx)


def attention_simd_level() -> str:
    """The instruction set the calling thread's attention / paged_attention
    calls run now: "avx512+amx" (AVX-512 tiles, quantized pages on AMX-INT8),
    "avx512", "avx2" or "scalar"."""
    cdef okv_settings *s = okv_settings_mine()
    if not s.simd:
        return "scalar"
    if not s.avx512:
        return "avx2"
    return "avx512+amx" if s.amx else "avx512"


# The private tuning switches below act on the calling thread's settings (okv_settings, simd.h) only.

def _set_split_tasks(n):
    """Private tuning switch for benchmarks: minimum number of cache-split tasks
    per thread for long caches (0 disables that split).  Returns the old value."""
    cdef okv_settings *s = okv_settings_mine()
    old = s.split_tasks
    s.split_tasks = max(0, int(n))
    return old


def _set_paged_heads(n):
    """Private tuning switch for benchmarks: KV heads per work unit of paged
    decode (0: all; else the largest divisor of Hkv <= n).  Returns the old value."""
    cdef okv_settings *s = okv_settings_mine()
    old = s.paged_heads
    s.paged_heads = max(0, int(n))
    return old


def _set_prefill_rg(n):
    """Private tuning switch: query rows per row group in prefill work units
    (1..8).  Returns the old value."""
    cdef okv_settings *s = okv_settings_mine()
    old = s.prefill_rg
    s.prefill_rg = min(8, max(1, int(n)))
    return old


def _set_flash(flag):
    """Private switch for tests and benchmarks: work units of several query tokens over native K/V take
    the tiled prefill unit (attention_flash.h; 1, the default) or the streaming unit (0).  Returns the old
    value."""
    cdef okv_settings *s = okv_settings_mine()
    old = s.flash
    s.flash = 1 if flag else 0
    return old


def _set_prefetch(flag):
    """Private switch for benchmarks: software prefetch of the next K/V block
    (0: off, 1: into L1, 2: into L2 (default), n >= 3: into L2, n-1 blocks ahead).  Returns the previous setting."""
    cdef okv_settings *s = okv_settings_mine()
    old = s.prefetch
    s.prefetch = int(flag)
    return old


def _set_prefetch_qk_lines(n):
    """Private tuning switch for benchmarks: with AMX key scores, the cache
    lines of the next block's software prefetch issued together with the key
    tiles (0: all of them); the rest are spread over the probabilities-times-
    values loop of the work item before.  Returns the old value."""
    cdef okv_settings *s = okv_settings_mine()
    old = s.pf_qk_lines
    s.pf_qk_lines = max(0, int(n))
    return old
