"""onnxkv.kernels: the public kernel switches, and kernel_levels under forced settings."""

from __future__ import annotations

import importlib

import pytest

import onnxkv
from onnxkv import kernels
from onnxkv.kernels import KernelSettings, current_settings, kernel_levels, simd_levels, use_settings

#: The int8 MatMulNBits paths each level may select (VNNI where the CPU has it).
INT8_PATHS = {"scalar": {"scalar"}, "avx2": {"avx2", "avx-vnni"}, "avx512": {"avx512-vnni", "avx-vnni", "avx2"}}


def test_every_public_name_is_there_and_the_switches_are_the_compiled_ones():
    for name in kernels.__all__:
        assert getattr(kernels, name) is not None
    attention = importlib.import_module("onnxkv._kernels.attention")
    assert kernels.set_attention_amx is attention.set_attention_amx
    assert kernels.set_attention_avx512 is attention.set_attention_avx512
    assert kernels.KernelSettings is onnxkv._kernels.KernelSettings
    assert set(kernel_levels()) == set(kernels.KERNEL_FAMILIES)


@pytest.mark.parametrize("level", simd_levels())
def test_levels_follow_the_forced_settings(level):
    with use_settings(KernelSettings(simd=level, amx=False)):
        got = kernel_levels()
        assert got["attention"] == got["paged_attention"] == got["matmul_packed"] == got["matmul_nbits_float"] == level
        assert got["quant"] == got["elementwise"] == ("scalar" if level == "scalar" else "avx2")
        assert got["matmul_nbits_int8"] in INT8_PATHS[level]
        assert onnxkv.config()["kernels"] == got and onnxkv.config()["simd"] == level


def test_amx_shows_on_paged_attention_where_it_runs_and_its_switch_turns_it_off():
    before = kernel_levels()
    with use_settings(KernelSettings(amx=True)) as s:
        amx = s.amx and s.simd == "avx512"
        assert kernel_levels()["paged_attention"] == ("avx512+amx" if amx else s.simd)
        assert kernel_levels()["attention"] == s.simd
        assert onnxkv.config()["amx"] is s.amx
        assert kernels.set_attention_amx(False) is False
        assert kernel_levels()["paged_attention"] == s.simd
    assert kernel_levels() == before  # the thread's own settings are back


def test_switches_act_on_the_calling_thread_until_the_scope_ends():
    before = kernel_levels()
    with use_settings(current_settings()):
        if "avx512" in simd_levels():
            assert kernels.set_packed_avx512(False) is False
            assert kernel_levels()["matmul_packed"] == kernel_levels()["attention"] == "avx2"
        kernels.set_simd_enabled(False)
        got = kernel_levels()
        assert set(got.values()) == {"scalar"}
    assert kernel_levels() == before
