"""C-speed argument checks of attention / paged_attention.

Valid calls are checked in C and never reach the Python checks of
onnxkv._kernels._validate (counted); every argument the C checks refuse is
sent through those checks, which raise today's error naming it and write
nothing.  Results are compared with the NumPy twins (onnxkv._kernels.reference).
"""

import numpy as np
import pytest

import onnxkv._kernels as K
from onnxkv._kernels import _validate as V
from onnxkv._kernels import reference as R

from .conftest import rand
from .test_attention import make
from .test_paged_attention import Paged, to_cache
from .test_quant_attention import QPaged


@pytest.fixture
def validate_calls(monkeypatch):
    """Names of the ``_validate`` functions called while the test runs (every
    public function of the module is wrapped): empty when every call was
    checked in C."""
    calls = []

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in list(vars(V).items()):
        if callable(fn) and not isinstance(fn, type) and getattr(fn, "__module__", None) == V.__name__:
            monkeypatch.setattr(V, name, counting(name, fn))
    return calls


# ---------------------------------------------------------------- attention: valid calls


def _kv(rng, dtype, shape):
    """Random K/V storage of ``dtype`` and its float32 values (bfloat16: uint16 bits)."""
    x = rand(rng, shape)
    store = to_cache(x, dtype)
    return store, (R.f32_from_bf16(store) if dtype == "bfloat16" else store.astype(np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("Sq, window, softcap, padded", [(1, -1, 0.0, False), (5, 3, 30.0, True)])
def test_attention_valid_calls_skip_python_checks(validate_calls, threads, dtype, Sq, window, softcap, padded):
    rng = np.random.default_rng(31)
    B, Hq, Hkv, Cap, D = 2, 8, 2, 40, 16
    q = rand(rng, (B, Hq, Sq, D))
    k, kf = _kv(rng, dtype, (B, Hkv, Cap, D))
    v, vf = _kv(rng, dtype, (B, Hkv, Cap, D))
    kv_len = np.array([17, 40], np.int32)
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)).astype(np.int32)
    kv_start = np.array([0, 3], np.int32) if padded else None
    out, want = np.full_like(q, np.nan), np.empty_like(q)
    k.flags.writeable = False  # a read-only cache is valid
    K.attention(
        q,
        k,
        v,
        kv_len,
        q_pos,
        D**-0.5,
        softcap,
        window,
        out,
        kv_start,
        kv_dtype="bfloat16" if dtype == "bfloat16" else None,
    )
    assert validate_calls == []
    R.attention(q, kf, vf, kv_len, q_pos, D**-0.5, softcap, window, want, kv_start=kv_start)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_attention_memmap_and_explicit_kv_dtype_skip_python_checks(validate_calls, tmp_path):
    """ndarray subclasses and an explicit kv_dtype name pass the C checks."""
    rng = np.random.default_rng(32)
    q, k, v = make(rng, 1, 4, 2, 1, 24, 32)
    mapped = np.memmap(tmp_path / "k.bin", dtype=np.float32, mode="w+", shape=k.shape)
    mapped[...] = k
    kv_len, q_pos = np.array([20], np.int32), np.array([[19]], np.int32)
    out, want = np.empty_like(q), np.empty_like(q)
    K.attention(q, mapped, v, kv_len, q_pos, 0.2, 0.0, -1, out, kv_dtype="float32")
    assert validate_calls == []
    R.attention(q, k, v, kv_len, q_pos, 0.2, 0.0, -1, want)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_attention_uncommon_valid_arguments_take_python_checks(validate_calls):
    """Valid arguments outside the C checks' cases (an int scale, a NumPy dtype
    as kv_dtype, an empty cache) still run, through the Python checks."""
    rng = np.random.default_rng(33)
    q, k, v = make(rng, 1, 4, 2, 1, 24, 32)
    kv_len, q_pos = np.array([20], np.int32), np.array([[19]], np.int32)
    out, want = np.empty_like(q), np.empty_like(q)
    K.attention(q, k, v, kv_len, q_pos, 1, 0.0, -1, out, kv_dtype=np.float32)
    assert validate_calls[:1] == ["array"]
    R.attention(q, k, v, kv_len, q_pos, 1.0, 0.0, -1, want)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    validate_calls.clear()
    empty = np.empty((1, 2, 0, 32), np.float32)
    K.attention(q, empty, empty.copy(), np.zeros(1, np.int32), q_pos, 0.2, 0.0, -1, out)
    assert validate_calls[:1] == ["array"] and np.all(out == 0.0)


# ---------------------------------------------------------------- attention: invalid calls


def _attention_refusals():
    """(call(out), exact message) for arguments the C checks must hand to the Python checks."""
    rng = np.random.default_rng(34)
    q, k, v = make(rng, 2, 4, 2, 3, 10, 8)
    kl = np.array([5, 10], np.int32)
    qp = (kl[:, None] - 3 + np.arange(3)).astype(np.int32)
    ok = dict(q=q, k=k, v=v, kv_len=kl, q_pos=qp, scale=0.3, softcap=0.0, window=-1)
    swapped = q.dtype.newbyteorder()
    h16 = k.astype(np.float16)
    k3 = rand(rng, (2, 3, 10, 8))
    return [
        (dict(ok, q=q.astype(swapped)), f"q: dtype {swapped} is not supported (expected float32)"),
        (dict(ok, q=q.tolist()), "q: expected a numpy.ndarray, got list"),
        (dict(ok, q=np.asfortranarray(q)), "q: array must be C-contiguous"),
        (dict(ok, k=k[:, :, :, :4].copy()), "k: expected shape [2, Hkv, Cap, 8], got (2, 2, 10, 4)"),
        (dict(ok, k=k3, v=k3.copy()), "k: number of KV heads 3 must divide the number of query heads 4"),
        (
            dict(ok, k=k.view(np.uint16)[..., ::2].copy(), v=v.view(np.uint16)[..., ::2].copy()),
            "k: uint16 arrays are only accepted as bfloat16 bit patterns with kv_dtype='bfloat16'",
        ),
        (dict(ok, k=h16), "v: dtype float32 does not match k dtype float16 (K and V must share the element type)"),
        (dict(ok, k=h16, v=h16.copy(), kv_dtype="bfloat16"), "k: dtype float16 is not supported (expected uint16)"),
        (dict(ok, v=v[:, :, ::2]), "v: expected shape (2, 2, 10, 8), got (2, 2, 5, 8)"),
        (dict(ok, kv_len=kl.astype(np.int64)), "kv_len: dtype int64 is not supported (expected int32)"),
        (dict(ok, kv_len=np.array([5, 11], np.int32)), "kv_len: values must be in [0, 10], got range [5, 11]"),
        (dict(ok, kv_len=np.array([-1, 5], np.int32)), "kv_len: values must be in [0, 10], got range [-1, 5]"),
        (dict(ok, q_pos=qp[:, :2].copy()), "q_pos: expected shape (2, 3), got (2, 2)"),
        (dict(ok, q_pos=qp.astype(np.uint32)), "q_pos: dtype uint32 is not supported (expected int32)"),
        (dict(ok, kv_start=np.array([0, 11], np.int32)), "kv_start: values must be in [0, 10], got range [0, 11]"),
        (dict(ok, kv_start=np.array([0, 1, 2], np.int32)), "kv_start: expected shape (2,), got (3,)"),
        (dict(ok, scale=float("nan")), "scale: must be finite, got nan"),
        (dict(ok, softcap=-1.0), "softcap: must be finite and >= 0, got -1.0"),
        (dict(ok, window=-2), "window: must be in [-1, 4611686018427387904] (-1 = unlimited), got -2"),
        # p - window overflowed int64 (an OverflowError, or a wrapped window in C); a float was truncated
        (
            dict(ok, window=2**63),
            "window: must be in [-1, 4611686018427387904] (-1 = unlimited), got 9223372036854775808",
        ),
        (dict(ok, window=2.0), "window: expected an int, got float"),
        (dict(ok, kv_dtype="int8"), "kv_dtype: must be None, 'float32', 'float16' or 'bfloat16', got 'int8'"),
    ]


@pytest.mark.parametrize("case", range(len(_attention_refusals())))
def test_attention_refusals_keep_named_errors(case):
    kw, message = _attention_refusals()[case]
    out = np.full((2, 4, 3, 8), 42.0, np.float32)
    with pytest.raises(ValueError) as err:
        K.attention(out=out, **kw)
    assert str(err.value) == message
    assert np.all(out == 42.0)


def test_attention_refuses_bad_out_and_overlaps_without_writing():
    rng = np.random.default_rng(35)
    q, k, v = make(rng, 1, 2, 2, 1, 4, 8)
    kl, qp = np.array([4], np.int32), np.array([[3]], np.int32)
    readonly = np.full_like(q, 7.0)
    readonly.flags.writeable = False
    big = rand(rng, (1, 2, 4, 8))
    kept = big.copy()
    q_kept = q.copy()
    cases = [
        (lambda: K.attention(q, k, v, kl, qp, 1.0, 0.0, -1, readonly), "out: array must be writeable"),
        (
            lambda: K.attention(q, k, v, kl, qp, 1.0, 0.0, -1, np.full((1, 2, 1, 4), 7.0, np.float32)),
            "out: expected shape (1, 2, 1, 8), got (1, 2, 1, 4)",
        ),
        (lambda: K.attention(q, k, v, kl, qp, 1.0, 0.0, -1, q), "out: must not overlap q"),
        (
            lambda: K.attention(q, big, v, kl, qp, 1.0, 0.0, -1, big.reshape(-1)[:16].reshape(q.shape)),
            "out: must not overlap k",
        ),
        (
            lambda: K.attention(q, k, big, kl, qp, 1.0, 0.0, -1, big.reshape(-1)[48:].reshape(q.shape)),
            "out: must not overlap v",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == message
    np.testing.assert_array_equal(big, kept)
    np.testing.assert_array_equal(q, q_kept)
    assert np.all(readonly == 7.0)


# ---------------------------------------------------------------- paged_attention: valid calls


@pytest.mark.parametrize("Sq, window", [(1, -1), (6, 4)])
def test_paged_valid_calls_skip_python_checks(validate_calls, threads, Sq, window):
    rng = np.random.default_rng(41)
    B, Hq, Hkv, Cap, D, bs = 2, 8, 2, 37, 16, 8
    q = rand(rng, (B, Hq, Sq, D))
    k, v = rand(rng, (B, Hkv, Cap, D)), rand(rng, (B, Hkv, Cap, D))
    kv_len = np.array([21, 37], np.int32)
    q_pos = (kv_len[:, None] - Sq + np.arange(Sq)).astype(np.int32)
    read = _blocks_read(kv_len, q_pos, window, bs, -(-Cap // bs))
    pg = Paged(rng, k, v, bs, read)  # unread blocks: -1
    out, want = np.full_like(q, np.nan), np.empty_like(q)
    figures = K.paged_attention(q, pg.k_addr, pg.v_addr, pg.table, bs, Hkv, kv_len, q_pos, D**-0.5, 0.0, window, out)
    assert validate_calls == []
    assert figures["dequantized_bytes"] == 0 and figures["workspace_peak_bytes"] > 0
    R.attention(q, k, v, kv_len, q_pos, D**-0.5, 0.0, window, want)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("header, group", [("float32", 1), ("compact", 16)])
def test_paged_quantized_valid_calls_skip_python_checks(validate_calls, header, group):
    rng = np.random.default_rng(42)
    D = 16
    q = rand(rng, (1, 4, 1, D))
    pg = QPaged(
        rng,
        rand(rng, (1, 2, 32, D)),
        rand(rng, (1, 2, 32, D)),
        8,
        lambda p: (3, 22, 1, 25)[p % 4],
        lambda p: (2, 10, 26, 21)[p % 4],
        group,
        1,
        header,
    )
    kv_len, q_pos = np.array([30], np.int32), np.array([[29]], np.int32)
    out, want = np.full_like(q, np.nan), np.empty_like(q)
    figures = pg.kernel(q, 2, kv_len, q_pos, 0.25, 0.0, -1, out)
    assert validate_calls == []
    assert figures["dequantized_bytes"] > 0
    R.attention(q, pg.kd, pg.vd, kv_len, q_pos, 0.25, 0.0, -1, want)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    # one plane's formats given: the other is all kv_dtype pages (float32 V here)
    float_v = QPaged(rng, rand(rng, (1, 2, 32, D)), rand(rng, (1, 2, 32, D)), 8, lambda p: 3, lambda p: 1, 1, 1)
    out2, want2 = np.full_like(q, np.nan), np.empty_like(q)
    K.paged_attention(
        q,
        float_v.addr["k"],
        float_v.addr["v"],
        float_v.table,
        8,
        2,
        kv_len,
        q_pos,
        0.25,
        0.0,
        -1,
        out2,
        k_formats=float_v.formats["k"],
    )
    assert validate_calls == []
    R.attention(q, float_v.kd, float_v.vd, kv_len, q_pos, 0.25, 0.0, -1, want2)
    np.testing.assert_allclose(out2, want2, rtol=1e-4, atol=1e-4)


def test_paged_table_checks_match_python_rule(validate_calls):
    """Random tables with holes, unordered positions and windows: a call is
    accepted exactly when the Python rule (paged_blocks_read + page_tables)
    accepts its table, and an accepted call never reached the Python checks."""
    rng = np.random.default_rng(43)
    B, Hq, Hkv, Cap, D, bs = 3, 4, 2, 48, 8, 4
    k, v = rand(rng, (B, Hkv, Cap, D)), rand(rng, (B, Hkv, Cap, D))
    pg = Paged(rng, k, v, bs)
    accepted = refused = 0
    for trial in range(60):
        Sq = int(rng.integers(1, 7))
        window = int(rng.choice([-1, 0, 3, 9]))
        kv_len = rng.integers(0, Cap + 1, B).astype(np.int32)
        q_pos = rng.integers(-3, Cap + 2, (B, Sq)).astype(np.int32)
        table = pg.table.copy()
        holes = rng.random(table.shape) < 0.15
        table[holes] = rng.choice([-1, 10**6], holes.sum())
        read = _blocks_read(kv_len, q_pos, window, bs, table.shape[1])
        ids = table[read]
        valid = bool(np.all((ids >= 0) & (ids < len(pg.k_addr))))
        q = rand(rng, (B, Hq, Sq, D))
        out = np.full_like(q, 42.0)
        validate_calls.clear()
        if valid:
            K.paged_attention(q, pg.k_addr, pg.v_addr, table, bs, Hkv, kv_len, q_pos, 0.3, 0.0, window, out)
            assert validate_calls == [], f"trial {trial}"
            want = np.empty_like(q)
            R.paged_attention(q, pg.k_pages, pg.v_pages, table, bs, Hkv, kv_len, q_pos, 0.3, 0.0, window, want)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            accepted += 1
        else:
            with pytest.raises(ValueError, match=r"block_tables: row \d+, block \d+ .* holds visible keys"):
                K.paged_attention(q, pg.k_addr, pg.v_addr, table, bs, Hkv, kv_len, q_pos, 0.3, 0.0, window, out)
            assert np.all(out == 42.0)
            refused += 1
    assert accepted >= 10 and refused >= 10


def _blocks_read(kv_len, q_pos, window, bs, n_blocks):
    """bool [B, n_blocks] of the blocks holding a key some query sees, one token at a time (the rule itself)."""
    read = np.zeros((len(kv_len), n_blocks), bool)
    for b in range(len(kv_len)):
        for p in q_pos[b].tolist():
            lo = max(p - window, 0) if window >= 0 else 0
            hi = min(p + 1, int(kv_len[b]))
            if lo < hi:
                read[b, lo // bs : (hi - 1) // bs + 1] = True
    return read


# ---------------------------------------------------------------- paged_attention: invalid calls


def _paged_refusals():
    """(keyword arguments, exception type, exact message) the C checks must hand to the Python checks."""
    rng = np.random.default_rng(44)
    B, Hq, Hkv, D, bs = 2, 4, 2, 8, 4
    q = rand(rng, (B, Hq, 2, D))
    pg = Paged(rng, rand(rng, (B, Hkv, 16, D)), rand(rng, (B, Hkv, 16, D)), bs)
    kl, qp = np.array([9, 16], np.int32), np.array([[7, 8], [14, 15]], np.int32)
    ok = dict(
        q=q,
        k_pages=pg.k_addr,
        v_pages=pg.v_addr,
        block_tables=pg.table,
        block_size=bs,
        kv_heads=Hkv,
        kv_len=kl,
        q_pos=qp,
        scale=0.3,
        softcap=0.0,
        window=-1,
    )
    P = len(pg.k_addr)
    t = pg.table.copy()
    t[1, 2] = P
    kz = pg.k_addr.copy()
    kz[pg.table[1, 0]] = 0
    vm = pg.v_addr.copy()
    vm[pg.table[0, 2]] += 8
    fmt = np.ones(P, np.uint8)
    odd = fmt.copy()
    odd[3] = 4
    swapped = q.dtype.newbyteorder()
    return [
        (dict(ok, q=q.astype(swapped)), ValueError, f"q: dtype {swapped} is not supported (expected float32)"),
        (
            dict(ok, block_tables=t),
            ValueError,
            f"block_tables: row 1, block 2 (keys [8, 12)) holds visible keys but its entry is {P} "
            f"(expected a page id in [0, {P}))",
        ),
        (
            dict(ok, k_pages=kz),
            ValueError,
            f"k_pages: page {pg.table[1, 0]} (block_tables row 1, block 0) is read but its address is 0 (no page)",
        ),
        (
            dict(ok, v_pages=vm),
            ValueError,
            f"v_pages: page {pg.table[0, 2]} (block_tables row 0, block 2) is read but its address is "
            f"{int(vm[pg.table[0, 2]]):#x}, not 64-byte aligned",
        ),
        (dict(ok, v_pages=pg.v_addr[:-1].copy()), ValueError, f"v_pages: expected shape ({P},), got ({P - 1},)"),
        (
            dict(ok, k_pages=pg.k_addr.astype(np.int64)),
            ValueError,
            "k_pages: dtype int64 is not supported (expected uint64)",
        ),
        (dict(ok, block_tables=pg.table[:1].copy()), ValueError, "block_tables: expected shape [2, M], got (1, 4)"),
        (dict(ok, block_size=0), ValueError, "block_size: must be in [1, 2147483647], got 0"),
        (dict(ok, block_size=4.0), TypeError, "block_size: expected an int, got float"),
        (dict(ok, kv_heads=3), ValueError, "kv_heads: 3 must divide the number of query heads 4"),
        (dict(ok, kv_heads=True), TypeError, "kv_heads: expected an int, got bool"),
        (
            dict(ok, kv_len=np.array([9, 17], np.int32)),
            ValueError,
            "kv_len: values must be in [0, 16], got range [9, 17]",
        ),
        (
            dict(ok, kv_len=np.array([9, 2**32 + 4], np.int64)),
            ValueError,  # not narrowed to 4
            "kv_len: values must be in [0, 16], got range [9, 4294967300]",
        ),
        (
            dict(ok, q_pos=np.array([[7, 8], [14, 2**31]], np.int64)),
            ValueError,
            "q_pos: values must be in [-2147483648, 2147483647], got range [7, 2147483648]",
        ),
        (dict(ok, block_size=2**31), ValueError, "block_size: must be in [1, 2147483647], got 2147483648"),
        (dict(ok, kv_heads=2**63), ValueError, "kv_heads: must be in [1, 2147483647], got 9223372036854775808"),
        (
            dict(ok, window=2**62 + 1),
            ValueError,
            "window: must be in [-1, 4611686018427387904] (-1 = unlimited), got 4611686018427387905",
        ),
        (dict(ok, window=np.float64(3)), ValueError, "window: expected an int, got float64"),
        (dict(ok, q_pos=qp[:, :1].copy()), ValueError, "q_pos: expected shape (2, 2), got (2, 1)"),
        (dict(ok, window=-3), ValueError, "window: must be in [-1, 4611686018427387904] (-1 = unlimited), got -3"),
        (dict(ok, softcap=float("inf")), ValueError, "softcap: must be finite and >= 0, got inf"),
        (
            dict(ok, kv_dtype="int8"),
            ValueError,
            "kv_dtype: must be None, 'float32', 'float16' or 'bfloat16', got 'int8'",
        ),
        (
            dict(ok, k_formats=odd),
            ValueError,
            "k_formats: page 3 has format code 4, expected one of [1, 2, 3, 10, 16, 21, 22, 25, 26] (ONNX element "
            "types float32, uint8, int8, float16, bfloat16, uint4, int4, uint2, int2)",
        ),
        (dict(ok, v_formats=fmt[:-1].copy()), ValueError, f"v_formats: expected shape ({P},), got ({P - 1},)"),
        (
            dict(ok, q=rand(rng, (B, Hq, 2, 6)), v_formats=np.full(P, 25, np.uint8)),
            ValueError,
            "v_formats: format code 25 (2 bits) needs head_size * bits to be a multiple of 8, got head_size 6",
        ),
        (
            dict(ok, k_formats=fmt, k_group=2),
            ValueError,
            "k_group: must be 1 (per-head scales) or the head size 8 (per-channel), got 2",
        ),
        (dict(ok, k_formats=fmt, v_group=1.0), TypeError, "v_group: expected an int, got float"),
        (
            dict(ok, k_formats=fmt, k_header="float16"),
            ValueError,
            "k_header: expected one of 'float32', 'compact', 'channel-zp', got 'float16'",
        ),
    ]


@pytest.mark.parametrize("case", range(len(_paged_refusals())))
def test_paged_refusals_keep_named_errors(case):
    kw, exc, message = _paged_refusals()[case]
    out = np.full((2, 4, 2, kw["q"].shape[3]), 42.0, np.float32)
    with pytest.raises(exc) as err:
        K.paged_attention(out=out, **kw)
    assert str(err.value) == message
    assert np.all(out == 42.0)


def test_paged_refuses_bad_out_without_writing():
    rng = np.random.default_rng(45)
    q = rand(rng, (1, 2, 1, 8))
    pg = Paged(rng, rand(rng, (1, 2, 8, 8)), rand(rng, (1, 2, 8, 8)), 4)
    args = (pg.k_addr, pg.v_addr, pg.table, 4, 2, np.array([8], np.int32), np.array([[7]], np.int32), 0.3, 0.0, -1)
    q_kept = q.copy()
    readonly = np.full_like(q, 7.0)
    readonly.flags.writeable = False
    for out, message in (
        (readonly, "out: array must be writeable"),
        (q, "out: must not overlap q"),
        (np.full((1, 2, 8), 7.0, np.float32), "out: expected shape (1, 2, 1, 8), got (1, 2, 8)"),
    ):
        with pytest.raises(ValueError) as err:
            K.paged_attention(q, *args, out)
        assert str(err.value) == message
    np.testing.assert_array_equal(q, q_kept)
    assert np.all(readonly == 7.0)
