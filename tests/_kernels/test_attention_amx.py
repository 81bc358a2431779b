"""Quantized pages on the AMX-INT8 tiles (attention_amx.h): key scores
(per-head key scales, and per-channel ones of 8-bit codes).
paged_attention with set_attention_amx(True) must equal the NumPy twin
(reference.paged_attention over the dequantized pages) and the AVX-512 tiles
without AMX (set_attention_amx(False)) within 1e-5, for every
integer format (8-, 4- and 2-bit, signed and unsigned) of keys and values,
per-head and per-channel key scales (float32 and compact headers; 4- and
2-bit per-channel keys keep the AVX-512 tiles), keys with large per-channel
offsets, values with non-zero zero points, pages of mixed
formats with float pages between, all-float pages, head sizes that are and
are not multiples of 16 / 64, block sizes that give partial tiles, 1..8 query rows per KV head, decode and prefill, 1 and 2 threads,
query rows of very different magnitudes including an all-zero row, queries
large where per-channel key scales are small (the folded rows' fixed-point
unit), and long contexts (many rescales by the running max).

Every kernel test is skipped where AMX is not usable (CPU without AMX-TILE /
AMX-INT8 or AVX-512, or the OS did not grant the tile data state); the switch
and level test runs everywhere.
"""

import sys

import numpy as np
import pytest

import onnxkv._kernels as K

from .conftest import rand
from .test_attention import reset_level
from .test_quant_attention import QPaged, chooser

A = sys.modules["onnxkv._kernels.attention"]
AVX512 = A.set_attention_avx512(True)
AMX = A.set_attention_amx(True)
needs_amx = pytest.mark.skipif(
    not AMX,
    reason="AMX-INT8 not usable here: the CPU lacks AMX-TILE/AMX-INT8 or "
    "AVX-512, the OS did not grant the tile data state, the build "
    "has no AMX (cpu_features()['amx_compiled']) or ONNXKV_MAX_SIMD "
    "caps the levels below avx512",
)
INTS = (3, 2, 22, 21, 26, 25)  # int8, uint8, int4, uint4, int2, uint2
NAMES = {3: "i8", 2: "u8", 22: "i4", 21: "u4", 26: "i2", 25: "u2"}


def build(seed, kspec, vspec, kG, Hq, Hkv, D, bs, kv_len, Sq=1, spread=False, vG=1, offset=0.0):
    """Random q and a paged cache of the given page formats (QPaged: page ids
    shuffled, per page format kspec / vspec: a code or a tuple to pick from);
    kG 1 (per head), "D" (per channel) or "Dc" (per channel, compact key
    headers); vG 1 (values per head) or D (per channel).  spread: query rows scaled by factors from 1e-3 to 8 and the
    first row of every batch all zeros.  offset: keys shifted by a per (KV head, channel) constant from
    [-offset, offset] and scaled per channel by factors from 1/4 to 4, as trained keys are (outlier channels; far
    from zero, so per-channel zero points are large).  Returns (q, pages, kv_len, q_pos, scale, twin result)."""
    rng = np.random.default_rng(seed)
    kv_len = np.array(kv_len, np.int32)
    B, Cap = len(kv_len), int(kv_len.max()) + 3
    q = rand(rng, (B, Hq, Sq, D))
    if spread:
        q *= (10.0 ** rng.uniform(-3, np.log10(8), (B, Hq, Sq, 1))).astype(np.float32)
        q[:, 0, 0] = 0.0
    k, v = rand(rng, (B, Hkv, Cap, D)), rand(rng, (B, Hkv, Cap, D))
    if offset:
        k = (k * 4.0 ** rng.uniform(-1, 1, (1, Hkv, 1, D)) + rng.uniform(-offset, offset, (1, Hkv, 1, D))).astype(
            np.float32
        )
    header = "compact" if kG == "Dc" else "float32"
    pg = QPaged(
        rng, k, v, bs, chooser(kspec, seed + 1), chooser(vspec, seed + 2), D if kG in ("D", "Dc") else 1, vG, header
    )
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)[None, :]).astype(np.int32)
    scale = D**-0.5
    want = np.full_like(q, np.nan)
    pg.twin(q, Hkv, kv_len, q_pos, scale, 0.0, -1, want)
    return q, pg, kv_len, q_pos, scale, want


MODES = (False, True)  # AMX key scores: off (AVX-512 FMAs only), on (the default)


def check(q, pg, kv_len, q_pos, scale, want):
    """AVX-512 only and AMX keys (MODES), 1 and 2 threads: each result within
    1e-5 of the twin and of the AVX-512 tiles, the same quantized bytes
    loaded, AMX scratch in the workspace exactly when something may run on AMX
    (key scores in every call; taken per call, before the page formats are
    read); returns the result of AMX keys."""
    Hkv = pg.kd.shape[1]
    quantized = bool(np.isin(np.concatenate([pg.formats["k"], pg.formats["v"]]), INTS).any())
    old = K.get_num_threads()
    try:
        for threads in (1, 2):
            K.set_num_threads(threads)
            got, stats = {}, {}
            for amx in MODES:
                A.set_attention_amx(amx)
                assert A.attention_simd_level() == ("avx512+amx" if amx else "avx512")
                out = np.full_like(q, np.nan)
                counters = pg.kernel(q, Hkv, kv_len, q_pos, scale, 0.0, -1, out)
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
                got[amx], stats[amx] = out, counters
            base = stats[False]
            np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5)
            assert stats[True]["dequantized_bytes"] == base["dequantized_bytes"]
            assert (base["dequantized_bytes"] > 0) == quantized
            keys_ws = stats[True]["workspace_peak_bytes"] - base["workspace_peak_bytes"]
            assert keys_ws > 0  # every call may score keys on AMX (per-channel scales: its 8-bit pages)
    finally:
        K.set_num_threads(old)
        reset_level()
        A.set_attention_amx(True)
    return got[True]


@needs_amx
@pytest.mark.parametrize("kG", [1, "D", "Dc"], ids=["per_head", "per_channel", "compact"])
@pytest.mark.parametrize("fmt", INTS, ids=[NAMES[f] for f in INTS])
def test_every_format_and_key_scale_mode(fmt, kG):
    q, pg, kv_len, q_pos, scale, want = build(10 + fmt, fmt, 3, kG, 32, 8, 64, 16, (37, 100))
    assert pg.formats["k"].tolist() == [fmt] * len(pg.formats["k"])
    check(q, pg, kv_len, q_pos, scale, want)


@needs_amx
@pytest.mark.parametrize("bs", [1, 5, 16, 32, 64])
@pytest.mark.parametrize("D", [16, 24, 40, 64, 128])
@pytest.mark.parametrize("fmt", [3, 22, 25], ids=["i8", "i4", "u2"])
def test_head_sizes_and_block_sizes(fmt, D, bs):
    # keys: D % 64 != 0 and tiles of fewer than 16 keys take the widened copy; int8 with D = 64, 128 and bs >= 16
    # the page itself; D % 16 != 0 leaves masked columns.
    check(*build(100 + D + bs, fmt, fmt, 1, 8, 2, D, bs, (29, 71, 130)))


@needs_amx
@pytest.mark.parametrize("bs", [1, 5, 16, 32])
@pytest.mark.parametrize("D", [16, 40, 64, 128])
@pytest.mark.parametrize("kG", ["D", "Dc"], ids=["per_channel", "compact"])
@pytest.mark.parametrize("fmt", [2, 3], ids=["u8", "i8"])
def test_per_channel_8bit_keys_head_and_block_sizes(fmt, kG, D, bs):
    # per-channel 8-bit keys on AMX: B tiles rebuilt from the folded rows per page (okv_amx_build_pc); D % 64 != 0
    # and pages of fewer than 16 keys take the copied A rows, D = 40 a masked last 16 elements; keys with large
    # per-channel offsets (zero points far from the middle of the code range)
    check(*build(900 + D + bs + fmt, fmt, (3, 21), kG, 12, 3, D, bs, (29, 71, 130), offset=20.0))


@needs_amx
@pytest.mark.parametrize("kG", ["D", "Dc"], ids=["per_channel", "compact"])
def test_per_channel_keys_with_large_offsets_long_context(kG):
    # thousands of keys far from zero: the zero points' share (scale * q'.z per row and page) is large next to
    # the scores it is subtracted from, on AMX and AVX-512 alike
    q, pg, kv_len, q_pos, scale, want = build(950, 2, 3, kG, 8, 2, 128, 16, (2049, 1500), offset=50.0)
    Hkv = pg.kd.shape[1]
    if kG == "D":  # float32 header: zero points of uint8 codes far from the middle 127.5 in some channel
        zero = np.concatenate(
            [np.frombuffer(p.tobytes()[4 * Hkv * 128 : 8 * Hkv * 128], np.float32) for p in pg.pages["k"]]
        )
        assert np.abs(zero - 127.5).max() > 100
    check(q, pg, kv_len, q_pos, scale, want)


@needs_amx
@pytest.mark.parametrize("octaves", [4, 15])
@pytest.mark.parametrize("kG", ["D", "Dc"], ids=["per_channel", "compact"])
@pytest.mark.parametrize("fmt", [2, 3], ids=["u8", "i8"])
def test_per_channel_keys_query_large_where_key_scales_are_small(fmt, kG, octaves):
    # the digits of a page's folded rows q * s are built against a unit fixed per work item (max|q_r| times the
    # largest scale): keys scaled per channel by 2^-u, u up to `octaves`, queries by 2^u, so the folded rows are
    # small next to that unit.  4 octaves stay within its slack; at 15 the channel of a row's largest element has
    # one of the page's smallest scales and the page is folded against the rows' own maxima instead.
    rng = np.random.default_rng(1200 + octaves + fmt)
    Hq, Hkv, D, bs, L = 8, 2, 128, 16, 300
    q, k, v = rand(rng, (1, Hq, 1, D)), rand(rng, (1, Hkv, L + 3, D)), rand(rng, (1, Hkv, L + 3, D))
    u = rng.uniform(0, octaves, (1, Hkv, 1, D))
    k = (k * 2.0**-u).astype(np.float32)
    q = (q * 0.05 * np.repeat(2.0**u, Hq // Hkv, axis=1)).astype(np.float32)
    pg = QPaged(rng, k, v, bs, chooser(fmt, 3), chooser(3, 4), D, 1, "compact" if kG == "Dc" else "float32")
    kv_len, q_pos, scale = np.array([L], np.int32), np.array([[L - 1]], np.int32), D**-0.5
    want = np.full_like(q, np.nan)
    pg.twin(q, Hkv, kv_len, q_pos, scale, 0.0, -1, want)
    check(q, pg, kv_len, q_pos, scale, want)


@needs_amx
@pytest.mark.parametrize("kG", [1, "D", "Dc"], ids=["per_head", "per_channel", "compact"])
@pytest.mark.parametrize("fmt", INTS, ids=[NAMES[f] for f in INTS])
def test_which_keys_take_amx(fmt, kG):
    # AMX scores (the fixed-point digits) round differently from the AVX-512 FMAs, so a result bitwise equal to
    # AVX-512's means the keys stayed on AVX-512: every per-head format and 8-bit per-channel keys go to
    # AMX, 4- and 2-bit per-channel keys do not
    q, pg, kv_len, q_pos, scale, _ = build(980 + fmt, fmt, 3, kG, 16, 4, 64, 16, (45, 90))
    got = {}
    try:
        for amx in (False, True):
            A.set_attention_amx(amx)
            got[amx] = np.full_like(q, np.nan)
            pg.kernel(q, 4, kv_len, q_pos, scale, 0.0, -1, got[amx])
    finally:
        reset_level()
        A.set_attention_amx(True)
    routed = kG == 1 or fmt in (2, 3)
    assert np.array_equal(got[True], got[False]) != routed
    np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5)


@needs_amx
@pytest.mark.parametrize("kG", [1, "D", "Dc"], ids=["per_head", "per_channel", "compact"])
@pytest.mark.parametrize("vfmt", INTS, ids=[NAMES[f] for f in INTS])
def test_every_value_format_and_zero_points(vfmt, kG):
    q, pg, kv_len, q_pos, scale, want = build(600 + vfmt, 3, vfmt, kG, 16, 4, 64, 16, (77, 150))
    assert pg.formats["v"].tolist() == [vfmt] * len(pg.formats["v"])
    Hkv = pg.kd.shape[1]
    zero = np.concatenate([np.frombuffer(p.tobytes()[4 * Hkv : 8 * Hkv], np.float32) for p in pg.pages["v"]])
    assert (np.count_nonzero(zero) > 0) == (vfmt in (2, 21, 25))  # unsigned: asymmetric, zero points != 0
    check(q, pg, kv_len, q_pos, scale, want)


@needs_amx
@pytest.mark.parametrize("kG", [1, "D"], ids=["per_head", "per_channel"])
def test_per_channel_values_keep_the_avx512_tiles(kG):
    # per-channel value scales (and every value) keep the AVX-512 tiles: the same results with AMX keys on and off
    q, pg, kv_len, q_pos, scale, want = build(650, (3, 22, 2), (3, 21, 25), kG, 16, 4, 64, 16, (61, 130), vG=64)
    assert pg.group["v"] == 64
    check(q, pg, kv_len, q_pos, scale, want)


@needs_amx
def test_float_pages_only():
    # nothing quantized: AMX has nothing to do, the unit still configures and releases the tiles
    check(*build(700, (1, 10, 16), (1, 10, 16), 1, 16, 4, 64, 16, (40, 97)))


@needs_amx
@pytest.mark.parametrize("vfmt", [3, 21], ids=["i8", "u4"])
def test_long_context_and_peaked_rows(vfmt):
    # thousands of keys: many running-max rescales; spread query rows make some rows' probabilities peaked and
    # others flat.  Both modes stay within 1e-5 of the twin: the AVX-512 p.v tiles apply the uint4 zero points'
    # share per tile (deferred to the end of the work unit, it reached ~3e-5 here).
    q, pg, kv_len, q_pos, scale, want = build(800 + vfmt, 22, vfmt, 1, 8, 2, 128, 16, (3001, 1700), spread=True)
    old = K.get_num_threads()
    try:
        for threads in (1, 2):
            K.set_num_threads(threads)
            for amx in MODES:
                A.set_attention_amx(amx)
                out = np.full_like(q, np.nan)
                pg.kernel(q, 2, kv_len, q_pos, scale, 0.0, -1, out)
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    finally:
        K.set_num_threads(old)
        reset_level()
        A.set_attention_amx(True)


@needs_amx
@pytest.mark.parametrize("kG", [1, "D", "Dc"], ids=["per_head", "per_channel", "compact"])
@pytest.mark.parametrize("G", range(1, 9))
def test_query_rows_per_kv_head(G, kG):
    # 1..8 rows share each KV head: one C tile up to 5 rows, two from 6 (per-channel keys: the fifth row of a tile
    # merged into columns 12..14)
    check(*build(200 + G, 2, 3, kG, 2 * G, 2, 64, 16, (50, 83), offset=8.0 if kG != 1 else 0.0))


@needs_amx
@pytest.mark.parametrize("kG", [1, "D", "Dc"], ids=["per_head", "per_channel", "compact"])
def test_mixed_pages_with_float_pages_between(kG):
    # B tiles are rebuilt when the code order changes (8 -> 4 -> 2 bits) and float pages keep the AVX-512 tiles
    spec = (3, 1, 22, 10, 2, 16, 25, 21, 26)
    q, pg, kv_len, q_pos, scale, want = build(300, spec, (3, 1), kG, 32, 8, 40, 16, (150, 211))
    assert len(set(pg.formats["k"].tolist())) >= 6
    check(q, pg, kv_len, q_pos, scale, want)


@needs_amx
@pytest.mark.parametrize("rg", [3, 4, 8])
@pytest.mark.parametrize("Sq", [3, 9])
@pytest.mark.parametrize("kG", [1, "D", "Dc"], ids=["per_head", "per_channel", "compact"])
def test_prefill(kG, Sq, rg):
    # prefill row groups of rg rows (up to 8: two C tiles), several query tokens per unit
    old = A._set_prefill_rg(rg)
    try:
        check(*build(400 + Sq, (3, 22, 2, 1), 3, kG, 16, 4, 64, 16, (40, 66), Sq=Sq))
    finally:
        A._set_prefill_rg(old)


@needs_amx
@pytest.mark.parametrize("kG", [1, "D", "Dc"], ids=["per_head", "per_channel", "compact"])
@pytest.mark.parametrize("fmt", [3, 2, 21])
def test_query_rows_of_different_magnitudes_and_a_zero_row(fmt, kG):
    # each row has its own fixed-point step S_r = max|q_r| / (127 * 2^16); an all-zero row has S_r = 0
    q, pg, kv_len, q_pos, scale, want = build(500 + fmt, fmt, 3, kG, 32, 8, 128, 16, (90, 45), spread=True)
    got = check(q, pg, kv_len, q_pos, scale, want)
    # a zero query row attends uniformly: the mean of its visible values
    np.testing.assert_allclose(got[0, 0, 0], pg.vd[0, 0, :90].mean(axis=0), rtol=1e-5, atol=1e-5)
    assert np.ptp(np.abs(q).max(axis=-1)) > 1.0  # the rows' magnitudes do differ


def test_switch_and_level_name():
    widest = K.simd_levels()[-1]
    try:
        K.set_simd_enabled(True)
        A.set_attention_avx512(True)
        assert A.set_attention_amx(False) is False
        assert A.attention_simd_level() == widest
        assert A.set_attention_amx(True) is AMX
        assert A.attention_simd_level() == ("avx512+amx" if AMX else widest)
        A.set_attention_avx512(False)  # AMX runs inside the AVX-512 tiles only
        assert A.attention_simd_level() == ("avx2" if "avx2" in K.simd_levels() else "scalar")
        K.set_simd_enabled(False)
        assert A.attention_simd_level() == "scalar"
    finally:
        reset_level()
        A.set_attention_amx(True)


@needs_amx
@pytest.mark.parametrize("lines", [0, 1, 8, 24, 48, 1000])
@pytest.mark.parametrize("D, bs", [(128, 16), (40, 5), (64, 32)])
@pytest.mark.parametrize("kG", [1, "D", "Dc"], ids=["per_head", "per_channel", "compact"])
def test_prefetch_split_keeps_results(kG, D, bs, lines):
    # _set_prefetch_qk_lines moves part of the next block's prefetch from the AMX key tiles into the p.v loop
    # of the item before (1 line: none with the keys; 1000: all of it); a schedule change, so the results are
    # bit for bit those of the default, for mixed pages (float pages between) and head sizes with (128, 64) and
    # without (40) a whole 4-chunk p.v pass
    spec = (3, 22, 1, 2, 10, 21)
    q, pg, kv_len, q_pos, scale, want = build(700 + D, spec, (3, 22, 1), kG, 32, 8, D, bs, (203, 77))
    old, old_threads = A._set_prefetch_qk_lines(48), K.get_num_threads()
    try:
        for threads in (1, 2):
            K.set_num_threads(threads)
            A._set_prefetch_qk_lines(48)
            ref = np.full_like(q, np.nan)
            pg.kernel(q, 8, kv_len, q_pos, scale, 0.0, -1, ref)
            np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
            A._set_prefetch_qk_lines(lines)
            out = np.full_like(q, np.nan)
            pg.kernel(q, 8, kv_len, q_pos, scale, 0.0, -1, out)
            np.testing.assert_array_equal(out, ref)
    finally:
        A._set_prefetch_qk_lines(old)
        K.set_num_threads(old_threads)
    assert A._set_prefetch_qk_lines(-3) == 48 and A._set_prefetch_qk_lines(48) == 0  # clamped to >= 0
