"""Fuzzing the operators that take page tables, lengths and positions as tensors.

``PagedCacheUpdate``, ``PagedAttention`` (after ``QuantizePagedCache`` converted some pages) and
``TensorScatter`` get random page tables (-1, duplicates, ids past the pool, 2**31, 2**63 - 1, every
integer dtype, floats, wrong shapes), random lengths and positions (the limits of every width) and
random cache dtypes.  A plain-Python model of each operator's contract decides from the inputs alone
whether a call is valid: a valid call must run and equal a NumPy reference (direct indexing, or the
``onnxkv._kernels.reference`` twin for attention); any other must raise an onnxkv error (never a raw
NumPy error) and leave every input byte, page format and payload as it was.  The paged decoder model in
a state is driven the same way and compared with its stateless run.  Budgets: ``tests/fuzzing.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from _attn_harness import build_op, make_model, owned_zeros
from fuzzing import hypothesis_settings
from hypothesis import event, given
from hypothesis import strategies as st

import onnxkv
from onnxkv._kernels import reference as R
from onnxkv.cache.page_set import PageSet
from onnxkv.errors import CacheCapacityError, InputError, OnnxkvError, OperatorError
from onnxkv.plan.context import RunContext
from onnxkv.plan.ops.paged import PagedAttention, PagedCacheUpdate
from onnxkv.plan.ops.quantize_paged_cache import QuantizePagedCache
from onnxkv.plan.ops.tensor_scatter import TensorScatter
from onnxkv.zoo.paged import PagedConfig, build_paged_model

INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
#: Integers at the limits of the widths an id, length or position may come in.
EDGES = [-(2**63), -(2**31) - 1, -(2**31), -1, 2**31 - 1, 2**31, 2**31 + 4, 2**32 + 4, 2**63 - 1, 2**64 - 1]
FLOATS = [np.float32, np.float16]
#: Errors a refused call may raise (the onnxkv errors the operators raise themselves).
REFUSED = (InputError, CacheCapacityError)


@st.composite
def int_tensor(draw, shape: tuple[int, ...], lo: int, hi: int, hostile: bool) -> np.ndarray:
    """An int32/int64 tensor of ``shape`` with values in [lo, hi], or with ``hostile`` anything: edge
    values of every width, values just past the range, any integer dtype (saturated to it), floats,
    booleans, or another shape."""
    if not hostile:
        dtype = np.dtype(draw(st.sampled_from([np.int32, np.int64])))
        return np.array(
            draw(st.lists(st.integers(lo, hi), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))), dtype
        ).reshape(shape)
    kind = draw(st.sampled_from(["int"] * 6 + ["float", "bool", "shape"]))
    if kind == "shape":
        shape = draw(st.sampled_from([(), (1,), (2, 1), shape + (1,), tuple(n + 1 for n in shape)]))
    size = int(np.prod(shape))
    values = draw(
        st.lists(
            st.one_of(st.integers(lo, hi), st.sampled_from(EDGES + [lo - 1, hi + 1])), min_size=size, max_size=size
        )
    )
    if kind in ("float", "bool"):
        return np.array(values, np.float32 if kind == "float" else bool).reshape(shape)
    dtype = np.dtype(draw(st.sampled_from(INTS)))
    info = np.iinfo(dtype)
    return np.array([min(max(v, int(info.min)), int(info.max)) for v in values], dtype).reshape(shape)


@st.composite
def page_table(draw, batch: int, max_blocks: int, num_pages: int, hostile: bool) -> np.ndarray:
    """A block table [batch, max_blocks]: distinct pages in random order while there are pages, then random
    entries in [-1, num_pages) (duplicates, and -1 where unused blocks may be); hostile: see int_tensor."""
    if hostile:
        return draw(int_tensor((batch, max_blocks), -1, num_pages - 1, True))
    size = batch * max_blocks
    pages = draw(st.permutations(range(num_pages)))[:size]
    rest = draw(st.lists(st.integers(-1, num_pages - 1), min_size=size - len(pages), max_size=size - len(pages)))
    return np.array(pages + rest, draw(st.sampled_from([np.int32, np.int64]))).reshape(batch, max_blocks)


def int_values(a: np.ndarray) -> list[int] | None:
    """The values of an integer tensor as exact Python ints, or None for another dtype."""
    if a.dtype.kind not in "iu":
        return None
    return [int(x) for x in a.reshape(-1).tolist()]


def check_refused(call, *untouched) -> None:
    """``call()`` raises an onnxkv error of the operators and leaves ``untouched`` byte for byte."""
    before = [a.tobytes() for a in untouched]
    with pytest.raises(REFUSED) as info:
        call()
    event(f"refused: {type(info.value).__name__}")
    assert [a.tobytes() for a in untouched] == before


def run_context() -> RunContext:
    return RunContext(lambda rt, index, shape, dtype: np.empty(shape, dtype), recording=False, step=0)


def paged_cache(draw, planes: bool) -> tuple[np.random.Generator, np.ndarray]:
    """A seeded generator for the call's data, and a random float32/float16 page tensor [P, (2,) H, bs, D]
    owning its buffer, 64-byte aligned or not."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = np.dtype(draw(st.sampled_from(FLOATS)))
    p, h, bs, d = (
        draw(st.integers(0, 12)),
        draw(st.integers(1, 2)),
        draw(st.sampled_from([1, 2, 4])),
        draw(st.sampled_from([4, 8, 16])),
    )
    shape = (p, 2, h, bs, d) if planes else (p, h, bs, d)
    cache = owned_zeros(shape, dtype, draw(st.sampled_from([0, 16])))
    cache[...] = rng.standard_normal(shape)
    return rng, cache


def written_slots(starts: list[int], count: int, table: np.ndarray, bs: int) -> list[tuple[int, int, int]]:
    """(row, page, offset) of every token row ``b`` writes at ``starts[b] .. starts[b] + count - 1``."""
    return [(b, int(table[b, (p + t) // bs]), (p + t) % bs) for b, p in enumerate(starts) for t in range(count)]


def bad_table(table: np.ndarray, batch: int) -> bool:
    """True if ``table`` is not an int32/int64 [batch, M >= 1] block table."""
    return table.dtype not in (np.int32, np.int64) or table.ndim != 2 or table.shape[0] != batch or table.shape[1] < 1


def fitting_starts(starts: np.ndarray, batch: int, scalar_ok: bool, count: int, limit: int) -> list[int] | None:
    """Per-row starts as Python ints when ``starts`` is an integer [batch] (or a scalar when
    ``scalar_ok``) whose rows fit ``count`` tokens in [0, limit), else None."""
    values = int_values(starts)
    if values is None or not (starts.shape == (batch,) or (scalar_ok and starts.ndim == 0)):
        return None
    rows = values * batch if starts.ndim == 0 else values
    return rows if all(0 <= v <= limit - count for v in rows) else None


# -- PagedCacheUpdate ---------------------------------------------------------------------------------------------


@hypothesis_settings(60)
@given(data=st.data())
def test_paged_cache_update_is_refused_or_writes_exactly_its_slots(data):
    draw = data.draw
    rng, cache = paged_cache(draw, False)
    dtype, (num_pages, heads, bs, d) = cache.dtype, cache.shape
    b, s, m = draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(1, 4))
    hostile = draw(st.booleans())
    table = draw(page_table(b, m, num_pages, hostile and draw(st.booleans())))
    pos = draw(int_tensor(draw(st.sampled_from([(b,), ()])), 0, max(m * bs - s, 0), hostile and draw(st.booleans())))
    values = rng.standard_normal((b, heads, s, d)).astype(dtype)
    op = build_op(
        PagedCacheUpdate,
        make_model(
            "PagedCacheUpdate",
            {"cache": cache, "page_id": table, "values": values, "position": pos},
            ["out"],
            {"": 21, "ai.onnxkv": 1},
            domain="ai.onnxkv",
            block_size=bs,
        ),
    )
    call = lambda: op.run([cache, table, values, pos], run_context())  # noqa: E731

    starts = None if bad_table(table, b) else fitting_starts(pos, b, True, s, table.shape[1] * bs)
    slots = [] if starts is None else written_slots(starts, s, table, bs)
    valid = (
        starts is not None
        and all(0 <= page < num_pages for _, page, _ in slots)
        and len({(page, offset) for _, page, offset in slots}) == len(slots)
    )
    if not valid:
        check_refused(call, cache)
        return
    event("valid")
    expected = cache.copy()
    for i, (row, page, offset) in enumerate(slots):
        expected[page, :, offset] = values[row, :, i % s]
    (out,) = call()
    assert out is cache
    np.testing.assert_array_equal(cache, expected)


# -- QuantizePagedCache, then PagedAttention over the converted pages ---------------------------------------------


def quantize(draw, cache: np.ndarray) -> tuple[PageSet | None, set[int]]:
    """Run QuantizePagedCache with random block_indices (int8 keys, float16 values) on ``cache``; returns its
    handle and the converted pages, or (None, {}) when the call was (rightly) refused or converted nothing."""
    num_pages, _, heads, _, _ = cache.shape
    hostile = draw(st.booleans())
    n = draw(st.integers(0, num_pages + 1))
    indices = (
        draw(int_tensor((n,), 0, num_pages - 1, hostile))
        if hostile
        else np.array(draw(st.permutations(range(num_pages)))[:n], draw(st.sampled_from([np.int32, np.int64])))
    )
    count = indices.size
    feeds = {
        "cache": cache,
        "block_indices": indices,
        "key_scale": np.full((count, heads), 0.05, np.float32),
        "key_zero_point": np.zeros((count, heads), np.int8),
        "value_scale": np.zeros(0, np.float32),
        "value_zero_point": np.zeros(0, np.float16),
    }
    op = build_op(
        QuantizePagedCache, make_model("QuantizePagedCache", feeds, ["out"], {"": 21, "ai.rt": 1}, domain="ai.rt")
    )
    ids = int_values(indices)
    valid = (
        indices.dtype in (np.int32, np.int64)
        and indices.ndim == 1
        and all(0 <= i < num_pages for i in ids)
        and len(set(ids)) == len(ids)
    )
    if not valid:
        check_refused(lambda: op.run(list(feeds.values()), run_context()), cache)
        handle = PageSet.of(cache)
        assert handle is None or not handle.any_converted
        return handle, set()
    before = cache.copy()
    rt = run_context()
    op.run(list(feeds.values()), rt)
    rt.finish(True)
    handle = PageSet.of(cache)
    if not ids:
        return handle, set()
    native = handle.native.code
    for page in range(num_pages):
        for plane, reference in ((0, None), (1, before[page, 1].astype(np.float16))):
            got = handle.page_values(plane, page)
            if page not in ids:
                assert handle.formats[plane, page] == native
                np.testing.assert_array_equal(got, before[page, plane].astype(np.float32))
            elif plane == 0:  # int8 codes of scale 0.05: each value within half a step (or saturated)
                want = np.clip(before[page, 0].astype(np.float32), -128 * 0.05, 127 * 0.05)
                np.testing.assert_allclose(got, want, atol=0.025 + 1e-6, rtol=0)
            else:
                np.testing.assert_array_equal(got, reference.astype(np.float32))
    return handle, set(ids)


def logical_kv(cache: np.ndarray, handle: PageSet | None, table: np.ndarray, row: int, length: int, bs: int):
    """Keys and values [1, H, length, D] float32 of ``row``'s first ``length`` positions, through ``table``."""
    out = []
    for plane in (0, 1):
        tokens = []
        for j in range(length):
            page = int(table[row, j // bs])
            values = handle.page_values(plane, page) if handle is not None else cache[page, plane].astype(np.float32)
            tokens.append(values[:, j % bs])
        heads, d = cache.shape[2], cache.shape[4]
        out.append(np.stack(tokens, axis=1)[None] if tokens else np.zeros((1, heads, 0, d), np.float32))
    return out


@hypothesis_settings(60)
@given(data=st.data())
def test_paged_attention_is_refused_or_matches_the_reference(data):
    draw = data.draw
    rng, cache = paged_cache(draw, True)
    dtype, (num_pages, _, hkv, bs, d) = cache.dtype, cache.shape
    handle, converted = quantize(draw, cache) if num_pages and draw(st.booleans()) else (None, set())
    hq = hkv * draw(st.integers(1, 2))
    b, s, m = draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(1, 4))
    max_tokens = draw(st.integers(1, m * bs + 1))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([-1, 0, 2, 5, 2**62, 2**63 - 1])) if causal else -1
    softcap = draw(st.sampled_from([0.0, 2.0]))
    hostile = draw(st.booleans())
    table = draw(page_table(b, m, num_pages, hostile and draw(st.booleans())))
    seqlens = draw(int_tensor((b,), 0, max(max_tokens - s, 0), hostile and draw(st.booleans())))
    q, k, v = (rng.standard_normal((b, s, heads * d)).astype(dtype) for heads in (hq, hkv, hkv))
    feeds = {"Q": q, "K": k, "V": v, "past": cache, "block_table": table, "seqlens_k": seqlens}
    op = build_op(
        PagedAttention,
        make_model(
            "PagedAttention",
            feeds,
            ["Y", "present"],
            {"": 21, "ai.rt": 1},
            domain="ai.rt",
            num_heads=hq,
            kv_num_heads=hkv,
            block_size=bs,
            max_tokens=max_tokens,
            is_causal=int(causal),
            left_window_size=window,
            softcap=softcap,
        ),
    )
    call = lambda: op.run(list(feeds.values()), run_context())  # noqa: E731

    lengths = (
        None
        if bad_table(table, b) or max_tokens > table.shape[1] * bs
        else fitting_starts(seqlens, b, False, s, max_tokens)
    )
    valid = lengths is not None
    if valid and s and b:
        first = [0 if window < 0 else max(n - window, 0) for n in lengths]
        used = [int(table[row, i]) for row in range(b) for i in range(first[row] // bs, -(-(lengths[row] + s) // bs))]
        slots = written_slots(lengths, s, table, bs)
        valid = (
            all(0 <= page < num_pages for page in used)
            and len({(page, offset) for _, page, offset in slots}) == len(slots)
            and not any(page in converted for _, page, _ in slots)
        )
    if not valid:
        formats = None if handle is None else handle.formats.copy()
        check_refused(call, cache)
        if handle is not None:
            np.testing.assert_array_equal(handle.formats, formats)
        return
    event(
        f"valid ({'converted pages' if converted else 'native pages'}, "
        f"{'aligned' if cache.__array_interface__['data'][0] % 64 == 0 else 'unaligned'})"
    )
    expected = cache.copy()
    if s and b:
        for i, (row, page, offset) in enumerate(written_slots(lengths, s, table, bs)):
            expected[page, 0, :, offset] = k[row].reshape(s, hkv, d)[i % s]
            expected[page, 1, :, offset] = v[row].reshape(s, hkv, d)[i % s]
    y, present = call()
    assert present is cache and y.shape == q.shape and y.dtype == dtype
    native = np.array([p not in converted for p in range(num_pages)], bool)
    np.testing.assert_array_equal(cache[native], expected[native])
    scale = 1 / np.sqrt(d)
    for row in range(b if s else 0):
        kv_len = lengths[row] + s
        keys, values = logical_kv(cache, handle, table, row, kv_len, bs)
        q_pos = np.arange(lengths[row], kv_len)[None] if causal else np.full((1, s), kv_len - 1)
        want = np.empty((1, hq, s, d), np.float32)
        R.attention(
            q[row].reshape(1, s, hq, d).transpose(0, 2, 1, 3).astype(np.float32),
            keys,
            values,
            np.array([kv_len]),
            q_pos,
            scale,
            softcap,
            window if window < max_tokens else -1,
            want,
        )
        tol = 5e-3 if dtype == np.float16 else 1e-4
        np.testing.assert_allclose(
            y[row].reshape(s, hq, d).astype(np.float32), want[0].transpose(1, 0, 2), rtol=tol, atol=tol
        )


# -- TensorScatter ------------------------------------------------------------------------------------------------


@hypothesis_settings(60)
@given(data=st.data())
def test_tensor_scatter_is_refused_or_matches_the_spec_loop(data):
    draw = data.draw
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b, length = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    dtype = np.dtype(draw(st.sampled_from([np.float32, np.float16, np.int32, np.uint8])))
    past = (rng.standard_normal((b, 2, length, 3)) * 50).astype(dtype)
    axis = draw(st.sampled_from([2, -2]))
    circular = draw(st.booleans())
    seq = draw(st.integers(0, length))
    update = (rng.standard_normal((b, 2, seq, 3)) * 50).astype(dtype)
    hostile = draw(st.booleans())
    indices = (
        None
        if draw(st.integers(0, 5)) == 0
        else draw(int_tensor((b,), 0 if not circular or not hostile else -2 * length, length - seq, hostile))
    )
    ins = {"past_cache": past, "update": update, "write_indices": indices}
    op = build_op(
        TensorScatter,
        make_model("TensorScatter", ins, ["present"], {"": 24}, axis=axis, mode="circular" if circular else "linear"),
    )
    call = lambda: op.run([a for a in ins.values() if a is not None], run_context())  # noqa: E731
    starts = [0] * b if indices is None else int_values(indices)
    valid = (
        starts is not None
        and (indices is None or indices.shape == (b,))
        and (circular or all(0 <= w <= length - seq for w in starts))
    )
    if not valid:
        check_refused(call, past, update)
        return
    event("valid")
    expected = past.copy()
    for row, start in enumerate(starts):
        for s in range(seq):  # the spec's loop, in Python ints
            expected[row, :, (start + s) % length if circular else start + s] = update[row, :, s]
    (present,) = call()
    assert present.dtype == dtype
    np.testing.assert_array_equal(present, expected)


# -- the paged decoder in a state: hostile tables and lengths, compared with the stateless run --------------------


@pytest.fixture(scope="module")
def paged_session():
    cfg = PagedConfig(num_layers=2, num_pages=12, max_blocks=4, block_size=4)
    return cfg, onnxkv.Session(build_paged_model(cfg), threads=1)


@hypothesis_settings(25)
@given(data=st.data())
def test_paged_state_is_refused_unchanged_or_matches_its_stateless_run(paged_session, data):
    """A state's run with a random (often hostile) int32 block table and seqlens_k either equals the same
    feeds run without a state over a copy of its pages, or both refuse it and the state keeps every byte."""
    cfg, session = paged_session
    draw = data.draw
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b, s = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    hostile = draw(st.booleans())
    table = draw(page_table(b, cfg.max_blocks, cfg.num_pages, False))
    seqlens = draw(int_tensor((b,), 0, cfg.max_blocks * cfg.block_size - s, False)).astype(np.int32)
    if hostile:  # an edge of int32 in the table or the lengths
        edges = [v for v in EDGES if -(2**31) <= v < 2**31] + [cfg.num_pages, cfg.max_blocks * cfg.block_size]
        target = table if draw(st.booleans()) else seqlens
        target.reshape(-1)[draw(st.integers(0, target.size - 1))] = draw(st.sampled_from(edges))
    feeds = {
        "hidden": rng.standard_normal((b, s, cfg.hidden_size)).astype(np.float32),
        "block_table": table.astype(np.int32),
        "seqlens_k": seqlens,
    }
    with session.new_state() as state:
        prompt = {
            "hidden": rng.standard_normal((b, 2, cfg.hidden_size)).astype(np.float32),
            "block_table": np.arange(b * cfg.max_blocks, dtype=np.int32).reshape(b, -1) % cfg.num_pages,
            "seqlens_k": np.zeros(b, np.int32),
        }
        state.run(prompt)  # pages with content, so that a refused run has something to keep
        before = {name: value.copy() for name, value in state.values.items()}
        stateless = dict(feeds, **{name: value.copy() for name, value in before.items()})
        try:
            want = session.run(stateless)
        except OperatorError:  # a raw error inside a node: never a refusal
            raise
        except OnnxkvError as refused:
            with pytest.raises(type(refused)):
                state.run(feeds)
            event(f"refused: {type(refused).__name__}")
            for name, value in state.values.items():
                np.testing.assert_array_equal(value, before[name])
            return
        event("valid")
        got = state.run(feeds)
        # the state's pages are read in place, the copies gathered: equal up to summation order (which
        # reaches the second layer's keys and values through the first layer's output)
        np.testing.assert_allclose(got["output"], want["output"], rtol=1e-5, atol=1e-5)
        for name, value in state.values.items():
            np.testing.assert_allclose(value, stateless[name], rtol=1e-5, atol=1e-5)
