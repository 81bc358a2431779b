"""Turning a paged cache into a :class:`~onnxkv.cache.serialize.CacheSnapshot` and back.

A snapshot lists, per sequence (batch row) and layer, the blocks holding the
row's valid positions ``[first, length)``: each block's start, valid length
and key/value payloads in their stored format (see
:mod:`onnxkv.cache.serialize` for the wire format).  Pages shared between rows
are written once per row that holds them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
            kp, vp = pool.pages[index[k]], pool.pages[index[v]]
            fmt_k, fmt_v = pool.planes[index[k]].storage, pool.planes[index[v]].storage
            for blk in range(first // bs, -(-length // bs)):
                p = int(table.tables[b, blk])
                n = min(bs, length - blk * bs)
                blocks.append(BlockRecord(li, blk * bs, n, PagePayload(fmt_k, kp[p][:, :n].copy()),
                                          PagePayload(fmt_v, vp[p][:, :n].copy())))
        sequences.append(SequenceRecord(length, blocks, first - first % bs if first else 0))
    return CacheSnapshot(bs, specs, sequences, signature)


def paged_from_snapshot(snapshot: CacheSnapshot, pool: BlockPool, layers: Sequence[tuple[str, str]],
                        max_tokens: int | None = None) -> PagedCache:
    """A new :class:`PagedCache` in ``pool`` holding ``snapshot``'s contents (pages allocated once).

    The snapshot must match the pool: the same layer names, heads, head
    sizes, stored formats and block size.  Raises
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
    for seq in snapshot.sequences:
        if max_tokens is not None and seq.length > max_tokens:
            raise InputError(f"resume: a saved sequence holds {seq.length} positions, the state's capacity is "
                             f"{max_tokens}")
        for blk in seq.blocks:
            k, v = layers[blk.layer]
            for name, payload in ((k, blk.key), (v, blk.value)):
                if payload.format != pool.planes[index[name]].storage:
                    raise InputError(f"resume: block at {blk.start} of '{name}' is stored as {payload.format}, "
                                     f"the state stores {pool.planes[index[name]].storage}")
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
    for b, seq in enumerate(snapshot.sequences):
        for blk in seq.blocks:
            k, v = layers[blk.layer]
            p = int(tables[b, blk.start // bs])
            pool.pages[index[k]][p][:, :blk.length] = blk.key.data
            pool.pages[index[v]][p][:, :blk.length] = blk.value.data
    return cache
