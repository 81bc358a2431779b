"""The data of build-time constants as kernels read it: aligned, and released once a kernel holds a copy.

Initializers may be memory maps of the model's files (external data, and the
large inline tensors :mod:`onnxkv.model.inline_data` leaves in the model
file).  An inline tensor's bytes start wherever protobuf put them, so most
such maps are not aligned to their element size: NumPy reads them as they
are, but a compiled kernel reading a misaligned ``float *`` has undefined
behaviour.  Every place a constant reaches a kernel (a kernel object's
:meth:`~onnxkv.plan.registry.BuildContext.constant`, the plan's run-time
values, constant folding) takes it through :func:`kernel_view`.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["kernel_view", "release_pages"]


def release_pages(w) -> None:
    """Drop this process's resident pages of ``w`` if it is a read-only file mapping (a copy replaces it
    for the caller; any later reader faults the pages back in from the file).  Anything else is left
    alone."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    mapping = getattr(w, "_mmap", None)
    if isinstance(w, np.memmap) and w.mode == "r" and advice is not None and hasattr(mapping, "madvise"):
        mapping.madvise(advice)


#: Copies of at least this many bytes get pages of their own (see :func:`kernel_view`).
OWN_PAGES_BYTES = 1 << 20


def kernel_view(a):
    """``a`` itself when it is not an array or is aligned to its element size; else a read-only aligned copy
    (the pages of a file mapping released, see :func:`release_pages`).  A copy of at least
    :data:`OWN_PAGES_BYTES` lives in an anonymous mapping of its own, returned to the system when the copy
    is freed: a weight a kernel packs is copied only for the packing, and the C heap would keep such
    transient blocks (glibc raises its mmap threshold after the first large free)."""
    if not isinstance(a, np.ndarray) or a.flags.aligned:
        return a
    if a.nbytes >= OWN_PAGES_BYTES:
        copy = np.frombuffer(mmap.mmap(-1, a.nbytes), a.dtype).reshape(a.shape)
    else:
        copy = np.empty(a.shape, a.dtype)
    np.copyto(copy, a)
    copy.flags.writeable = False
    release_pages(a)
    return copy
