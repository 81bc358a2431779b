"""Session(prefill_precision=...) and generate(prefill_precision=...): the prompt's products in bfloat16
(float32 sums) where the CPU has AVX-512-BF16, refused with a reason where it has not; decode steps
float32 either way; the session's own setting back after a generate call."""

import os
import subprocess
import sys

import numpy as np
import pytest

import onnxkv
from onnxkv.errors import InputError
from onnxkv.generate.feeds import FeedBuilder
from onnxkv.kernels import bf16_available
from onnxkv.zoo import embedded

MODEL = str(embedded.embedded_model_dir())
needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="this CPU has no AVX-512-BF16")


def _logits(session, ids):
    name = session.model.io.logits
    b = FeedBuilder(session.plan.inputs, session.model, ids, np.array([ids.shape[1]]), 0, thread_cache=False)
    feeds, _ = b.first()
    with session.new_state() as st:
        out = st.run(feeds, [name])[name]
        tok = np.array([int(np.argmax(out[0, -1]))])
        step = st.run(b.next(tok, {name: out}), [name])[name]
    return out[0, -1].copy(), step[0, -1].copy()


@pytest.mark.parametrize("bad", ["fp16", "BFLOAT16", 16, ""])
def test_bad_values_are_refused_naming_the_api(bad):
    with pytest.raises(InputError, match=rf"Session: prefill_precision={bad!r}: prefill_precision must be"):
        onnxkv.Session(MODEL, prefill_precision=bad)
    with pytest.raises(InputError, match=rf"generate: prefill_precision={bad!r}"):
        onnxkv.generate(MODEL, [1, 2, 3], 2, prefill_precision=bad)


def test_bf16_is_refused_where_the_process_cannot_run_it(tmp_path):
    """ONNXKV_MAX_SIMD=avx2 takes the AVX-512 level away, and with it the AVX-512-BF16 products.  (The child
    runs with -P in an empty folder: the installed onnxkv, not a source tree in the working directory.)"""
    code = (
        "import onnxkv\nfrom onnxkv.errors import InputError\n"
        f"try:\n    onnxkv.Session({MODEL!r}, prefill_precision='bf16')\n"
        "except InputError as e:\n    print(e)\n"
    )
    env = {**os.environ, "ONNXKV_MAX_SIMD": "avx2"}
    run = subprocess.run([sys.executable, "-P", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "Session: prefill_precision='bf16': prefill_precision='bf16' is not available: " in out
    assert "AVX-512" in out


@needs_bf16
def test_the_prompt_runs_in_bf16_and_the_decode_step_in_float32():
    ids = np.array([embedded.encode("Return the number of items in a container.")], np.int64)
    f32 = onnxkv.Session(MODEL, threads=1)
    bf16 = onnxkv.Session(MODEL, threads=1, prefill_precision="bf16")
    assert bf16.prefill_precision == "bf16" and f32.prefill_precision is None
    p32, d32 = _logits(f32, ids)
    p16, d16 = _logits(bf16, ids)
    rel = np.abs(p16 - p32).max() / np.abs(p32).max()
    assert 1e-6 < rel < 2e-2 and p16.argmax() == p32.argmax()
    # the decode step of the bf16 session, over the cache its prompt wrote, is a float32 step: the same
    # bits as the float32 session's step over that cache (its prompt run float32 for the comparison)
    with bf16.precision("float32"):
        q32, e32 = _logits(bf16, ids)
    np.testing.assert_array_equal(q32, p32)
    np.testing.assert_array_equal(e32, d32)
    assert not np.array_equal(d16, d32)  # the bf16 prompt's cache differs, so its step does


@needs_bf16
def test_generate_takes_the_precision_for_its_prompt_and_restores_the_sessions():
    ids = np.array([embedded.encode("Split the pathname path into a pair.")], np.int64)
    session = onnxkv.Session(MODEL, threads=1)
    want = onnxkv.generate(onnxkv.Session(MODEL, threads=1, prefill_precision="bf16"), ids, 24).tokens
    got = onnxkv.generate(session, ids, 24, prefill_precision="bf16").tokens
    np.testing.assert_array_equal(got, want)
    assert session.prefill_precision is None
    np.testing.assert_array_equal(
        onnxkv.generate(session, ids, 24).tokens, onnxkv.generate(onnxkv.Session(MODEL, threads=1), ids, 24).tokens
    )
