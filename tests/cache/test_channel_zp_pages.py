"""Channel-zp key planes of a BlockPool: pages built with channel_zp_params, read back within half
a scale, and snapshots (take_snapshot / paged_from_snapshot) of mixed-format caches holding them."""

import numpy as np
import pytest

from onnxkv.cache import formats, serialize
from onnxkv.cache.page_convert import convert_full_pages
from onnxkv.cache.paged import BlockPool, PagedCache, PageTable, PlaneSpec
from onnxkv.cache.snapshot import paged_from_snapshot, take_snapshot
from onnxkv.errors import InputError

H, D, BS = 2, 16, 4
LAYERS = [("k", "v")]


def _pool(key_header="channel-zp"):
    groups = 1 if key_header == "float32" else D
    return BlockPool(
        [PlaneSpec("k", H, D, "float32", groups=groups, header=key_header), PlaneSpec("v", H, D, "float32")], BS
    )


def _filled(pool, rng, tokens):
    """A cache of one row holding ``tokens`` key-like (per-channel offsets) keys and random values."""
    cache = PagedCache(pool, PageTable(pool, 1))
    k = rng.standard_normal((1, H, tokens, D)) * rng.uniform(0.1, 1.5, D) + rng.uniform(-20, 20, D)
    cache.write(0, k.astype(np.float32), 0, tokens)
    cache.write(1, rng.standard_normal((1, H, tokens, D)).astype(np.float32), 0, tokens)
    cache.commit()
    return cache


@pytest.mark.parametrize("fmt", ["int8", "uint8"])
def test_channel_zp_plane_builds_pages_from_the_data(fmt):
    rng = np.random.default_rng(41)
    pool = _pool()
    cache = _filled(pool, rng, 3 * BS)
    x = cache.gather(0, 3 * BS)[0]
    assert convert_full_pages(cache.table, 0, fmt) == (3, 0)
    for blk in range(3):
        p = int(cache.table.tables[0, blk])
        page_x = np.ascontiguousarray(x[:, blk * BS : (blk + 1) * BS])
        scale, zp, header = formats.channel_zp_params(page_x, fmt)
        np.testing.assert_array_equal(pool.pages[0][p][: header.size], header)
        assert pool.sizes[0][p] == formats.page_bytes(fmt, H, BS, D, D, "channel-zp") == 64 + H * BS * D
        err = np.abs(pool.read_page(0, p, BS) - page_x)
        assert (err <= scale.reshape(H, 1, D) * np.float32(0.5) * (1 + 1e-5)).all(), float(err.max())
    cache.table.release()
    assert pool.committed_bytes == 0


def test_snapshot_round_trips_channel_zp_pages_in_a_mixed_cache():
    rng = np.random.default_rng(42)
    pool = _pool()
    cache = _filled(pool, rng, 4 * BS + 2)
    t = cache.table.tables[0]
    pool.convert_page(0, int(t[0]), "int8", BS)
    pool.convert_page(0, int(t[1]), "uint8", BS)
    pool.convert_page(0, int(t[2]), "float16", BS)
    pool.convert_page(1, int(t[0]), "int8", BS)
    want = [cache.gather(i, 4 * BS + 2) for i in range(2)]
    snap = serialize.decode(serialize.encode(take_snapshot(cache, LAYERS, "sig")))
    key = snap.sequences[0].blocks[0].key
    assert key.format == "int8" and key.scale.size == H * D
    assert (key.zero_point < -128).any() or (key.zero_point > 127).any()  # offsets beyond the code range survive
    other = _pool()
    back = paged_from_snapshot(snap, other, LAYERS)
    t2 = back.table.tables[0]
    for i in range(2):
        assert other.formats[i][t2].tolist() == pool.formats[i][t].tolist()
        np.testing.assert_array_equal(back.gather(i, 4 * BS + 2), want[i])
    for blk in (0, 1):  # the same header bytes: the smallest zero-point unit is the one channel_zp_params chose
        hb = formats.header_bytes(formats.page_format(int(pool.formats[0][t[blk]])), H, D, "channel-zp")
        np.testing.assert_array_equal(other.pages[0][int(t2[blk])][:hb] != 0, pool.pages[0][int(t[blk])][:hb] != 0)
        np.testing.assert_array_equal(
            formats.decode_header(other.pages[0][int(t2[blk])], int(pool.formats[0][t[blk]]), H, D, "channel-zp"),
            formats.decode_header(pool.pages[0][int(t[blk])], int(pool.formats[0][t[blk]]), H, D, "channel-zp"),
        )
    back.table.release()
    cache.table.release()


@pytest.mark.parametrize("saved, loading", [("float32", "channel-zp"), ("channel-zp", "float32")])
def test_resume_names_the_header_kind_when_scale_groups_differ(saved, loading):
    rng = np.random.default_rng(43)
    pool = _pool(saved)
    cache = _filled(pool, rng, 2 * BS)
    pool.convert_page(0, int(cache.table.tables[0, 0]), "int8", BS)
    snap = take_snapshot(cache, LAYERS)
    other = _pool(loading)
    saved_groups, groups = (1, D) if saved == "float32" else (D, 1)
    with pytest.raises(
        InputError,
        match=f"resume: block at 0 of 'k' has {saved_groups} scale.s. per head, the "
        f"state's plane has {groups} group.s. per head with '{loading}' headers",
    ):
        paged_from_snapshot(snap, other, LAYERS)
    assert other.live_pages == 0
    cache.table.release()


def test_resume_rejects_parameters_a_channel_zp_header_cannot_hold():
    rng = np.random.default_rng(44)
    pool = _pool("compact")
    cache = _filled(pool, rng, BS)
    pool.convert_page(0, int(cache.table.tables[0, 0]), "uint8", BS)  # KIVI: a scale per channel
    snap = take_snapshot(cache, LAYERS)
    other = _pool("channel-zp")
    with pytest.raises(
        InputError,
        match=r"resume: plane 'k': scale\[1\] = .* differs from scale\[0\] = .*: a "
        r"channel-zp header holds one scale per head",
    ):
        paged_from_snapshot(snap, other, LAYERS)
    assert other.live_pages == 0
    cache.table.release()
