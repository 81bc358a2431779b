"""Paged KV caches stated explicitly in the graph: ``ai.onnxkv::PagedCacheUpdate`` and ``ai.rt::PagedAttention``.

A paged cache is an ordinary tensor of pages plus a *block table*
``[B, M]`` (int32/int64) mapping logical block ``i`` of row ``b`` (tokens
``[i*bs, (i+1)*bs)``) to a page index.  Inside a page the layout is head-major
(one head's ``bs`` tokens are contiguous).  Logical position ``t`` of row ``b``
lives at page ``table[b, t // bs]``, offset ``t % bs``.

``PagedCacheUpdate(cache, page_id, values, position) -> updated_cache``

* ``cache`` [P, H, bs, D]: the pages; output 0 is ``MUST_ALIAS`` of input 0
  (written in place and returned, never allocated or copied).
* ``page_id`` [B, M] int32/int64: the block table.
* ``values`` [B, H, S, D], the cache's element type: the new tokens.
* ``position`` int scalar (all rows) or [B]: row ``b``'s tokens go to logical
  positions ``position[b] .. position[b] + S - 1``.
* attribute ``block_size`` (required) = ``bs``.

``PagedAttention(Q, K, V, past, block_table, seqlens_k) -> (Y, present)``

* ``Q`` [B, S, Hq*D]; ``K``/``V`` [B, S, Hkv*D] (the new tokens), float32 or
  float16, one dtype for all.
* ``past`` [P, 2, Hkv, bs, D] of Q's dtype: index 0 keys, 1 values; output 1
  (``present``) is ``MUST_ALIAS`` of input 3.
* ``block_table`` [B, M] int32/int64; ``seqlens_k`` [B] ints: tokens already in
  the cache per row.
* attributes: ``num_heads`` (Hq), ``kv_num_heads`` (Hkv), ``block_size`` (bs),
  ``max_tokens`` (capacity per row, ``<= M*bs`` and ``<= 2**31 - 1``: the
  kernels take int32 positions), ``is_causal`` (default 1),
  ``left_window_size`` (default -1 = none; ``>= max_tokens`` is the same as
  none), ``scale`` (default / 0: ``1/sqrt(D)``), ``softcap`` (default 0 = off).
* The new K/V are written into the pages at positions
  ``seqlens_k[b] .. seqlens_k[b] + S - 1``; then query ``s`` of row ``b``, at
  position ``p = seqlens_k[b] + s``, attends over keys ``j < seqlens_k[b] + S``
  with ``j <= p`` (``is_causal=1``) and ``j >= p - left_window_size`` (when
  ``>= 0``).  ``is_causal=0`` (every query sees every key of its row) cannot be
  combined with a window.  Scores: ``scale * q.k``, then
  ``softcap * tanh(score / softcap)``, then softmax (float32 math).
  ``Y`` [B, S, Hq*D] has Q's dtype.

Per-page formats.  ``ai.rt::QuantizePagedCache`` (see
:mod:`onnxkv.plan.ops.quantize_paged_cache`) attaches a
:class:`~onnxkv.cache.page_set.PageSet` to a cache tensor and converts some
of its pages to other formats (quantized, or another float type).  Both
operators look that handle up: attention reads every page in its own format
through the paged kernel (quantized pages are dequantized in its load step),
and new tokens go only into pages still in the cache's own type -- a write
into a converted page is an :class:`~onnxkv.errors.InputError` raised before
anything is written (requantize only full pages).  The cache may reach these
nodes through ``QuantizePagedCache``'s output: a state's storage is
recognised by its address, whatever the value's name.

In a state (the cache is a contract-declared persistent value) both kernels
save the slots they overwrite before writing them, and a failure or
cancellation later in the run writes them back
(:meth:`~onnxkv.plan.context.RunContext.preserve`); a caller's cache in a
plain ``Session.run`` is the node's output (MUST_ALIAS) and keeps the slots a
node wrote.

Both kernels validate everything before writing a byte: shapes and dtypes,
that the cache may be written in place (not read-only, not part of a larger
buffer, not bound to another state, C-contiguous; an initializer cache is a
ModelError at build time), ``position``/``seqlens_k`` (any integer dtype,
compared in its own width before any conversion or sum: never wrapped) in
``[0, capacity - S]`` (a negative one is an InputError, one past the capacity a
:class:`~onnxkv.errors.CacheCapacityError`), every block-table entry the call
reads or writes in ``[0, P)``, and that no two (row, token) writes hit the same
physical slot.  Attention reads the pages in place through
``onnxkv._kernels.paged_attention`` when every page is 64-byte aligned (no
gather); otherwise it gathers only the blocks that hold visible keys into a
contiguous copy for :func:`~onnxkv.plan.ops._attention_math.causal_attention`
(with converted pages: each used page read in its own format).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np
import onnx

from onnxkv import _kernels
from onnxkv._kernels import _validate as V
from onnxkv.cache import formats
from onnxkv.cache.page_set import PageSet
from onnxkv.errors import CacheCapacityError, InputError
from onnxkv.model.shape_inference import OPERATOR_ALIASES
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops._attention_math import causal_attention
from onnxkv.plan.ops.cache_update import check_writable_target
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["PagedCacheUpdate", "PagedAttention", "check_cache_target"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))
_TABLE_TYPES = (np.dtype(np.int32), np.dtype(np.int64))
#: Largest ``max_tokens``: the attention kernels take int32 lengths and positions.
_MAX_TOKENS = V.I32_MAX
#: Page alignment the paged attention kernel needs to read pages in place.
_PAGE_ALIGNMENT = 64


def check_cache_target(cache: np.ndarray, name: str, rt: RunContext, fail: Callable[[str], Exception]) -> None:
    """:func:`~onnxkv.plan.ops.cache_update.check_writable_target` for a paged cache that may be the running
    state's storage under another value name (e.g. the output of ``QuantizePagedCache``)."""
    if rt.caches is not None and name not in rt.caches:
        address = cache.__array_interface__["data"][0]
        for key, held in rt.caches.items():
            if (
                isinstance(held, np.ndarray)
                and held.shape == cache.shape
                and held.dtype == cache.dtype
                and held.__array_interface__["data"][0] == address
            ):
                name = key
                break
    check_writable_target(cache, name, rt, fail)


def _reject_converted(handle: PageSet | None, pages: np.ndarray, name: str, fail: Callable[[str], Exception]) -> None:
    """Raise ``fail`` if a page of ``pages`` (being written) is converted in some plane of ``handle``."""
    if handle is None or not handle.any_converted:
        return
    hit = handle.converted()[:, pages]
    if hit.any():
        plane, i = (int(x) for x in np.argwhere(hit)[0])
        page = int(pages[i])
        fmt = formats.page_format(int(handle.formats[plane, page])).name
        raise fail(
            f"a new token goes to page {page} of cache '{name}', which QuantizePagedCache converted to "
            f"{fmt} (plane {plane}); new tokens go only into pages of the cache's own type "
            f"{handle.native.name} (quantize only full pages)"
        )


def _block_table(table: np.ndarray, name: str, batch: int, fail: Callable[[str], Exception]) -> np.ndarray:
    """The block table as int64 [B, M] after checking its dtype and shape (entries are checked on use)."""
    table = np.asarray(table)
    if table.dtype not in _TABLE_TYPES or table.ndim != 2 or table.shape[0] != batch or table.shape[1] < 1:
        raise fail(
            f"block table '{name}' must be int32/int64 [{batch}, max_blocks >= 1], got {table.dtype} {table.shape}"
        )
    return table.astype(np.int64, copy=False)


def _blocks_used(first: np.ndarray, end: np.ndarray, max_blocks: int) -> np.ndarray:
    """Bool [B, max_blocks]: row ``b`` uses logical blocks ``first[b] <= i < end[b]``."""
    blocks = np.arange(max_blocks)[None, :]
    return (blocks >= first[:, None]) & (blocks < end[:, None])


def _check_pages(
    table: np.ndarray, name: str, used: np.ndarray, num_pages: int, fail: Callable[[str], Exception]
) -> None:
    """Every used entry of ``table`` (``used`` from :func:`_blocks_used`) must be a page index in ``[0, num_pages)``."""
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        row, block = (int(x) for x in np.argwhere(bad)[0])
        blocks = np.flatnonzero(used[row])
        raise fail(
            f"block table '{name}'[{row}, {block}] = {int(table[row, block])} is not a page index in "
            f"[0, {num_pages}) (row {row} uses logical blocks {int(blocks[0])}..{int(blocks[-1])})"
        )


def _write_slots(
    table: np.ndarray, name: str, starts: np.ndarray, count: int, block_size: int, fail: Callable[[str], Exception]
) -> tuple[np.ndarray, np.ndarray]:
    """(page [B*S], offset [B*S]) of each row's tokens ``starts[b] .. starts[b] + count - 1``.

    The table entries must already be valid pages; raises ``fail`` when two
    (row, token) writes land in the same physical slot.
    """
    positions = starts[:, None] + np.arange(count)[None, :]
    pages = np.take_along_axis(table, positions // block_size, axis=1).reshape(-1)
    offsets = (positions % block_size).reshape(-1)
    slots = pages * block_size + offsets
    order = np.argsort(slots, kind="stable")
    same = np.flatnonzero(slots[order][1:] == slots[order][:-1])
    if same.size:
        a, b = (divmod(int(order[i]), count) for i in (same[0], same[0] + 1))
        raise fail(
            f"rows {a[0]} and {b[0]} write logical positions {int(positions[a])} and {int(positions[b])} "
            f"to the same physical slot (page {int(pages[order[same[0]]])}, offset "
            f"{int(offsets[order[same[0]]])}) through block table '{name}'"
        )
    return pages, offsets


def _starts(
    values: np.ndarray,
    name: str,
    batch: int,
    scalar_ok: bool,
    count: int,
    limit: int,
    capacity: str,
    fail: Callable[..., Exception],
) -> np.ndarray:
    """Per-row start positions as int64 [B] (an int scalar broadcasts when ``scalar_ok``) after checking, in
    the tensor's own integer width, that each row's ``count`` new tokens fit positions ``[0, limit)``.

    Any signed or unsigned integer dtype is accepted.  A negative start raises ``fail(message)``, a start
    above ``limit - count`` ``fail(message, CacheCapacityError)`` naming ``capacity`` (what ``limit``
    is); the returned int64 values are exact and ``starts + count`` cannot overflow.
    """
    arr = np.asarray(values)
    if (
        arr.dtype.kind not in "iu"
        or arr.ndim > 1
        or (arr.ndim == 1 and arr.shape != (batch,))
        or (arr.ndim == 0 and not scalar_ok)
    ):
        expected = f"an int scalar or [{batch}] ints" if scalar_ok else f"[{batch}] ints"
        raise fail(f"'{name}' must be {expected}, got {arr.dtype} {arr.shape}")
    rows = np.broadcast_to(arr, (batch,))
    bad = V.outside(rows, 0, limit - count)
    if bad.any():
        row = int(np.argmax(bad))
        value = int(rows[row])
        valid = f"expected [0, {limit - count}]" if limit >= count else f"no start fits {count} new tokens"
        if value < 0:
            raise fail(f"'{name}'[{row}] = {value} must be >= 0 ({valid})")
        raise fail(f"'{name}'[{row}] = {value} + {count} new tokens exceeds {capacity} ({valid})", CacheCapacityError)
    return rows.astype(np.int64)


@register("PagedCacheUpdate", domain="ai.onnxkv")
class PagedCacheUpdate(Op):
    """Kernel object of one PagedCacheUpdate node (see the module docstring)."""

    view_inputs = (0,)
    must_alias = OPERATOR_ALIASES[("ai.onnxkv", "PagedCacheUpdate")]

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        if len(node.input) != 4 or len(node.output) != 1 or not all(node.input):
            raise self.error("expects inputs (cache, page_id, values, position) and one output")
        if ctx.constant(node.input[0]) is not None:
            raise self.error(f"cache input '{node.input[0]}' is an initializer; MUST_ALIAS needs writable storage")
        self.block_size = int(self.attrs.get("block_size", 0))
        if self.block_size <= 0:
            raise self.error(f"attribute block_size is required and must be positive, got {self.block_size}")
        self.cache_name, self.table_name, self.values_name, self.position_name = node.input

    def _fail(self, message: str, error: type[Exception] = InputError) -> Exception:
        return error(f"PagedCacheUpdate node '{self.name}': {message}")

    def run(self, inputs: list, rt: RunContext) -> tuple[np.ndarray]:
        cache, page_id, values, position = inputs
        if cache.ndim != 4 or cache.shape[2] != self.block_size:
            raise self._fail(
                f"cache '{self.cache_name}' must be [num_pages, heads, block_size={self.block_size}, "
                f"head_size], got {cache.shape}"
            )
        num_pages, heads, bs, d = cache.shape
        if values.ndim != 4 or values.shape[1] != heads or values.shape[3] != d:
            raise self._fail(
                f"values '{self.values_name}' shape {values.shape} does not fit cache shape "
                f"{cache.shape} (expected [batch, {heads}, new, {d}])"
            )
        if values.dtype != cache.dtype:
            raise self._fail(f"values '{self.values_name}' dtype {values.dtype} differs from cache dtype {cache.dtype}")
        check_cache_target(cache, self.cache_name, rt, self._fail)
        b, _, s, _ = values.shape
        table = _block_table(page_id, self.table_name, b, self._fail)
        max_tokens = table.shape[1] * bs
        starts = _starts(
            position,
            self.position_name,
            b,
            True,
            s,
            max_tokens,
            f"max_tokens = {max_tokens} ({table.shape[1]} blocks of {bs}) of '{self.table_name}'",
            self._fail,
        )
        if s == 0:
            return (cache,)
        used = _blocks_used(starts // bs, (starts + s - 1) // bs + 1, table.shape[1])
        _check_pages(table, self.table_name, used, num_pages, self._fail)
        pages, offsets = _write_slots(table, self.table_name, starts, s, bs, self._fail)
        _reject_converted(PageSet.of(cache), pages, self.cache_name, self._fail)
        rt.preserve(cache, np.s_[pages, :, offsets])
        cache[pages, :, offsets] = values.transpose(0, 2, 1, 3).reshape(b * s, heads, d)
        rt.count(append_copied_bytes=values.nbytes)
        return (cache,)


@register("PagedAttention", domain="ai.rt")
class PagedAttention(Op):
    """Kernel object of one PagedAttention node (see the module docstring)."""

    view_inputs = (3,)
    must_alias = OPERATOR_ALIASES[("ai.rt", "PagedAttention")]

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        if len(node.input) != 6 or not all(node.input) or len(node.output) != 2 or not node.output[1]:
            raise self.error("expects inputs (Q, K, V, past, block_table, seqlens_k) and outputs (Y, present)")
        if ctx.constant(node.input[3]) is not None:
            raise self.error(f"past input '{node.input[3]}' is an initializer; MUST_ALIAS needs writable storage")
        a = self.attrs
        self.num_heads = int(a.get("num_heads", 0))
        self.kv_num_heads = int(a.get("kv_num_heads", 0))
        self.block_size = int(a.get("block_size", 0))
        self.max_tokens = int(a.get("max_tokens", 0))
        for attr in ("num_heads", "kv_num_heads", "block_size", "max_tokens"):
            if getattr(self, attr) <= 0:
                raise self.error(f"attribute {attr} is required and must be positive, got {getattr(self, attr)}")
        if self.max_tokens > _MAX_TOKENS:
            raise self.error(
                f"attribute max_tokens must be at most {_MAX_TOKENS} (positions are int32), got {self.max_tokens}"
            )
        if self.num_heads % self.kv_num_heads:
            raise self.error(f"num_heads={self.num_heads} must be a multiple of kv_num_heads={self.kv_num_heads}")
        self.is_causal = int(a.get("is_causal", 1))
        self.window = int(a.get("left_window_size", -1))
        if self.is_causal not in (0, 1):
            raise self.error(f"is_causal must be 0 or 1, got {self.is_causal}")
        if self.window < -1:
            raise self.error(f"left_window_size must be >= -1 (-1 = no window), got {self.window}")
        if not self.is_causal and self.window >= 0:
            raise self.error(f"left_window_size={self.window} needs is_causal=1 (a non-causal query sees every key)")
        if self.window >= self.max_tokens:  # excludes no key (positions < max_tokens): the same as no window
            self.window = -1
        self.scale = float(a.get("scale", 0.0))
        self.softcap = float(a.get("softcap", 0.0))
        if self.softcap < 0:
            raise self.error(f"softcap must be >= 0, got {self.softcap}")
        self.past_name = node.input[3]

    def _fail(self, message: str, error: type[Exception] = InputError) -> Exception:
        return error(f"PagedAttention node '{self.name}': {message}")

    def run(self, inputs: list, rt: RunContext) -> Sequence[np.ndarray]:
        query, key, value, past, block_table, seqlens_k = inputs
        q, k, v = self._split(query, key, value)
        b, hq, s, d = q.shape
        hkv, bs = self.kv_num_heads, self.block_size
        want = (past.shape[0] if past.ndim == 5 else -1, 2, hkv, bs, d)
        if past.shape != want:
            raise self._fail(
                f"past '{self.past_name}' must be [num_pages, 2, kv_num_heads, block_size, head_size]="
                f"{list(want)}, got {past.shape}"
            )
        if past.dtype != query.dtype:
            raise self._fail(f"past '{self.past_name}' dtype {past.dtype} differs from Q dtype {query.dtype}")
        check_cache_target(past, self.past_name, rt, self._fail)
        names = self.node.input
        table = _block_table(block_table, names[4], b, self._fail)
        if self.max_tokens > table.shape[1] * bs:
            raise self._fail(
                f"max_tokens={self.max_tokens} exceeds the {table.shape[1]} blocks of {bs} tokens of "
                f"block table '{names[4]}'"
            )
        past_lens = _starts(
            seqlens_k, names[5], b, False, s, self.max_tokens, f"max_tokens = {self.max_tokens}", self._fail
        )
        kv_len = past_lens + s
        y = rt.empty(0, (b, s, hq * d), query.dtype)
        if s == 0 or b == 0:  # no query reads a key, no token is written: no table entry is used
            return y, past
        used = _blocks_used(self._first_visible(past_lens) // bs, (kv_len + bs - 1) // bs, table.shape[1])
        _check_pages(table, names[4], used, past.shape[0], self._fail)
        pages, offsets = _write_slots(table, names[4], past_lens, s, bs, self._fail)
        handle = PageSet.of(past)
        _reject_converted(handle, pages, self.past_name, self._fail)
        rt.preserve(past, np.s_[pages, :, :, offsets])
        for index, new in ((0, k), (1, v)):
            past[:, index][pages, :, offsets] = new.transpose(0, 2, 1, 3).reshape(b * s, hkv, d)
        rt.count(append_copied_bytes=k.nbytes + v.nbytes)

        q_pos = past_lens[:, None] + np.arange(s)[None, :]
        if not self.is_causal:
            q_pos = np.broadcast_to((kv_len - 1)[:, None], (b, s))
        out = np.empty((b, hq, s, d), np.float32)
        scale = self.scale if self.scale != 0 else 1.0 / np.sqrt(d)
        self._attend(
            q.astype(np.float32),
            past,
            handle if handle is not None and handle.any_converted else None,
            table,
            used,
            kv_len,
            q_pos,
            scale,
            out,
            rt,
        )
        y.reshape(b, s, hq, d)[...] = out.transpose(0, 2, 1, 3)
        return y, past

    def _split(self, query: np.ndarray, key: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, ...]:
        """Q [B, Hq, S, D], K and V [B, Hkv, S, D] views after checking shapes and dtypes."""
        hq, hkv = self.num_heads, self.kv_num_heads
        names = self.node.input
        if query.ndim != 3 or query.shape[2] % hq:
            raise self._fail(
                f"Q '{names[0]}' must be [batch, seq, num_heads*head_size] with num_heads={hq}, got {query.shape}"
            )
        if query.dtype not in _FLOATS:
            raise self._fail(f"Q '{names[0]}' must be float32 or float16, got {query.dtype}")
        b, s, hidden = query.shape
        d = hidden // hq
        for name, t in ((names[1], key), (names[2], value)):
            if t.shape != (b, s, hkv * d):
                raise self._fail(
                    f"'{name}' must be [batch, seq, kv_num_heads*head_size]={[b, s, hkv * d]}, got {list(t.shape)}"
                )
            if t.dtype != query.dtype:
                raise self._fail(f"'{name}' dtype {t.dtype} differs from Q dtype {query.dtype}")
        return (
            query.reshape(b, s, hq, d).transpose(0, 2, 1, 3),
            key.reshape(b, s, hkv, d).transpose(0, 2, 1, 3),
            value.reshape(b, s, hkv, d).transpose(0, 2, 1, 3),
        )

    def _first_visible(self, past_lens: np.ndarray) -> np.ndarray:
        """Per row, the first key position any query of this call sees."""
        if self.window < 0:
            return np.zeros_like(past_lens)
        return np.maximum(past_lens - self.window, 0)

    def _attend(
        self,
        q: np.ndarray,
        past: np.ndarray,
        handle: PageSet | None,
        table: np.ndarray,
        used: np.ndarray,
        kv_len: np.ndarray,
        q_pos: np.ndarray,
        scale: float,
        out: np.ndarray,
        rt: RunContext,
    ) -> None:
        """Attention of float32 ``q`` over the ``used`` blocks of ``past`` into ``out`` [B, Hq, S, D].

        When every page half (K or V) is 64-byte aligned -- a state's storage is, when a half is a multiple
        of 64 bytes -- the streaming kernel reads the pages in place through the block table (unused
        entries passed as -1); with converted pages (``handle`` not None) it gets the handle's address and
        format tables (payloads are 64-byte aligned) and counts ``dequantized_bytes``.  Otherwise the used
        blocks are gathered into a contiguous [B, Hkv, T, D] copy from the first block any row uses (each
        page read in its own format when there is a handle); blocks a row does not use are gathered as
        page 0 and masked by the window / kv_len.
        """
        bs = self.block_size
        base = past.__array_interface__["data"][0]
        if base % _PAGE_ALIGNMENT == 0 and past.strides[1] % _PAGE_ALIGNMENT == 0:
            if handle is None:
                k_pages = np.uint64(base) + np.arange(past.shape[0], dtype=np.uint64) * np.uint64(past.strides[0])
                pages, per_page = (k_pages, k_pages + np.uint64(past.strides[1])), {}
            else:
                pages = (handle.ptrs[0], handle.ptrs[1])
                per_page = {
                    "k_formats": handle.formats[0],
                    "v_formats": handle.formats[1],
                    "k_group": max(handle.groups[0], 1),
                    "v_group": max(handle.groups[1], 1),
                    "k_header": handle.headers[0],
                }
            with handle.lock if handle is not None else contextlib.nullcontext():  # no payload freed meanwhile
                stats = _kernels.paged_attention(
                    np.ascontiguousarray(q),
                    *pages,
                    np.where(used, table, -1).astype(np.int32),
                    bs,
                    self.kv_num_heads,
                    kv_len.astype(np.int32),
                    np.ascontiguousarray(q_pos, dtype=np.int32),
                    float(scale),
                    self.softcap,
                    self.window,
                    out,
                    kv_dtype=past.dtype.name,
                    **per_page,
                )
            if handle is not None:
                rt.count(dequantized_bytes=stats["dequantized_bytes"])
            return
        columns = np.flatnonzero(used.any(axis=0))
        lo, hi = int(columns[0]), int(columns[-1]) + 1
        ids = np.where(used, table, 0)[:, lo:hi]
        shape = (q.shape[0], self.kv_num_heads, (hi - lo) * bs, past.shape[4])
        if handle is None:
            keys, values = past[ids, 0], past[ids, 1]
        else:
            read = np.unique(ids)
            where = np.searchsorted(read, ids)
            keys, values = (np.stack([handle.page_values(plane, int(p)) for p in read])[where] for plane in (0, 1))
        keys = keys.transpose(0, 2, 1, 3, 4).reshape(shape)
        values = values.transpose(0, 2, 1, 3, 4).reshape(shape)
        causal_attention(q, keys, values, kv_len - lo * bs, q_pos - lo * bs, scale, self.softcap, self.window, out)
