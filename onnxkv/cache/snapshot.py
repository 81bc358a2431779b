"""Turning a paged cache into a :class:`~onnxkv.cache.serialize.CacheSnapshot` and back.

A snapshot lists, per sequence (batch row) and layer, the blocks holding the
row's valid positions ``[first, length)``: each block's start, valid length
and key/value payloads in their stored format (see
:mod:`onnxkv.cache.serialize` for the wire format).  Pages shared between rows
are written once per row that holds them.  Quantized payloads carry their
decoded float32 scales and zero points whatever the page's header kind (a
compact or channel-zp header is decoded on saving and encoded again, exactly,
on loading, in the header kind of the loading state's plane).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxkv.cache.formats import decode_header, encode_header, header_bytes, page_bytes, page_format
from onnxkv.cache.paged import BlockPool, PagedCache, PageTable
from onnxkv.cache.serialize import BlockRecord, CacheSnapshot, LayerSpec, PagePayload, SequenceRecord
from onnxkv.errors import InputError

__all__ = ["take_snapshot", "paged_from_snapshot"]


def take_snapshot(cache: PagedCache, layers: Sequence[tuple[str, str]], signature: str = "") -> CacheSnapshot:
    """A snapshot of the committed contents of ``cache``; ``layers`` pairs (key plane, value plane) names."""
    pool = cache.pool
    bs = pool.block_size
    index = pool.plane_index
    specs = []
    for k, v in layers:
        ks = pool.planes[index[k]]
        specs.append(LayerSpec(k, v, ks.heads, ks.head_size, ks.model_dtype))
    table = cache.table
    sequences = []
    for b in range(table.batch):
        length, first = int(table.lengths[b]), int(table.first[b])
        blocks = []
        for li, (k, v) in enumerate(layers):
            for blk in range(first // bs, -(-length // bs)):
                p = int(table.tables[b, blk])
                n = min(bs, length - blk * bs)
                blocks.append(BlockRecord(li, blk * bs, n, _payload(pool, index[k], p, n),
                                          _payload(pool, index[v], p, n)))
        sequences.append(SequenceRecord(length, blocks, first - first % bs if first else 0))
    return CacheSnapshot(bs, specs, sequences, signature)


def _payload(pool: BlockPool, plane: int, page: int, n: int) -> PagePayload:
    """The first ``n`` positions of ``page`` in ``plane`` as stored (native, float or packed codes)."""
    spec = pool.planes[plane]
    arr = pool.pages[plane][page]
    fmt = page_format(int(pool.formats[plane][page]))
    if not pool.quantized(plane, page):
        return PagePayload(spec.storage, arr[:, :n].copy())
    if fmt.is_float:
        typed = arr[: spec.heads * pool.block_size * spec.head_size * fmt.dtype.itemsize].view(fmt.dtype)
        return PagePayload(fmt.name, typed.reshape(spec.heads, pool.block_size, spec.head_size)[:, :n].copy())
    hdr = header_bytes(fmt, spec.heads, spec.groups, spec.header)
    row = spec.head_size * fmt.bits // 8
    scale, zero_point = decode_header(arr, fmt, spec.heads, spec.groups, spec.header)
    codes = arr[hdr: hdr + spec.heads * pool.block_size * row].reshape(spec.heads, pool.block_size, row)
    return PagePayload(fmt.name, codes[:, :n].copy(), scale, zero_point)


def _header(pool: BlockPool, plane: int, payload: PagePayload) -> np.ndarray | None:
    """The page header bytes of a saved quantized payload in ``plane``'s header kind (None for
    float payloads); raises :class:`~onnxkv.errors.InputError` when the header kind cannot hold
    the payload's parameters."""
    if payload.scale is None:
        return None
    spec = pool.planes[plane]
    return encode_header(payload.format, payload.scale, payload.zero_point, spec.heads, spec.header,
                         f"resume: plane '{spec.name}'")


def _install(pool: BlockPool, plane: int, page: int, payload: PagePayload, n: int, header: np.ndarray | None) -> None:
    """Write a saved payload of ``n`` positions into ``page`` of ``plane`` (a fresh native page);
    ``header``: the quantized payload's header bytes (:func:`_header`)."""
    spec = pool.planes[plane]
    if payload.format == spec.storage:
        pool.pages[plane][page][:, :n] = payload.data
        pool.pages[plane][page][:, n:] = 0  # recycled memory: a static cache reads the slots past n as zeros
        return
    fmt = page_format(payload.format)
    nbytes = page_bytes(fmt, spec.heads, pool.block_size, spec.head_size, spec.groups, spec.header)
    buf = pool.allocators[plane].allocate(nbytes, 64)
    arr = buf.view(np.uint8, (nbytes,))
    arr[:] = 0
    if fmt.is_float:
        typed = arr[: spec.heads * pool.block_size * spec.head_size * fmt.dtype.itemsize].view(fmt.dtype)
        typed.reshape(spec.heads, pool.block_size, spec.head_size)[:, :n] = payload.data
    else:
        row = spec.head_size * fmt.bits // 8
        arr[: header.size] = header
        codes = arr[header.size: header.size + spec.heads * pool.block_size * row].reshape(spec.heads,
                                                                                           pool.block_size, row)
        codes[:, :n] = payload.data
    pool.install_payload(plane, page, buf, arr, fmt.name)


def paged_from_snapshot(snapshot: CacheSnapshot, pool: BlockPool, layers: Sequence[tuple[str, str]],
                        max_tokens: int | None = None) -> PagedCache:
    """A new :class:`PagedCache` in ``pool`` holding ``snapshot``'s contents (pages allocated once).

    The snapshot must match the pool: the same layer names, heads, head
    sizes, stored formats, scale groups and block size, and quantization
    parameters the planes' page headers can hold.  Raises
    :class:`~onnxkv.errors.InputError` naming the mismatch, before allocating.
    """
    bs = pool.block_size
    if snapshot.block_size != bs:
        raise InputError(f"resume: the saved cache has block_size={snapshot.block_size}, the state uses {bs}; "
                         f"create the state with block_size={snapshot.block_size}")
    if len(snapshot.layers) != len(layers):
        raise InputError(f"resume: the saved cache has {len(snapshot.layers)} layers, the model has {len(layers)}")
    index = pool.plane_index
    for spec, (k, v) in zip(snapshot.layers, layers):
        ks = pool.planes[index[k]]
        if (spec.key_name, spec.value_name, spec.kv_heads, spec.head_size) != (k, v, ks.heads, ks.head_size):
            raise InputError(f"resume: saved layer ({spec.key_name}, {spec.value_name}, heads {spec.kv_heads}, head "
                             f"size {spec.head_size}) does not match the model's ({k}, {v}, heads {ks.heads}, "
                             f"head size {ks.head_size})")
    headers: dict[tuple[int, int], np.ndarray | None] = {}  # (id(payload), plane) -> its header bytes
    for seq in snapshot.sequences:
        if max_tokens is not None and seq.length > max_tokens:
            raise InputError(f"resume: a saved sequence holds {seq.length} positions, the state's capacity is "
                             f"{max_tokens}")
        for blk in seq.blocks:
            k, v = layers[blk.layer]
            for name, payload in ((k, blk.key), (v, blk.value)):
                spec = pool.planes[index[name]]
                groups = None if payload.scale is None else payload.scale.size // spec.heads
                if groups is not None and groups != spec.groups:
                    raise InputError(f"resume: block at {blk.start} of '{name}' has {groups} scale(s) per head, the "
                                     f"state's plane has {spec.groups} group(s) per head with {spec.header!r} headers "
                                     "(key_channel_scales / key_channel_zero_points)")
                headers[id(payload), index[name]] = _header(pool, index[name], payload)
    batch = len(snapshot.sequences)
    need = sum(-(-seq.length // bs) - seq.first_position // bs for seq in snapshot.sequences)
    table = PageTable(pool, batch)
    cache = PagedCache(pool, table, max_tokens=max_tokens)
    ids = pool.allocate(need) if need else np.zeros(0, np.int32)
    m = max((-(-seq.length // bs) for seq in snapshot.sequences), default=0)
    tables = np.full((batch, m), -1, np.int32)
    k_ = 0
    for b, seq in enumerate(snapshot.sequences):
        for blk in range(seq.first_position // bs, -(-seq.length // bs)):
            tables[b, blk] = ids[k_]
            k_ += 1
        table.lengths[b] = seq.length
        table.first[b] = seq.first_position
    table.tables = tables
    try:
        for b, seq in enumerate(snapshot.sequences):
            for blk in seq.blocks:
                k, v = layers[blk.layer]
                p = int(tables[b, blk.start // bs])
                _install(pool, index[k], p, blk.key, blk.length, headers[id(blk.key), index[k]])
                _install(pool, index[v], p, blk.value, blk.length, headers[id(blk.value), index[v]])
    except BaseException:
        table.release()
        raise
    return cache
