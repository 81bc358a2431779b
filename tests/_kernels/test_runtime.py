import importlib
import os
import sys

import numpy as np
import pytest

import onnxkv._kernels as K


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


def test_default_threads_is_cpu_count():
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mod = sys.modules["onnxkv._kernels._runtime"]
    assert mod._default_threads() == n


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
    for name in ["set_num_threads", "get_num_threads", "openmp_enabled", "simd_path", "set_simd_enabled",
                 "cpu_features", "rms_norm", "skip_rms_norm", "softmax", "silu_mul", "sigmoid", "silu",
                 "rotary_embedding", "attention", "f16_to_f32", "f32_to_f16"]:
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
