"""Argument checks shared by the kernel wrappers (pure Python, no onnxkv imports).

Every check raises ``ValueError`` naming the argument, and all checks of a
kernel run before the kernel writes anything.
"""
import numpy as np

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
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.dtype == b.dtype)
