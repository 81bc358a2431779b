# onnxkv/_kernels/attention_checks.pxi: argument checks shared by attention, decode_token and
# paged_attention (value ranges, K/V element types, scale / softcap / window, lengths).
# Included by attention.pyx (a Cython include: it shares that module's names).

def _check_values(name, arr, lo, hi):
    if arr.size:
        mn, mx = int(arr.min()), int(arr.max())
        if mn < lo or mx > hi:
            raise ValueError(f"{name}: values must be in [{lo}, {hi}], got range [{mn}, {mx}]")


_KV_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}


def _kv_type(k, kv_dtype):
    """Resolve the K/V element type; returns (name, storage dtype)."""
    if kv_dtype is None:
        if k.dtype == np.float32:
            return "float32"
        if k.dtype == np.float16:
            return "float16"
        if k.dtype == np.uint16:
            raise ValueError("k: uint16 arrays are only accepted as bfloat16 bit patterns with "
                             "kv_dtype='bfloat16'")
        raise ValueError(f"k: dtype {k.dtype} is not supported (expected float32, float16, or uint16 "
                         "with kv_dtype='bfloat16')")
    return _kv_name(kv_dtype)


def _kv_name(kv_dtype):
    """Resolve an explicit kv_dtype (a name or a NumPy dtype) to 'float32', 'float16' or 'bfloat16'."""
    name = kv_dtype if isinstance(kv_dtype, str) else None
    if name is None:
        try:
            name = np.dtype(kv_dtype).name
        except TypeError:
            name = str(kv_dtype)
    if name not in _KV_DTYPES:
        raise ValueError(f"kv_dtype: must be None, 'float32', 'float16' or 'bfloat16', got {kv_dtype!r}")
    return name


def _scalars(scale, softcap, window):
    """Checked (scale, softcap, window) as (float, float, int)."""
    scale = float(scale)
    if not isfinite(scale):
        raise ValueError(f"scale: must be finite, got {scale}")
    softcap = float(softcap)
    if not (isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap: must be finite and >= 0, got {softcap}")
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
        raise ValueError(f"window: expected an int, got {type(window).__name__}")
    if not -1 <= window <= _MAX_WINDOW:
        raise ValueError(f"window: must be in [-1, {_MAX_WINDOW}] (-1 = unlimited), got {window}")
    return scale, softcap, int(window)


#: Largest window: positions are int32, so a larger window sees as much, and p - window never overflows.
_MAX_WINDOW = 1 << 62


cdef bint _scalars_ok(scale, softcap, window) except -1:
    """True when (scale, softcap, window) pass ``_scalars`` unchanged: Python
    floats, scale finite, softcap finite and >= 0, a Python int window in
    [-1, 2**62] (anything else takes ``_scalars``)."""
    return (isinstance(scale, float) and isinstance(softcap, float) and isinstance(window, int)
            and not isinstance(window, bool)
            and isfinite(<double>scale) and isfinite(<double>softcap) and <double>softcap >= 0.0
            and -1 <= window <= _MAX_WINDOW)


cdef int64_t _lengths_max(const int32_t[::1] lens, int64_t hi) noexcept nogil:
    """The largest of ``lens``, or -1 when one is outside [0, hi] (or lens is empty)."""
    cdef int64_t i, m = -1
    for i in range(lens.shape[0]):
        if lens[i] < 0 or lens[i] > hi:
            return -1
        if lens[i] > m:
            m = lens[i]
    return m


_F16 = np.dtype(np.float16)


cdef object _kv_fast_name(k, kv_dtype):
    """The K/V element type name ``_kv_type`` resolves when kv_dtype is None (k
    float32 or float16) or one of the names and k has that storage dtype, else
    None (the Python checks then resolve the type or raise)."""
    if kv_dtype is None:
        if k.dtype is V.F32:
            return "float32"
        return "float16" if k.dtype is _F16 else None
    if isinstance(kv_dtype, str) and kv_dtype in _KV_DTYPES and k.dtype is _KV_DTYPES[kv_dtype]:
        return kv_dtype
    return None
