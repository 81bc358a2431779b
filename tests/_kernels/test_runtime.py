import functools
import importlib
import os
import sys
import threading

import numpy as np
import pytest
from concurrency import side_by_side
from fuzzing import examples

import onnxkv._kernels as K
from onnxkv._kernels._cpus import default_threads

from .test_paged_attention import Paged

A = sys.modules["onnxkv._kernels.attention"]
MM = sys.modules["onnxkv._kernels.matmul"]
RT = sys.modules["onnxkv._kernels._runtime"]


def test_threads_roundtrip():
    old = K.get_num_threads()
    try:
        K.set_num_threads(1)
        assert K.get_num_threads() == 1
        K.set_num_threads(3)
        assert K.get_num_threads() == 3
    finally:
        K.set_num_threads(old)


@pytest.mark.parametrize("bad", [0, -1])
def test_threads_invalid(bad):
    with pytest.raises(ValueError):
        K.set_num_threads(bad)


def test_built_with_openmp():
    """Without OpenMP every kernel runs on one thread: such a build fails here
    unless it is meant (ONNXKV_ALLOW_NO_OPENMP=1; meson warns when it builds one)."""
    assert K.openmp_enabled() or os.environ.get("ONNXKV_ALLOW_NO_OPENMP") == "1", (
        "onnxkv was built without OpenMP, so every kernel runs on one thread: install the C compiler's OpenMP "
        "runtime (libgomp for GCC, libomp for Clang) and rebuild, or set ONNXKV_ALLOW_NO_OPENMP=1 if such a "
        "build is meant"
    )


def test_simd_switch():
    feats = K.cpu_features()
    assert set(feats) >= {"avx2", "fma", "f16c", "simd_compiled", "simd_usable", "openmp"}
    try:
        K.set_simd_enabled(False)
        assert K.simd_path() == "scalar"
        K.set_simd_enabled(True)
        expect = "avx2+fma+f16c" if feats["simd_usable"] else "scalar"
        assert K.simd_path() == expect
    finally:
        K.set_simd_enabled(True)


def test_openmp_flag():
    assert isinstance(K.openmp_enabled(), bool)
    assert K.openmp_enabled() == K.cpu_features()["openmp"]


def test_public_api_names():
    for name in [
        "KernelSettings",
        "current_settings",
        "use_settings",
        "simd_levels",
        "set_num_threads",
        "get_num_threads",
        "openmp_enabled",
        "simd_path",
        "set_simd_enabled",
        "cpu_features",
        "rms_norm",
        "skip_rms_norm",
        "softmax",
        "silu_mul",
        "sigmoid",
        "silu",
        "rotary_embedding",
        "attention",
        "f16_to_f32",
        "f32_to_f16",
    ]:
        assert callable(getattr(K, name)), name
        assert name in K.__all__


def test_threads_give_same_results():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 300)).astype(np.float32)
    g = rng.standard_normal(300).astype(np.float32)
    outs = []
    old = K.get_num_threads()
    try:
        for n in (1, 2, 4):
            K.set_num_threads(n)
            o = np.empty_like(x)
            K.rms_norm(x, g, 1e-6, o)
            outs.append(o)
    finally:
        K.set_num_threads(old)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_missing_compiled_module_message(monkeypatch):
    """A broken build raises a readable ImportError naming the module and the fix."""
    for name in list(sys.modules):
        if name == "onnxkv._kernels" or name.startswith("onnxkv._kernels."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "onnxkv._kernels.attention", None)
    monkeypatch.delattr(sys.modules["onnxkv"], "_kernels", raising=False)
    with pytest.raises(ImportError) as info:
        importlib.import_module("onnxkv._kernels")
    msg = str(info.value)
    assert "onnxkv._kernels.attention" in msg
    assert "pip install ." in msg
    assert "C compiler" in msg


def test_openmp_wait_policy_default():
    """Importing the kernels bounds OpenMP's spin-wait unless the user chose a policy."""
    import os

    assert os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT") == "50000"


def test_openmp_wait_policy_respects_the_user():
    """An explicit OMP_WAIT_POLICY is kept and no spin count is imposed (fresh interpreter)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    code = "import os, onnxkv._kernels; print(os.environ['OMP_WAIT_POLICY'], os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd="/")
    assert out.stdout.split() == ["PASSIVE", "None"], out.stderr


def test_settings_values_are_checked_immutable_and_compare_by_value():
    s = K.KernelSettings(threads=3, simd="scalar", amx=False)
    assert (s.threads, s.simd, s.amx) == (3, "scalar", False)
    assert s == K.KernelSettings(threads=np.int64(3), simd="scalar", amx=False) and hash(s) == hash(s.replace())
    assert s.replace(threads=1) == K.KernelSettings(threads=1, simd="scalar", amx=False) and s.threads == 3
    assert K.KernelSettings().threads == default_threads()
    assert K.KernelSettings(simd="auto").simd == K.simd_levels()[-1]
    assert K.KernelSettings(amx=False).amx is False
    with pytest.raises(AttributeError):
        s.threads = 2
    assert repr(s) == "KernelSettings(threads=3, simd='scalar', amx=False)"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(threads=0), "threads"),
        (dict(threads=K.MAX_THREADS + 1), "threads"),
        (dict(threads=True), "threads"),
        (dict(threads=2.0), "threads"),
        (dict(threads="2"), "threads"),
        (dict(simd="avx3"), "simd"),
        (dict(simd=None), "simd"),
        (dict(simd=1), "simd"),
        (dict(amx=1), "amx"),
        (dict(amx=None), "amx"),
    ],
)
def test_invalid_settings_are_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"KernelSettings: {field} must be"):
        K.KernelSettings(**kwargs)
    with pytest.raises(ValueError, match=f"KernelSettings: {field} must be"):
        K.KernelSettings().replace(**kwargs)
    with pytest.raises(ValueError, match="use_settings: settings must be a KernelSettings, got dict"):
        K.use_settings(kwargs)


def test_a_level_the_cpu_cannot_run_is_rejected():
    missing = [level for level in ("scalar", "avx2", "avx512") if level not in K.simd_levels()]
    assert K.simd_levels()[0] == "scalar" and set(K.simd_levels()) <= {"scalar", "avx2", "avx512"}
    for level in missing:
        with pytest.raises(
            ValueError,
            match=f"simd='{level}' is not available: (this CPU and OS cannot|this build has|ONNXKV_MAX_SIMD=)",
        ):
            K.KernelSettings(simd=level)


# In a fresh interpreter under ONNXKV_MAX_SIMD: the levels, the default, why each level is refused, and
# whether the AVX-512 switches of attention and matmul_packed can still turn their tiles on.
CAPPED = """
import json, sys
import onnxkv._kernels as K
A, MM = sys.modules["onnxkv._kernels.attention"], sys.modules["onnxkv._kernels.matmul"]
refused = {}
for level in ("scalar", "avx2", "avx512"):
    try:
        K.KernelSettings(simd=level)
    except ValueError as e:
        refused[level] = str(e)
print(json.dumps(dict(levels=K.simd_levels(), default=K.current_settings().simd, refused=refused,
                      usable=K.cpu_features()["simd_usable"], attention=A.set_attention_avx512(True),
                      packed=MM.set_packed_avx512(True), amx=A.set_attention_amx(True))))
"""


@functools.cache
def capped(cap: str) -> dict:
    """CAPPED's answers in a fresh interpreter with ONNXKV_MAX_SIMD=cap ("": every level of the build, CPU
    and OS, whatever cap this process runs under)."""
    import json
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", CAPPED],
        env=dict(os.environ, ONNXKV_MAX_SIMD=cap),
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("cap", ["scalar", "avx2", "avx512"])
def test_max_simd_caps_the_levels_of_the_process(cap):
    full = tuple(capped("")["levels"])
    got = capped(cap)
    want = full[: full.index(cap) + 1] if cap in full else full
    assert tuple(got["levels"]) == want and got["default"] == want[-1]
    assert got["usable"] == ("avx2" in want)
    if "avx512" not in want:
        assert not got["attention"] and not got["packed"] and not got["amx"]
    for level in ("scalar", "avx2", "avx512"):
        if level in want:
            assert level not in got["refused"]
        elif level in full:
            assert f"simd={level!r} is not available: ONNXKV_MAX_SIMD={cap!r} caps the levels" in got["refused"][level]
        else:
            assert f"simd={level!r} is not available: this " in got["refused"][level]


@pytest.mark.parametrize("value", ["avx3", "AVX2", "auto", " avx2"])
def test_max_simd_must_name_a_level(value):
    with pytest.raises(ValueError, match=f"ONNXKV_MAX_SIMD: must be 'scalar', 'avx2' or 'avx512' .* got {value!r}"):
        RT._max_level({"ONNXKV_MAX_SIMD": value})
    assert RT._max_level({}) == RT._max_level({"ONNXKV_MAX_SIMD": ""}) == 2


def test_use_settings_nests_and_restores_the_thread_settings():
    outer, inner = K.KernelSettings(threads=1, simd="scalar"), K.KernelSettings(threads=3, amx=False)
    before = K.current_settings()
    with K.use_settings(outer) as got:
        assert got is outer and K.current_settings() == outer
        assert (K.get_num_threads(), K.simd_path(), A.attention_simd_level()) == (1, "scalar", "scalar")
        with pytest.raises(ZeroDivisionError):
            with K.use_settings(inner):
                assert K.current_settings() == inner and K.get_num_threads() == 3
                K.set_num_threads(2)  # changed inside: undone on exit too
                A._set_split_tasks(5)
                raise ZeroDivisionError
        assert K.current_settings() == outer
    assert K.current_settings() == before


def test_one_scope_cannot_be_entered_twice_at_once():
    scope = K.use_settings(K.KernelSettings(threads=1))
    with scope:
        with pytest.raises(RuntimeError, match="already active"):
            scope.__enter__()
        assert K.get_num_threads() == 1
    with scope:  # once left, it can be entered again
        assert K.get_num_threads() == 1


def _in_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_switches_act_on_the_calling_thread_and_new_threads_start_from_the_defaults():
    with K.use_settings(K.current_settings()):  # restores whatever the switches change
        K.set_num_threads(1)
        K.set_simd_enabled(False)
        A.set_attention_amx(False)
        A._set_split_tasks(7)
        MM._set_adaptive(False)
        changed = K.current_settings()
        assert repr(changed).endswith(", _split_tasks=7, _adaptive=0)")
        fresh = _in_new_thread(K.current_settings)
        assert fresh == K.KernelSettings() and fresh != changed
        assert K.current_settings() == changed

        def switch_there():
            K.set_num_threads(3)
            A.set_attention_avx512(False)
            return K.current_settings()

        there = _in_new_thread(switch_there)
        assert there.threads == 3 and there.simd == K.simd_levels()[min(1, len(K.simd_levels()) - 1)]
        assert K.current_settings() == changed  # not seen here


def test_every_kernel_call_takes_the_calling_thread_settings():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    g = rng.standard_normal(32).astype(np.float32)
    calls = [
        lambda: K.softmax(x, np.empty_like(x)),
        lambda: K.rms_norm(x, g, 1e-6, np.empty_like(x)),
        lambda: K.silu(x, np.empty_like(x)),
        lambda: K.f32_to_f16(x, np.empty(x.shape, np.float16)),
        lambda: K.matmul_rows(x, x.T.copy(), np.empty((4, 4), np.float32)),
    ]
    for settings in (K.KernelSettings(threads=1, simd="scalar"), K.KernelSettings(threads=2, amx=False)):
        with K.use_settings(settings):
            for call in calls:
                before = RT._settings_seen()[1]
                call()
                assert RT._settings_seen() == (settings, before + 1)


def _kernel_work(rng):
    """Kernel calls (each returns its output) whose results differ between the
    scalar and the SIMD paths, and (attention's cache split) between 1 and 2
    threads."""
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    k = rng.standard_normal((1, 1, 2048, 64)).astype(np.float32)
    v = rng.standard_normal((1, 1, 2048, 64)).astype(np.float32)
    kv_len, q_pos = np.array([2048], np.int32), np.array([[2047]], np.int32)
    pg = Paged(rng, k, v, 16)
    x = rng.standard_normal((64, 512)).astype(np.float32)
    g = rng.standard_normal(512).astype(np.float32)
    wp = MM.pack_weight(rng.standard_normal((512, 512)).astype(np.float32))

    def into(shape, kernel):
        def run():
            out = np.full(shape, np.nan, np.float32)
            kernel(out)
            return out

        return run

    return [
        into(x.shape, lambda o: K.softmax(x, o)),
        into(x.shape, lambda o: K.rms_norm(x, g, 1e-6, o)),
        into(q.shape, lambda o: K.attention(q, k, v, kv_len, q_pos, 0.125, 0.0, -1, o)),
        into(q.shape, lambda o: pg.kernel(q, 1, kv_len, q_pos, 0.125, 0.0, -1, o, "float32")),
        into((1, 512), lambda o: MM.matmul_packed(x[:1], wp, o)),
    ]


def test_two_threads_with_their_own_settings_never_see_each_other():
    """Barrier-synchronised kernel calls from two Python threads, one with 1
    thread on the scalar path, one with 2 threads on the widest level: each
    call takes its own thread's settings (the test hook) and gives, bit for
    bit, the result of the same call made alone."""
    mine = [K.KernelSettings(threads=1, simd="scalar"), K.KernelSettings(threads=2, simd=K.simd_levels()[-1])]
    calls = _kernel_work(np.random.default_rng(7))
    want = []
    for settings in mine:
        with K.use_settings(settings):
            want.append([call() for call in calls])
    # the two settings give other bits for attention: cross-talk would show in the results
    assert not np.array_equal(want[0][2], want[1][2])

    def work(i, r):
        with K.use_settings(mine[i]):
            for c, call in enumerate(calls):
                got = call()
                seen, _ = RT._settings_seen()
                assert seen == mine[i], f"thread {i} round {r} call {c}: took {seen}"
                np.testing.assert_array_equal(got, want[i][c], err_msg=f"thread {i} round {r} call {c}")

    before = K.current_settings()
    side_by_side(work, examples(20))
    assert K.current_settings() == before
