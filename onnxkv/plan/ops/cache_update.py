"""``ai.onnxkv::CacheUpdate``: write new positions into a cache, in place.

``CacheUpdate(cache, values, position) -> updated_cache``

* ``cache`` [B, H, capacity, D]: the caller's (or the state's) storage; output
  0 is declared ``MUST_ALIAS`` of input 0: the kernel writes into it and
  returns it.  No output is allocated and there is never a silent copy.
* ``values`` [B, H, S, D] of the cache's element type: the new positions.
* ``position``: int scalar (all rows) or [B] (per row), the first position
  written; ``[position, position + S)`` must lie inside ``capacity``.

Rejected before anything is written: an initializer cache (at build time), a
read-only array, an array viewing only part of a larger buffer (the rest is
reachable through other live views), storage bound to a state other than the one
running, shape or dtype mismatches, and ``position + S > capacity``
(:class:`~onnxkv.errors.CacheCapacityError`, no growth).  The plan checks
after the node that the output is the input's storage.

After a failure or cancellation later in the run: a state's storage is put
back as it was (the node saves the positions it overwrites,
:meth:`~onnxkv.plan.context.RunContext.preserve`); a caller's array in a
plain ``Session.run`` is the node's output (MUST_ALIAS), so the positions
the node wrote stay written.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from onnxkv.cache import bound
from onnxkv.errors import CacheCapacityError, InputError
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["CacheUpdate", "check_writable_target"]


def _partial_view(array: np.ndarray) -> bool:
    """True if ``array`` views only part of a larger buffer (other views may read the rest)."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root is array:
        return False
    return root.nbytes != array.nbytes or root.__array_interface__["data"][0] != array.__array_interface__["data"][0]


def check_writable_target(cache: np.ndarray, name: str, rt, fail: Callable[[str], Exception]) -> None:
    """Raise ``fail(message)`` unless ``cache`` (input ``name``) may be written in place (MUST_ALIAS).

    Accepted: a writable C-contiguous array that is either the running state's
    own storage for ``name`` (``rt.caches``) or an array owning its whole buffer
    that no state has bound.
    """
    if not cache.flags.writeable:
        raise fail(f"cache '{name}' is read-only; MUST_ALIAS needs writable storage")
    own = rt.caches is not None and name in rt.caches
    if not own:
        if bound.is_bound(cache):
            raise fail(f"cache '{name}' is storage bound to a state")
        if _partial_view(cache):
            raise fail(
                f"cache '{name}' is a view of part of other storage (shared); pass an array that owns its memory"
            )
    if not cache.flags.c_contiguous:
        raise fail(f"cache '{name}' must be C-contiguous")


@register("CacheUpdate", domain="ai.onnxkv")
class CacheUpdate(Op):
    view_inputs = (0,)
    must_alias = ((0, 0),)

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        if len(node.input) != 3 or len(node.output) != 1:
            raise self.error("expects inputs (cache, values, position) and one output")
        if ctx.constant(node.input[0]) is not None:
            raise self.error(f"cache input '{node.input[0]}' is an initializer; MUST_ALIAS needs writable storage")
        self.cache_name = node.input[0]

    def _fail(self, message: str) -> InputError:
        return InputError(f"CacheUpdate node '{self.name}': {message}")

    def run(self, inputs: list, rt) -> tuple:
        cache, values, position = inputs
        if cache.ndim != 4 or values.ndim != 4:
            raise self._fail(f"cache and values must be 4-D, got {cache.shape} and {values.shape}")
        b, h, cap, d = cache.shape
        if values.shape[:2] != (b, h) or values.shape[3] != d:
            raise self._fail(f"values shape {values.shape} does not fit cache shape {cache.shape}")
        if values.dtype != cache.dtype:
            raise self._fail(f"values dtype {values.dtype} differs from cache dtype {cache.dtype}")
        check_writable_target(cache, self.cache_name, rt, self._fail)
        pos = np.asarray(position)
        if pos.dtype.kind not in "iu" or pos.ndim > 1 or (pos.ndim == 1 and pos.shape != (b,)):
            raise self._fail(f"position must be an int scalar or [{b}] ints, got {pos.dtype} {pos.shape}")
        s = values.shape[2]
        starts = np.broadcast_to(pos.astype(np.int64), (b,))
        if starts.min(initial=0) < 0:
            raise self._fail(f"position must be >= 0, got {pos.tolist()}")
        end = int(starts.max(initial=0)) + s
        if end > cap:
            raise CacheCapacityError(
                f"CacheUpdate node '{self.name}': position {pos.tolist()} + {s} new positions "
                f"exceeds the capacity {cap} of '{self.cache_name}'"
            )
        if pos.ndim == 0:
            p = int(pos)
            rt.preserve(cache, np.s_[:, :, p : p + s])
            cache[:, :, p : p + s] = values
        else:
            for row in range(b):
                p = int(starts[row])
                rt.preserve(cache, np.s_[row, :, p : p + s])
                cache[row, :, p : p + s] = values[row]
        rt.count(append_copied_bytes=values.nbytes)
        return (cache,)
