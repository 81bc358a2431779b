"""``ai.rt::QuantizePagedCache``: give selected pages of an explicit paged KV cache new formats, in place.

``QuantizePagedCache(cache, block_indices, key_scale, key_zero_point, value_scale, value_zero_point)
-> quantized_cache``

* ``cache`` [P, 2, Hkv, bs, D] float32/float16: ``ai.rt::PagedAttention``'s
  ``past`` (index 0 keys, 1 values; pages indexed by the caller's block
  tables).  Output 0 is ``MUST_ALIAS`` of input 0: the same tensor, returned.
* ``block_indices`` [N] int32/int64: distinct page ids in ``[0, P)``, the
  pages converted in both planes (N = 0: nothing happens).
* ``key_zero_point`` / ``value_zero_point``: the element type selects the
  plane's new format -- INT8, UINT8, INT4, UINT4, INT2 or UINT2 quantizes
  (values in the type's range), FLOAT, FLOAT16 or BFLOAT16 is a marker
  (any shape, e.g. [0]) converting the pages to that float type (a
  quantized page is dequantized; a page already in it is left alone, so the
  cache's own type leaves the native pages of that plane untouched).
* ``key_scale`` / ``value_scale`` float32: for an integer format, the shape
  of its zero point, ``[N, Hkv]`` (one scale per page and head) or ``[N,
  Hkv, D]`` (per page, head and channel: the KIVI choice for keys), every
  scale finite and > 0; ignored (any shape, may be empty) for a float marker.
  One granularity per plane: pages quantized earlier that stay quantized
  must have the same one.  Quantization follows ONNX QuantizeLinear
  (round half to even, saturate to the code range); a page is rebuilt from
  its current values in whatever format it holds.
* attribute ``key_channel_zero_points`` (int, default 0): 1 stores the key
  plane's quantized pages with channel-zp headers (see
  :mod:`onnxkv.cache.formats`: one scale per head, one zero point per
  channel, what the paged attention kernel scores with its per-head path).
  ``key_scale`` must then be ``[N, Hkv, D]`` with every scale of a head
  equal (InputError naming the element otherwise) and ``key_zero_point``
  ``[N, Hkv, D]`` of the format's element type (a zero-point unit of 1).

The page formats live in the cache's handle, a
:class:`~onnxkv.cache.page_set.PageSet` attached to the tensor (made here on
first use): unselected pages keep their storage, a selected page gets one
payload allocated once (from the running state's allocator, else a system
allocator) or, converted back to the cache's own type, returns to its slot of
the tensor.  The tensor slot a page leaves is filled with NaN (when the run
succeeds, see below).  Every
check -- shapes, dtypes, indices, scale and zero point values, granularity,
and OutOfMemory while building -- happens before anything is published: an
error names the node, the value and what was expected, and leaves the cache
(tensor bytes, formats, payloads) as it was.  ``PagedAttention`` then reads
every page in its own format and writes new tokens only into pages of the
cache's own type: a write into a converted page is rejected, so quantize only
full pages (pages no later token goes to).  Events: the node's ``execute``
event counts ``allocations`` / ``allocated_bytes`` of the new payloads and
``dequantized_bytes`` of quantized payloads read to rebuild pages.

In a state.  A persistent cache is one graph input (``past <- present``
bound), so the natural place of this node is the decoder itself, between the
cache input and ``PagedAttention``, with the parameters as optional inputs
whose defaults are empty: decode steps feed nothing and the node does nothing;
a step that feeds ``block_indices`` and parameters converts those pages before
the attention of the same step reads them.  :func:`onnxkv.zoo.paged.build_paged_model`
builds that form (``key_format`` / ``value_format``).  The new pages are
read by the rest of the run at once, but the conversion is staged
(:meth:`~onnxkv.plan.context.RunContext.defer`): the replaced payloads are
freed and vacated slots filled with NaN only when the whole run succeeds; a
later failure or cancellation of the same run restores every page, format
and payload as before the node.  The storage of a
state cannot be converted from outside it: like every in-place operator, the
node rejects a cache bound to a state other than the running one.  A
caller's cache in a plain ``Session.run`` is the node's output (MUST_ALIAS):
its conversion is not staged and stays when a later node fails, as the
positions ``PagedCacheUpdate`` / ``PagedAttention`` write into it do.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv.cache import formats
from onnxkv.cache.page_set import PageSet, PlaneTarget
from onnxkv.errors import InputError
from onnxkv.model.shape_inference import OPERATOR_ALIASES
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops.paged import check_cache_target
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["QuantizePagedCache"]

_INTEGER = ("int8", "uint8", "int4", "uint4", "int2", "uint2")
_MARKERS = ("float32", "float16", "bfloat16")
_CACHE_TYPES = (np.dtype(np.float32), np.dtype(np.float16))


@register("QuantizePagedCache", domain="ai.rt")
class QuantizePagedCache(Op):
    """Kernel object of one QuantizePagedCache node (see the module docstring)."""

    view_inputs = (0,)
    must_alias = OPERATOR_ALIASES[("ai.rt", "QuantizePagedCache")]

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        if len(node.input) != 6 or not all(node.input) or len(node.output) != 1 or not node.output[0]:
            raise self.error(
                "expects inputs (cache, block_indices, key_scale, key_zero_point, value_scale, "
                "value_zero_point) and one output"
            )
        if ctx.constant(node.input[0]) is not None:
            raise self.error(f"cache input '{node.input[0]}' is an initializer; MUST_ALIAS needs writable storage")
        self.cache_name = node.input[0]
        czp = self.attrs.get("key_channel_zero_points", 0)
        if czp not in (0, 1):
            raise self.error(f"attribute key_channel_zero_points must be 0 or 1, got {czp!r}")
        #: Header kind of the key plane's quantized pages.
        self.key_header = formats.HEADER_CHANNEL_ZP if czp else formats.HEADER_FLOAT32

    def _fail(self, message: str) -> InputError:
        return InputError(f"QuantizePagedCache node '{self.name}': {message}")

    def _target(
        self,
        scale: np.ndarray,
        zero_point: np.ndarray,
        scale_name: str,
        zp_name: str,
        header: str = formats.HEADER_FLOAT32,
    ) -> PlaneTarget:
        kind = zero_point.dtype.name
        if kind in _MARKERS:
            return PlaneTarget(kind)
        if kind not in _INTEGER:
            raise self._fail(
                f"zero point '{zp_name}' has element type {kind}; expected one of "
                f"{', '.join(_INTEGER)} (quantize) or {', '.join(_MARKERS)} (a float marker)"
            )
        if scale.dtype != np.float32:
            raise self._fail(f"scale '{scale_name}' must be float32, got {scale.dtype}")
        return PlaneTarget(
            kind, scale, zero_point.astype(np.float32), (f"scale '{scale_name}'", f"zero point '{zp_name}'"), header
        )

    def run(self, inputs: list, rt: RunContext) -> tuple[np.ndarray]:
        cache, indices, key_scale, key_zp, value_scale, value_zp = inputs
        names = self.node.input
        if cache.ndim != 5 or cache.shape[1] != 2 or cache.dtype not in _CACHE_TYPES or 0 in cache.shape:
            raise self._fail(
                f"cache '{self.cache_name}' must be float32/float16 [num_pages, 2, kv_heads, "
                f"block_size, head_size] with every dim >= 1, got {cache.dtype} {list(cache.shape)}"
            )
        check_cache_target(cache, self.cache_name, rt, self._fail)
        if indices.ndim != 1 or indices.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise self._fail(
                f"block_indices '{names[1]}' must be int32/int64 [N], got {indices.dtype} {list(indices.shape)}"
            )
        targets = [
            self._target(key_scale, key_zp, names[2], names[3], self.key_header),
            self._target(value_scale, value_zp, names[4], names[5]),
        ]
        if indices.size == 0:
            return (cache,)
        handle = PageSet.attach(cache, rt.cache_allocator)
        cost = handle.convert(
            indices,
            targets,
            f"QuantizePagedCache node '{self.name}'",
            f"block_indices '{names[1]}'",
            staged=rt.holds(cache),
        )
        rt.defer(cost.commit, cost.rollback)
        rt.count(
            allocations=cost.allocations, allocated_bytes=cost.allocated_bytes, dequantized_bytes=cost.dequantized_bytes
        )
        return (cache,)
