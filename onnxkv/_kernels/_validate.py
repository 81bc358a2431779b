"""Argument checks shared by the kernel wrappers (pure Python, no onnxkv imports).

Every check raises ``ValueError`` naming the argument, and all checks of a
kernel run before the kernel writes anything.
"""

import numpy as np

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
I32 = np.dtype(np.int32)
I64 = np.dtype(np.int64)


def array(name, a, dtypes, ndim=None, shape=None, writeable=False):
    """Check that ``a`` is a C-contiguous native-order ndarray of one of ``dtypes``."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy.ndarray, got {type(a).__name__}")
    if a.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: dtype {a.dtype} is not supported (expected {names})")
    if not a.dtype.isnative:
        raise ValueError(f"{name}: array must be in native byte order")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D array, got shape {a.shape}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{name}: array must be writeable")
    return a


def same_dtype(name, a, ref, ref_name):
    if a.dtype != ref.dtype:
        raise ValueError(f"{name}: dtype {a.dtype} does not match {ref_name} dtype {ref.dtype}")


def no_overlap(name, a, other, other_name, allow_identical=False):
    """Reject ``a`` overlapping ``other`` unless (optionally) it is exactly the same memory."""
    if other is None or a is None or not np.may_share_memory(a, other):
        return
    if allow_identical and identical(a, other):
        return
    extra = " (only exact aliasing is allowed)" if allow_identical else ""
    raise ValueError(f"{name}: must not overlap {other_name}{extra}")


def identical(a, b):
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and a.dtype == b.dtype
    )


U64 = np.dtype(np.uint64)
I32_MAX = int(np.iinfo(np.int32).max)


def positive_int(name, x):
    """``x`` as a Python int in [1, I32_MAX] (``TypeError`` if it is not an integer): a size the kernels
    multiply in int64 and index with int32."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if not 1 <= x <= I32_MAX:
        raise ValueError(f"{name}: must be in [1, {I32_MAX}], got {x}")
    return int(x)


def outside(values, lo, hi):
    """Bool mask of the elements of the integer array ``values`` outside [lo, hi] (Python ints of any
    size), compared in the array's own dtype: exact for every width (a uint64 above the int64 range or
    an int64 near its limits never wraps), whatever NumPy's promotion rules."""
    info = np.iinfo(values.dtype)
    lo, hi = max(int(lo), int(info.min)), min(int(hi), int(info.max))
    if lo > hi:
        return np.ones(values.shape, bool)
    kind = values.dtype.type
    return (values < kind(lo)) | (values > kind(hi))


def as_int32(name, a, lo, hi, shape):
    """Check an int32/int64 array of ``shape`` with values in [lo, hi]; return it as int32."""
    array(name, a, (I32, I64), shape=shape)
    if a.size:
        mn, mx = int(a.min()), int(a.max())
        if mn < lo or mx > hi:
            raise ValueError(f"{name}: values must be in [{lo}, {hi}], got range [{mn}, {mx}]")
    return np.ascontiguousarray(a, dtype=I32)


def paged_blocks_read(kv_len, q_pos, window, block_size, n_blocks, kv_start=None):
    """bool [B, n_blocks]: which logical blocks of each row hold a key that some
    query token of the call sees (query at position p sees keys j with
    j < kv_len[b], j <= p, j >= kv_start[b] (when given) and, if window >= 0,
    j >= p - window).  These are exactly the block table entries a paged
    attention call reads.  Vectorised: O(B*Sq + B*n_blocks)."""
    B = q_pos.shape[0]
    p = q_pos.astype(np.int64)
    lo = np.maximum(p - window, 0) if window >= 0 else np.zeros_like(p)
    if kv_start is not None:
        lo = np.maximum(lo, np.asarray(kv_start, np.int64)[:, None])
    hi = np.minimum(p + 1, np.asarray(kv_len, np.int64)[:, None])
    seen = lo < hi
    base = (np.arange(B, dtype=np.int64) * (n_blocks + 1))[:, None]
    first = (base + lo // block_size)[seen]  # first block of each token's range
    after = (base + (hi - 1) // block_size + 1)[seen]  # one past its last block
    size = B * (n_blocks + 1)
    diff = np.bincount(first, minlength=size) - np.bincount(after, minlength=size)
    return np.cumsum(diff.reshape(B, n_blocks + 1)[:, :n_blocks], axis=1) > 0


def page_tables(block_tables, read, block_size, pages, alignment=64):
    """Check the block table entries selected by the bool mask ``read`` [B, M]:
    each must be a page id in [0, P) whose address in every table of ``pages``
    ({name: uint64 [P] addresses}) is nonzero and a multiple of ``alignment``."""
    P = len(next(iter(pages.values())))
    ids = block_tables[read]
    if ids.size == 0:
        return
    if ids.min() < 0 or ids.max() >= P:
        b, i = np.argwhere(read)[np.argmax((ids < 0) | (ids >= P))]
        raise ValueError(
            f"block_tables: row {b}, block {i} (keys [{i * block_size}, {(i + 1) * block_size})) "
            f"holds visible keys but its entry is {int(block_tables[b, i])} "
            f"(expected a page id in [0, {P}))"
        )
    for name, addr in pages.items():
        a = addr[ids]
        if not a.all() or (a & np.uint64(alignment - 1)).any():
            k = int(np.argmax((a == 0) | (a % alignment != 0)))
            b, i = np.argwhere(read)[k]
            what = "0 (no page)" if a[k] == 0 else f"{int(a[k]):#x}, not {alignment}-byte aligned"
            raise ValueError(
                f"{name}: page {int(ids[k])} (block_tables row {b}, block {i}) is read but its address is {what}"
            )


U8 = np.dtype(np.uint8)
# bits per element of the page formats (ONNX TensorProto element type codes):
# float32, float16, bfloat16, uint8, int8, uint4, int4, uint2, int2
FORMAT_BITS = {1: 32, 10: 16, 16: 16, 2: 8, 3: 8, 21: 4, 22: 4, 25: 2, 26: 2}
FLOAT_FORMATS = frozenset((1, 10, 16))


def page_formats(name, formats, n_pages, head_size):
    """Check a per-page format table: uint8 [n_pages] of FORMAT_BITS codes, each
    present format packing a token's head_size codes into whole bytes
    (head_size * bits % 8 == 0)."""
    array(name, formats, (U8,), shape=(n_pages,))
    present = np.unique(formats)
    for code in present.tolist():
        if code not in FORMAT_BITS:
            page = int(np.argmax(formats == code))
            raise ValueError(
                f"{name}: page {page} has format code {code}, expected one of "
                f"{sorted(FORMAT_BITS)} (ONNX element types float32, uint8, int8, float16, "
                "bfloat16, uint4, int4, uint2, int2)"
            )
        if head_size * FORMAT_BITS[code] % 8:
            raise ValueError(
                f"{name}: format code {code} ({FORMAT_BITS[code]} bits) needs head_size * bits to be "
                f"a multiple of 8, got head_size {head_size}"
            )
    return formats


def scale_group(name, group, head_size):
    """Check a quantized plane's scale groups per head: 1 (per-head) or head_size (per-channel)."""
    if isinstance(group, (bool, np.bool_)) or not isinstance(group, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(group).__name__}")
    if group not in (1, head_size):
        raise ValueError(f"{name}: must be 1 (per-head scales) or the head size {head_size} (per-channel), got {group}")
    return int(group)


#: Header kinds of quantized pages: float32 scale and zero point per group, the compact header
#: (quant.h), or the channel-zero-point header (quant.h: one scale per head, a zero point per group).
HEADERS = ("float32", "compact", "channel-zp")
#: Kind codes of header_kind, in the order of HEADERS (attention.h okv_attn_args.k_hdr).
HDR_FLOAT32, HDR_COMPACT, HDR_CZP = 0, 1, 2
#: Most groups per head of a compact header (quant.h OKV_Q_COMPACT_MAX_G).
COMPACT_MAX_GROUPS = 512


def header_kind(name, header, group):
    """Check a quantized plane's header kind (one of HEADERS; "compact" with at most
    COMPACT_MAX_GROUPS groups per head); returns its code (HDR_FLOAT32, HDR_COMPACT or HDR_CZP)."""
    if not isinstance(header, str) or header not in HEADERS:
        raise ValueError(f"{name}: expected one of {', '.join(repr(h) for h in HEADERS)}, got {header!r}")
    if header == "compact" and group > COMPACT_MAX_GROUPS:
        raise ValueError(f"{name}: a compact header holds at most {COMPACT_MAX_GROUPS} groups per head, got {group}")
    return HEADERS.index(header)
