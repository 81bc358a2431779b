"""PlanePayloads: the records a PageSet uses -- lent pages, swaps that free nothing, given parameters, layouts."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hostile_allocators import MODES, Hostile

from onnxkv.alloc import SystemAllocator
from onnxkv.cache import formats
from onnxkv.cache.plane_payloads import NATIVE_CODE, PageParams, PlanePayloads, PlaneSpec

H, BS, D = 2, 4, 8


def _payloads(allocator=None, labels=None):
    planes = [PlaneSpec("keys", H, D, "float32"), PlaneSpec("values", H, D, "float32")]
    out = PlanePayloads(planes, BS, allocator or SystemAllocator(), threading.RLock(), "Owner", labels)
    out.grow(3)
    return out


def test_records_are_plane_by_page_arrays_and_grow_keeps_them():
    p = _payloads()
    assert p.ptrs.shape == p.formats.shape == p.sizes.shape == (2, 3)
    assert (p.formats == NATIVE_CODE["float32"]).all() and not p.ptrs.any()
    p.swap(1, 2, None, None, NATIVE_CODE["float32"], 4096)
    p.grow(5)
    assert p.ptrs.shape == (2, 5) and int(p.ptrs[1, 2]) == 4096 and len(p.pages[1]) == 5
    assert (p.formats[:, 3:] == NATIVE_CODE["float32"]).all()


def test_a_lent_page_has_an_address_but_no_payload_and_a_swap_restores_exactly():
    alloc = SystemAllocator()
    p = _payloads(alloc)
    old = p.swap(0, 1, None, None, NATIVE_CODE["float32"], 64 * 1000)  # the owner's storage
    assert old == (None, None, NATIVE_CODE["float32"], 0)
    assert p.committed_bytes == 0 and p.converted == [0, 0] and p.pages[0][1] is None
    x = np.random.default_rng(0).standard_normal((H, BS, D)).astype(np.float32)
    buf, arr = p.encode_payload(0, "float16", x)
    lent = p.swap(0, 1, buf, arr, formats.page_format("float16").code)
    assert lent == (None, None, NATIVE_CODE["float32"], 64 * 1000)
    assert p.converted == [1, 0] and p.committed_bytes == arr.nbytes == alloc.stats().live
    np.testing.assert_array_equal(p.read_page(0, 1, BS), x.astype(np.float16).astype(np.float32))
    back = p.swap(0, 1, *lent)  # a rolled back conversion: the payload returns to the caller
    assert back[0] is buf and int(p.ptrs[0, 1]) == 64 * 1000 and p.converted == [0, 0]
    p.discard_payload(back[0])
    assert alloc.stats().live == 0


@pytest.mark.parametrize("per_channel", [False, True])
def test_given_parameters_and_the_layout_they_declare(per_channel):
    p = _payloads()
    x = np.random.default_rng(1).standard_normal((H, BS, D)).astype(np.float32)
    g = D if per_channel else 1
    scale = np.full(H * g, 0.05, np.float32)
    zero = np.zeros(H * g, np.float32)
    buf, arr = p.encode_payload(1, "int8", x, PageParams(scale, zero, g))
    assert arr.nbytes == formats.page_bytes("int8", H, BS, D, g)
    p.swap(1, 0, buf, arr, formats.page_format("int8").code)
    p.set_layout(1, g, formats.HEADER_FLOAT32)  # per channel with a float32 header: a PageSet's layout
    want = np.clip(np.rint(x / 0.05), -128, 127) * np.float32(0.05)
    np.testing.assert_allclose(p.read_page(1, 0, BS), want, rtol=0, atol=1e-6)
    assert p.planes[1].groups == g and p.planes[0].groups == 1


def test_allocation_errors_name_the_label():
    alloc = Hostile()
    alloc.mode = "short"  # a buffer smaller than asked for: refused by the lease check
    x = np.zeros((H, BS, D), np.float32)
    params = PageParams(np.ones(H, np.float32), np.zeros(H, np.float32), 1)
    with pytest.raises(MODES["short"][0], match="^Tensor: a int8 page"):
        _payloads(alloc, labels=["Tensor", "Tensor"]).encode_payload(0, "int8", x, params)
    with pytest.raises(MODES["short"][0], match="^Owner: plane 'keys': a int8 page"):
        _payloads(alloc).encode_payload(0, "int8", x)
    assert alloc.inner.stats().live == 0
