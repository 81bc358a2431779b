"""Turning a paged cache into a :class:`CacheSnapshot` and back.

The data model (:class:`CacheSnapshot`, :class:`LayerSpec`,
:class:`SequenceRecord`, :class:`BlockRecord`, :class:`PagePayload`,
:class:`Expectation`) is defined in :mod:`onnxkv.cache.snapshot_model` (below
both this module and the serialiser, whose rules this module applies) and
importable from here.

A snapshot lists, per sequence (batch row) and layer, the blocks holding the
row's valid positions ``[first, length)``: each block's start, valid length
and key/value payloads in their stored format (see
:mod:`onnxkv.cache.serialize` for the wire format).  Pages shared between rows
are written once per row that holds them.  Quantized payloads carry their
decoded float32 scales and zero points whatever the page's header kind (a
compact or channel-zp header is decoded on saving and encoded again, exactly,
on loading, in the header kind of the loading state's plane).

A snapshot to load is untrusted (it comes from a file): :func:`paged_from_snapshot`
checks it against the model and the state's limits before it takes a page,
and a refused or failed load leaves the pool exactly as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxkv.cache.formats import encode_header, page_bytes, page_format
from onnxkv.cache.paged import BlockPool, PagedCache, PageTable
from onnxkv.cache.serialize_rules import check_expectation, validate
from onnxkv.cache.snapshot_model import (
    BlockRecord,
    CacheSnapshot,
    Expectation,
    LayerSpec,
    OwedConversion,
    PagePayload,
    SequenceRecord,
)
from onnxkv.errors import InputError, OutOfMemory

__all__ = [
    "take_snapshot",
    "owed_planes",
    "paged_from_snapshot",
    "expectation",
    "file_bytes_limit",
    "CacheSnapshot",
    "LayerSpec",
    "SequenceRecord",
    "BlockRecord",
    "PagePayload",
    "Expectation",
]


def expectation(
    pool: BlockPool, layers: Sequence[tuple[str, str]], signature: str | None = None, api: str = "expectation"
) -> Expectation:
    """What a cache loaded into ``pool`` must have: ``signature`` (None: not checked), the pool's block
    size, one :class:`LayerSpec` per (key plane, value plane) pair of ``layers``, and at most
    ``max_pages`` rows when the pool has a ``max_pages`` (every row needs a page of its own to run).

    Raises :class:`~onnxkv.errors.InputError` (starting with ``api``) when a layer's key and value
    planes differ in heads, head size or dtype: a snapshot holds one geometry per layer.
    """
    index = pool.plane_index
    specs = []
    for i, (k, v) in enumerate(layers):
        ks, vs = pool.planes[index[k]], pool.planes[index[v]]
        if (ks.heads, ks.head_size, ks.model_dtype) != (vs.heads, vs.head_size, vs.model_dtype):
            raise InputError(
                f"{api}: layer {i} has keys of (heads, head_size, dtype) "
                f"{(ks.heads, ks.head_size, ks.model_dtype)} and values of "
                f"{(vs.heads, vs.head_size, vs.model_dtype)}; a saved cache holds one geometry per layer"
            )
        specs.append(LayerSpec(k, v, ks.heads, ks.head_size, ks.model_dtype))
    return Expectation(pool.block_size, tuple(specs), pool.max_pages, signature)


def take_snapshot(
    cache: PagedCache,
    layers: Sequence[tuple[str, str]],
    signature: str = "",
    owed: Sequence[tuple[int, str]] = (),
    residual: int = 0,
) -> CacheSnapshot:
    """A snapshot of the committed contents of ``cache``; ``layers`` pairs (key plane, value plane) names.
    ``owed``: the (plane index, page format) conversions the cache's state owes its next run, with the
    ``residual`` positions they keep (:class:`~onnxkv.cache.snapshot_model.OwedConversion`)."""
    pool = cache.pool
    bs = pool.block_size
    index = pool.plane_index
    specs = list(expectation(pool, layers, api="take_snapshot").layers)
    table = cache.table
    sequences = []
    for b in range(table.batch):
        length, first = int(table.lengths[b]), int(table.first[b])
        blocks = []
        for li, (k, v) in enumerate(layers):
            for blk in range(first // bs, -(-length // bs)):
                p = int(table.tables[b, blk])
                n = min(bs, length - blk * bs)
                blocks.append(
                    BlockRecord(li, blk * bs, n, _payload(pool, index[k], p, n), _payload(pool, index[v], p, n))
                )
        sequences.append(SequenceRecord(length, blocks, first - first % bs if first else 0))
    roles = {index[name]: (li, role) for li, pair in enumerate(layers) for name, role in zip(pair, ("key", "value"))}
    conversions = [OwedConversion(*roles[plane], fmt) for plane, fmt in owed]
    return CacheSnapshot(bs, specs, sequences, signature, conversions, residual if conversions else 0)


def owed_planes(pool: BlockPool, layers: Sequence[tuple[str, str]], snapshot: CacheSnapshot, api: str) -> tuple:
    """The (plane index, page format) pairs of ``snapshot``'s owed conversions in ``pool`` (``layers`` as
    for :func:`take_snapshot`; the snapshot checked against them).  Raises InputError naming ``api`` when
    a plane's pages cannot take the format (a head size whose codes do not fill whole bytes)."""
    out = []
    for i, o in enumerate(snapshot.owed):
        plane = pool.plane_index[layers[o.layer][o.role == "value"]]
        spec = pool.planes[plane]
        try:
            page_bytes(o.format, spec.heads, pool.block_size, spec.head_size, spec.groups, spec.header)
        except InputError as e:
            raise InputError(f"{api}: owed conversion {i} ({spec.name} to {o.format}): {e}") from None
        out.append((plane, page_format(o.format).name))
    return tuple(out)


def _payload(pool: BlockPool, plane: int, page: int, n: int) -> PagePayload:
    """The first ``n`` positions of ``page`` in ``plane`` as stored (native, float or packed codes)."""
    return PagePayload(*pool.payloads.stored(plane, page, n))


def _header(pool: BlockPool, plane: int, payload: PagePayload, api: str) -> np.ndarray | None:
    """The page header bytes of a saved quantized payload in ``plane``'s header kind (None for
    float payloads); raises :class:`~onnxkv.errors.InputError` when the header kind cannot hold
    the payload's parameters."""
    if payload.scale is None:
        return None
    spec = pool.planes[plane]
    return encode_header(
        payload.format, payload.scale, payload.zero_point, spec.heads, spec.header, f"{api}: plane '{spec.name}'"
    )


#: Upper bound of a block's encoding besides its payload bytes, per plane (field tags, varints, format name).
_BLOCK_OVERHEAD = 128
#: Upper bound of everything in a file that is not a block (header, layers' fields, signature, sequences).
_FILE_OVERHEAD = 1 << 20


def file_bytes_limit(pool: BlockPool) -> int | None:
    """The largest cache file a state of ``pool`` can load (None: the pool has no ``max_pages``).

    Every block of a loadable file becomes a page, so a file holds at most
    ``max_pages`` blocks per layer, each at most ``kv_heads * head_size *
    (4 * block_size + 8)`` payload bytes per plane (float32 elements, or
    codes with a float32 scale and zero point per channel) plus its
    encoding; 1 MiB more covers everything else.  A larger file cannot fit
    (or carries blocks below its rows' first positions, which a loader
    drops); refusing it by size avoids parsing it.
    """
    if pool.max_pages is None:
        return None
    per_page = sum(spec.heads * spec.head_size * (4 * pool.block_size + 8) + _BLOCK_OVERHEAD for spec in pool.planes)
    return pool.max_pages * per_page + _FILE_OVERHEAD


def _payload_bytes(snapshot: CacheSnapshot) -> int:
    """Bytes of every page array a snapshot carries (data, scales, zero points)."""
    return sum(
        p.data.nbytes + (0 if p.scale is None else p.scale.nbytes + p.zero_point.nbytes)
        for seq in snapshot.sequences
        for blk in seq.blocks
        for p in (blk.key, blk.value)
    )


def _spans(snapshot: CacheSnapshot, bs: int) -> list[tuple[int, int]]:
    """Per row, the logical blocks ``[lo, hi)`` holding a position in ``[first_position, length)``."""
    return [
        (
            seq.first_position // bs,
            -(-seq.length // bs) if seq.length > seq.first_position else seq.first_position // bs,
        )
        for seq in snapshot.sequences
    ]


def _check_rows(snapshot: CacheSnapshot, max_tokens: int | None, window: int | None, api: str) -> None:
    """Each row's length and first position against the state's capacity and window."""
    for b, seq in enumerate(snapshot.sequences):
        if max_tokens is not None and seq.length > max_tokens:
            raise InputError(f"{api}: sequence {b} holds {seq.length} positions, the state's capacity is {max_tokens}")
        lowest = 0 if window is None else max(0, seq.length - window)
        if seq.first_position > lowest:
            seen = (
                "the model attends to every position"
                if window is None
                else f"the model's window makes its next query read positions from {lowest}"
            )
            raise InputError(
                f"{api}: sequence {b} has first_position {seq.first_position} (positions below it are "
                f"not held), but {seen}: first_position must be at most {lowest}"
            )


def paged_from_snapshot(
    snapshot: CacheSnapshot,
    pool: BlockPool,
    layers: Sequence[tuple[str, str]],
    max_tokens: int | None = None,
    window: int | None = None,
    api: str = "resume",
) -> PagedCache:
    """A new :class:`PagedCache` in ``pool`` holding ``snapshot``'s contents (pages allocated once).

    ``layers`` pairs the model's (key plane, value plane) names in layer
    order; ``max_tokens`` is the state's capacity per row (None: no limit);
    ``window`` the model's attention window (a query at position ``t`` reads
    keys from ``t - window``; None: every key).  Everything is checked before
    the page table is allocated or a page is taken:

    * the snapshot's rules (:func:`~onnxkv.cache.serialize_rules.validate`;
      :class:`~onnxkv.errors.SerializationError`);
    * the model (:func:`expectation`, InputError): block size, layer
      count, layer names, heads, head size and dtype of both planes, at
      most ``max_pages`` rows; quantized payloads' scale groups and
      parameters the planes' page headers can hold;
    * the state: every row's length at most ``max_tokens``; its first
      position at most ``length - window`` (0 without a window), so every
      position a next query reads is held (InputError); the page table
      (int32 ``[rows, ceil(longest length / block_size)]``) no larger than
      the payload bytes the snapshot carries, so positions a snapshot only
      declares never cost more memory than the ones it holds (InputError);
      the pages needed at most the pool's free pages when it has
      ``max_pages`` (:class:`~onnxkv.errors.OutOfMemory`).

    Blocks wholly below a row's first position (the format allows them)
    hold positions the state does not keep: the snapshot's rules apply to
    them, but they are not installed.  Any failure (an allocator's OutOfMemory included) leaves
    the pool as it was: no page, reference or payload remains.  Error
    messages start with ``api``.
    """
    validate(snapshot)
    check_expectation(snapshot, expectation(pool, layers, api=api), api)
    bs = pool.block_size
    _check_rows(snapshot, max_tokens, window, api)
    batch = len(snapshot.sequences)
    m = max(-(-seq.length // bs) for seq in snapshot.sequences)
    carried = _payload_bytes(snapshot)
    if 4 * batch * m > carried:
        raise InputError(
            f"{api}: the saved cache declares rows of up to {m * bs} positions, a page table of "
            f"{batch} x {m} int32 entries ({4 * batch * m} bytes), but carries only {carried} payload "
            f"bytes; a cache file may not make the load allocate more than it holds"
        )
    index = pool.plane_index
    kept = []  # (row, block, key header, value header) of the blocks holding a position the state keeps
    for b, seq in enumerate(snapshot.sequences):
        for blk in seq.blocks:
            if blk.start + blk.length <= seq.first_position:
                continue
            k, v = layers[blk.layer]
            headers = []
            for name, payload in ((k, blk.key), (v, blk.value)):
                spec = pool.planes[index[name]]
                groups = None if payload.scale is None else payload.scale.size // spec.heads
                if groups is not None and groups != spec.groups:
                    raise InputError(
                        f"{api}: block at {blk.start} of '{name}' has {groups} scale(s) per head, the "
                        f"state's plane has {spec.groups} group(s) per head with {spec.header!r} headers "
                        "(key_channel_scales / key_channel_zero_points)"
                    )
                headers.append(_header(pool, index[name], payload, api))
            kept.append((b, blk, *headers))
    spans = _spans(snapshot, bs)
    need = sum(hi - lo for lo, hi in spans)
    if pool.max_pages is not None and need > pool.free_pages:
        raise OutOfMemory(
            f"{api}: the saved cache needs {need} page(s), the pool has {pool.free_pages} free of "
            f"max_pages={pool.max_pages}"
        )
    rows = np.repeat(np.arange(batch), [hi - lo for lo, hi in spans])
    cols = np.concatenate([np.arange(lo, hi) for lo, hi in spans])
    table = PageTable(pool, batch)
    table.tables = np.full((batch, m), -1, np.int32)
    table.lengths[:] = [seq.length for seq in snapshot.sequences]
    table.first[:] = [seq.first_position for seq in snapshot.sequences]
    ids = pool.allocate(need)  # OutOfMemory leaves the pool as it was
    try:
        table.tables[rows, cols] = ids
        for b, blk, key_header, value_header in kept:
            k, v = layers[blk.layer]
            p = int(table.tables[b, blk.start // bs])
            for name, payload, header in ((k, blk.key, key_header), (v, blk.value, value_header)):
                pool.payloads.install_stored(index[name], p, payload.format, payload.data, blk.length, header, api)
    except BaseException:
        table.release()
        raise
    return PagedCache(pool, table, max_tokens=max_tokens)
