"""PageSet: per-page formats of a caller-indexed page tensor, converted all or nothing."""

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from onnxkv.alloc import SystemAllocator
from onnxkv.cache.formats import check_params, page_bytes, page_format
from onnxkv.cache.page_set import PageSet, PlaneTarget
from onnxkv.errors import InputError, OutOfMemory

P, H, BS, D = 6, 2, 4, 8


def pages(rng, dtype=np.float32, two_planes=True):
    shape = (P, 2, H, BS, D) if two_planes else (P, H, BS, D)
    return rng.standard_normal(shape).astype(dtype)


def quantize_linear(x, scale, zero, fmt):
    """NumPy QuantizeLinear then DequantizeLinear: (saturate(rint(x / s) + zp) - zp) * s (float32 math)."""
    f = page_format(fmt)
    q = np.clip(np.rint(x / scale) + zero, f.qmin, f.qmax)
    return ((q - zero) * scale).astype(np.float32)


def snapshot(handle, tensor, allocator):
    return (
        tensor.tobytes(),
        handle.ptrs.copy(),
        handle.formats.copy(),
        list(handle.groups),
        handle.payload_bytes,
        allocator.stats().live,
    )


class FailingAllocator(SystemAllocator):
    """A system allocator whose allocation number ``fail_at`` (0-based) raises OutOfMemory."""

    def __init__(self, fail_at):
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0

    def allocate(self, nbytes, alignment=64):
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise OutOfMemory(f"FailingAllocator: allocation {self.fail_at} refused")
        return super().allocate(nbytes, alignment)


def test_attach_copies_nothing_and_is_found_from_full_views_only():
    t = pages(np.random.default_rng(0))
    handle = PageSet.attach(t)
    base = t.__array_interface__["data"][0]
    want = base + np.arange(P)[None, :] * t.strides[0] + np.arange(2)[:, None] * t.strides[1]
    np.testing.assert_array_equal(handle.ptrs, want.astype(np.uint64))
    assert (handle.formats == 1).all() and handle.groups == [0, 0] and not handle.any_converted
    assert PageSet.attach(t) is handle and PageSet.of(t.view()) is handle and PageSet.of(t[...]) is handle
    assert PageSet.of(t[1:]) is None and PageSet.of(t.copy()) is None
    with pytest.raises(InputError, match="views part of a page tensor that has a handle"):
        PageSet.attach(t[1:])
    with pytest.raises(InputError, match=r"PageSet.attach: expected .* got float64 \[6, 2, 2, 4, 8\]"):
        PageSet.attach(t.astype(np.float64))
    with pytest.raises(InputError, match=r"got float32 \[6, 3, 2, 4, 8\]"):
        PageSet.attach(np.zeros((P, 3, H, BS, D), np.float32))


@pytest.mark.parametrize(
    "fmt, per_channel",
    [("int8", False), ("uint8", True), ("int4", True), ("uint4", False), ("int2", False), ("uint2", True)],
)
def test_convert_replaces_only_the_selected_pages_with_given_parameters(fmt, per_channel):
    rng = np.random.default_rng(1)
    t = pages(rng)
    alloc = SystemAllocator()
    handle = PageSet.attach(t, alloc)
    before_ptrs, before = handle.ptrs.copy(), t.copy()
    sel = np.array([4, 1])
    f = page_format(fmt)
    shape = (2, H, D) if per_channel else (2, H)
    scale = rng.uniform(0.05, 0.5, shape).astype(np.float32)
    zero = rng.integers(f.qmin, f.qmax + 1, shape).astype(np.float32)
    cost = handle.convert(sel, [PlaneTarget(fmt, scale, zero), None])
    g = D if per_channel else 1
    nbytes = page_bytes(fmt, H, BS, D, g)
    assert (cost.pages, cost.allocations, cost.allocated_bytes) == (2, 2, 2 * nbytes)
    assert alloc.stats().live == 2 * nbytes == handle.payload_bytes
    keep = np.setdiff1d(np.arange(P), sel)
    np.testing.assert_array_equal(handle.ptrs[0, keep], before_ptrs[0, keep])  # unselected pages: same storage
    np.testing.assert_array_equal(handle.ptrs[1], before_ptrs[1])  # the untouched plane
    assert (handle.ptrs[0, sel] != before_ptrs[0, sel]).all() and (handle.ptrs[0, sel] % 64 == 0).all()
    assert (handle.formats[0, sel] == f.code).all() and (handle.formats[0, keep] == 1).all()
    assert handle.groups == [g, 0]
    np.testing.assert_array_equal(t[keep], before[keep])
    np.testing.assert_array_equal(t[:, 1], before[:, 1])
    assert np.isnan(t[sel, 0]).all()  # the slots the pages left are dead storage
    for i, p in enumerate(sel):
        s = scale[i].reshape(H, 1, g)
        z = zero[i].reshape(H, 1, g)
        np.testing.assert_array_equal(handle.page_values(0, p), quantize_linear(before[p, 0], s, z, fmt))
    handle.audit()


def test_requantize_dequantize_and_return_to_the_tensor():
    rng = np.random.default_rng(2)
    t = pages(rng, np.float16)
    alloc = SystemAllocator()
    handle = PageSet.attach(t, alloc)
    slots, orig = handle.ptrs.copy(), t.astype(np.float32)
    ones = np.ones((1, H), np.float32)
    handle.convert(np.array([3]), [PlaneTarget("int8", 0.02 * ones, 0 * ones), PlaneTarget("float32")])
    int8 = handle.page_values(0, 3)
    np.testing.assert_array_equal(handle.page_values(1, 3), orig[3, 1])  # float16 -> float32 is exact
    assert handle.formats[:, 3].tolist() == [3, 1] and handle.groups == [1, 0]
    # requantizing replaces the payload (rebuilt from the current int8 values); bfloat16 dequantizes the int4 page
    cost = handle.convert(np.array([3]), [PlaneTarget("int4", 0.3 * ones, 0 * ones), None])
    assert cost.allocations == 1 and cost.freed_bytes == page_bytes("int8", H, BS, D, 1)
    assert cost.dequantized_bytes == page_bytes("int8", H, BS, D, 1)
    np.testing.assert_array_equal(handle.page_values(0, 3), quantize_linear(int8, 0.3, 0.0, "int4"))
    handle.convert(np.array([3]), [PlaneTarget("bfloat16"), None])
    assert handle.formats[0, 3] == 16 and handle.groups == [0, 0]
    # back to the tensor's own type: the slot is written again, payloads freed, nothing allocated
    cost = handle.convert(np.array([3]), [PlaneTarget("float16"), PlaneTarget("float16")])
    assert cost.allocations == 0 and alloc.stats().live == 0 and not handle.any_converted
    np.testing.assert_array_equal(handle.ptrs, slots)
    np.testing.assert_array_equal(t[3, 1], orig[3, 1].astype(np.float16))
    assert np.isfinite(t).all()
    handle.audit()


def test_a_page_already_in_the_target_float_format_is_left_alone():
    t = pages(np.random.default_rng(3))
    handle = PageSet.attach(t, SystemAllocator())
    before = t.copy()
    cost = handle.convert(np.array([0, 5]), [PlaneTarget("float32"), PlaneTarget("float32")])
    assert cost.pages == 0 and cost.allocations == 0
    np.testing.assert_array_equal(t, before)


def bad_calls():
    ones = np.ones((2, H), np.float32)
    zero = np.zeros((2, H), np.float32)
    return [
        (np.array([0, 6]), [PlaneTarget("int8", ones, zero), None], r"indices\[1\] = 6 is not a page id in \[0, 6\)"),
        (
            np.array([0, 2**64 - 1], np.uint64),
            [PlaneTarget("int8", ones, zero), None],  # not wrapped to -1
            r"indices\[1\] = 18446744073709551615 is not a page id in \[0, 6\)",
        ),
        (
            np.array([-(2**63), 1], np.int64),
            [PlaneTarget("int8", ones, zero), None],
            r"indices\[0\] = -9223372036854775808 is not a page id",
        ),
        (np.array([2, 2]), [PlaneTarget("int8", ones, zero), None], "distinct, page 2 is selected 2 times"),
        (np.array([[0, 1]]), [PlaneTarget("int8", ones, zero), None], "indices must be a 1-D int array"),
        (np.array([0, 1]), [PlaneTarget("int8", ones[:1], zero[:1]), None], r"scale must be \[2, 2\]"),
        (
            np.array([0, 1]),
            [PlaneTarget("int8", np.where(np.eye(2, dtype=bool), 0, ones).astype(np.float32), zero), None],
            r"scale\[0, 0\] = .*finite and > 0",
        ),
        (np.array([0, 1]), [None, PlaneTarget("int8", ones * np.float32(np.inf), zero)], "finite and > 0"),
        (
            np.array([0, 1]),
            [PlaneTarget("uint4", ones, zero + 16), None],
            r"zero_point\[0, 0\] = .*integer in \[0, 15\] for format uint4",
        ),
        (np.array([0, 1]), [PlaneTarget("int8", ones, zero + 0.5), None], "integer in"),
        (np.array([0, 1]), [PlaneTarget("int8", ones.astype(np.float64), zero), None], "must be a float32 array"),
        (np.array([0, 1]), [PlaneTarget("int3", ones, zero), None], "unknown page format 'int3'"),
        (np.array([0, 1]), [None], "1 plane target"),
    ]


@pytest.mark.parametrize("indices, targets, match", bad_calls())
def test_rejections_leave_everything_unchanged(indices, targets, match):
    rng = np.random.default_rng(4)
    t = pages(rng)
    alloc = SystemAllocator()
    handle = PageSet.attach(t, alloc)
    # one page of each plane already converted, so that the tables are not trivial
    handle.convert(
        np.array([3]),
        [PlaneTarget("int8", np.full((1, H), 0.1, np.float32), np.zeros((1, H), np.float32)), PlaneTarget("float16")],
    )
    before = snapshot(handle, t, alloc)
    with pytest.raises(InputError, match=match):
        handle.convert(indices, targets, api="PageSet.convert")
    after = snapshot(handle, t, alloc)
    assert after[0] == before[0] and after[3:] == before[3:]
    for a, b in zip(after[1:3], before[1:3]):
        np.testing.assert_array_equal(a, b)


def test_one_granularity_per_plane():
    t = pages(np.random.default_rng(5))
    handle = PageSet.attach(t, SystemAllocator())
    head = (np.full((1, H), 0.1, np.float32), np.zeros((1, H), np.float32))
    channel = (np.full((1, H, D), 0.1, np.float32), np.zeros((1, H, D), np.float32))
    handle.convert(np.array([1]), [PlaneTarget("int8", *head), None])
    with pytest.raises(
        InputError,
        match=r"per-channel scales but plane 0 already holds pages quantized per head "
        r"\(e.g. page 1\)",
    ):
        handle.convert(np.array([2]), [PlaneTarget("int4", *channel), None])
    # requantizing every quantized page of the plane may change the granularity
    handle.convert(np.array([1]), [PlaneTarget("int4", *channel), None])
    assert handle.groups == [D, 0]


@pytest.mark.parametrize("fail_at", [0, 2])
def test_out_of_memory_while_building_publishes_nothing(fail_at):
    t = pages(np.random.default_rng(6))
    alloc = FailingAllocator(fail_at)
    handle = PageSet.attach(t, alloc)
    before = t.copy()
    target = PlaneTarget("uint8", np.full((3, H), 0.1, np.float32), np.full((3, H), 128, np.float32))
    with pytest.raises(OutOfMemory, match=f"allocation {fail_at} refused"):
        handle.convert(np.array([0, 2, 4]), [target, target])
    np.testing.assert_array_equal(t, before)
    assert not handle.any_converted and alloc.stats().live == 0 and (handle.formats == 1).all()


def test_single_plane_tensor_and_release_with_the_tensor():
    alloc = SystemAllocator()
    t = pages(np.random.default_rng(7), two_planes=False)
    handle = PageSet.attach(t, alloc)
    assert handle.planes == 1
    handle.convert(
        np.array([0, 1]), [PlaneTarget("int8", np.full((2, H), 0.1, np.float32), np.zeros((2, H), np.float32))]
    )
    assert alloc.stats().live > 0
    view = t.view()
    del t
    gc.collect()
    assert alloc.stats().live > 0 and PageSet.of(view) is handle  # a view keeps the tensor (and the handle) alive
    del view
    gc.collect()
    assert alloc.stats().live == 0  # the payloads went back with the tensor


def test_check_params_names_the_arrays():
    scale = np.array([[0.5, -1.0]], np.float32)
    with pytest.raises(InputError, match=r"op: s\[0, 1\] = .*-1.0"):
        check_params("op", "int8", scale, np.zeros((1, 2), np.float32), ("s", "z"))
    with pytest.raises(InputError, match=r"op: z\[0\] = .*-3.0.*\[-2, 1\] for format int2"):
        check_params("op", "int2", np.ones(2, np.float32), np.array([-3, 0], np.float32), ("s", "z"))
    with pytest.raises(InputError, match="shape"):
        check_params("op", "int8", np.ones(2, np.float32), np.zeros(3, np.float32))
    with pytest.raises(InputError, match="float format"):
        check_params("op", "float16", np.ones(2, np.float32), np.zeros(2, np.float32))
    check_params("op", "uint4", np.full(3, 1e-3, np.float32), np.array([0, 7, 15], np.float32))


def int8_target(n, scale=0.05):
    return PlaneTarget("int8", np.full((n, H), scale, np.float32), np.zeros((n, H), np.float32))


@pytest.mark.parametrize(
    "first, second",
    [
        (None, int8_target(2)),  # native -> int8
        (int8_target(2), int8_target(2, 0.02)),  # int8 -> int8 (new scale)
        (int8_target(2), PlaneTarget("float32")),  # int8 -> back to the tensor slot
        (PlaneTarget("float16"), int8_target(2)),  # float16 -> int8
    ],
)
def test_a_staged_conversion_is_rolled_back_or_committed(first, second):
    rng = np.random.default_rng(21)
    alloc = SystemAllocator()
    t = pages(rng)
    handle = PageSet.attach(t, alloc)
    idx = np.array([1, 4])
    if first is not None:
        handle.convert(idx, [first, None])
    before = snapshot(handle, t, alloc)
    values = [handle.page_values(0, p) for p in range(P)]
    cost = handle.convert(idx, [second, None], staged=True)
    assert cost.pages == 2 and (handle.formats[0, idx] == page_format(second.fmt).code).all()
    cost.rollback()
    after = snapshot(handle, t, alloc)
    assert after[0] == before[0] and after[3:] == before[3:]  # tensor bytes (dead slots: the same NaN), sizes
    np.testing.assert_array_equal(after[1], before[1])
    np.testing.assert_array_equal(after[2], before[2])
    handle.audit()
    for p in range(P):
        np.testing.assert_array_equal(handle.page_values(0, p), values[p])
    cost = handle.convert(idx, [second, None], staged=True)
    converted = [handle.page_values(0, p) for p in idx]
    cost.commit()
    handle.audit()
    for i, p in enumerate(idx):
        np.testing.assert_array_equal(handle.page_values(0, p), converted[i])
    if page_format(second.fmt).code != 1:
        assert np.isnan(t[idx, 0]).all()
    want = (
        sum(page_bytes(page_format(second.fmt), H, BS, D, 1) for _ in idx) if page_format(second.fmt).code != 1 else 0
    )
    assert handle.payload_bytes == want and alloc.stats().live == want
    cost.rollback()  # after commit: nothing left to undo
    handle.audit()


def test_a_collection_inside_the_registry_lock_does_not_deadlock(tmp_path):
    """A tensor with a handle that dies in a reference cycle is freed by whichever garbage collection comes
    next; when that collection ran inside attach (which allocates under the registry lock), the tensor's
    finalizer waited for the lock its own thread held: the process hung (seen fuzzing QuantizePagedCache)."""
    code = textwrap.dedent("""
        import gc
        import numpy as np
        import onnxkv.cache.page_set as page_set

        gc.disable()
        tensor = np.zeros((2, 2, 1, 4, 8), np.float32)
        page_set.PageSet.attach(tensor)
        cycle = [tensor]
        cycle.append(cycle)
        del tensor, cycle  # dead, freed by the next collection
        allocator = page_set.as_allocator

        def collecting(a):  # a collection at this point of attach: inside the registry lock
            gc.collect()
            return allocator(a)

        page_set.as_allocator = collecting
        page_set.PageSet.attach(np.zeros((2, 2, 1, 4, 8), np.float32))
        print("attached")
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("PageSet.attach deadlocked on a finalizer run by a collection inside its lock")
    assert done.returncode == 0 and done.stdout.strip() == "attached", done.stderr
