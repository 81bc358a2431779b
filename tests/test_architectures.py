"""Models of nine architectures made by the real exporters, against transformers (tests/data/arch).

Each architecture's tiny random-weight model was exported by the ONNX Runtime
GenAI model builder (fp32, and int4 where the builder succeeds) and by
``torch.onnx.export`` (scripts/make_arch_fixtures.py; what failed and why is
in tests/data/README.md).  Run as a user would -- ``onnxkv.load``,
``Session.new_state`` / ``State.run``, ``onnxkv.generate`` -- every float32
export gives transformers' greedy tokens for 32 tokens past the sliding window
and its logits within 1e-4 at every step; every int4 export stays within
:data:`INT4_TOL` of its float32 twin and picks the same tokens wherever the
float32 margin between the two best logits exceeds twice that.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import onnxkv

DATA = Path(__file__).parent / "data" / "arch"
MANIFEST = json.loads((DATA / "exports.json").read_text())
WINDOW = MANIFEST["window"]
TOL = 1e-4
#: Largest |int4 logits - float32 logits| allowed.  The fixtures' weights are ones 4-bit blocks hold exactly
#: (see scripts/make_arch_fixtures.py), so the int4 graphs differ from their float32 twins by the int8
#: activations of MatMulNBits' accuracy_level 4 only: 0.03 to 0.09 on these models, whose logits span about 6.
INT4_TOL = 0.15

#: Every export the fixtures must hold: (architecture, exporter).  A fixture the exporter could not make is
#: listed in tests/data/README.md instead, and test_manifest_lists_exactly_these_exports fails if that changes.
EXPECTED = {
    "llama_tied": ("genai_fp32", "genai_int4", "torch"),
    "qwen2": ("genai_fp32", "genai_int4", "torch"),
    "qwen3": ("genai_fp32", "genai_int4", "torch"),
    "phi3": ("genai_fp32", "genai_int4", "torch"),
    "phi3_partial": ("genai_fp32", "genai_int4", "torch"),
    "mistral": ("genai_fp32", "genai_int4", "torch"),
    "gemma2": ("genai_fp32", "genai_int4", "torch"),
    "gemma3": ("torch",),
    "smollm3": ("torch",),
    "granite": ("genai_fp32", "genai_int4", "torch"),
}
#: Per-layer windows the convention must report for the builder's graphs (None: full attention).
WINDOWS = {"mistral": [WINDOW, WINDOW], "gemma2": [WINDOW, None], "gemma3": [WINDOW, None]}
FIXTURES = [(arch, exporter) for arch, exporters in EXPECTED.items() for exporter in exporters]
FLOAT = [f for f in FIXTURES if f[1] != "genai_int4"]


def _path(arch: str, exporter: str) -> Path:
    return DATA / arch / ("torch/model.onnx" if exporter == "torch" else exporter)


def _ref(arch: str):
    return np.load(DATA / arch / "reference.npz")


_SESSIONS: dict = {}


def _session(arch: str, exporter: str) -> onnxkv.Session:
    key = (arch, exporter)
    if key not in _SESSIONS:
        _SESSIONS[key] = onnxkv.Session(_path(arch, exporter), threads=2)
    return _SESSIONS[key]


def _feeds(session: onnxkv.Session, ids: np.ndarray, total: int) -> dict:
    """What a user feeds a state: the new ids, a mask over every position so far, position ids if asked."""
    io = session.model.io
    feeds = {io.input_ids: ids, io.attention_mask: np.ones((1, total), np.int64)}
    if io.position_ids:
        feeds[io.position_ids] = np.arange(total - ids.shape[1], total, dtype=np.int64)[None]
    return feeds


def _teacher_forced(session: onnxkv.Session, ref) -> np.ndarray:
    """Logits of the prompt (all positions), then after each greedy token but the last, through one state."""
    state = session.new_state()
    prompt = ref["prompt_ids"][None]
    logits_name = session.model.io.logits
    out = [state.run(_feeds(session, prompt, prompt.shape[1]))[logits_name][0]]
    total = prompt.shape[1]
    for token in ref["greedy_tokens"][:-1]:
        total += 1
        out.append(state.run(_feeds(session, np.array([[token]], np.int64), total))[logits_name][0])
    state.close()
    return np.concatenate(out)


def test_manifest_lists_exactly_these_exports():
    made = {
        arch: tuple(sorted(e for e, r in entry["exports"].items() if r["exported"]))
        for arch, entry in MANIFEST.items()
        if isinstance(entry, dict) and "exports" in entry
    }
    assert made == {arch: tuple(sorted(e)) for arch, e in EXPECTED.items()}


def test_every_sequence_passes_the_window_by_32_tokens():
    for arch in EXPECTED:
        ref = _ref(arch)
        assert len(ref["prompt_ids"]) + len(ref["greedy_tokens"]) >= WINDOW + 32


@pytest.mark.parametrize("arch,exporter", FIXTURES)
def test_load_reports_the_convention(arch, exporter):
    model = onnxkv.load(_path(arch, exporter))
    conv = model.convention
    assert conv.kind == ("concat" if exporter == "torch" else "group_query_attention")
    assert [layer.index for layer in conv.layers] == [0, 1]
    assert (conv.kv_heads, conv.head_size) == ((1, 32) if arch == "phi3_partial" else (2, 16))
    assert conv.describe().startswith(f"cache: {conv.kind} layers=2")
    if exporter != "torch":
        assert [layer.window for layer in conv.layers] == WINDOWS.get(arch, [None, None])
    assert _session(arch, exporter).fallback_nodes == []


@pytest.mark.parametrize("arch,exporter", FLOAT)
def test_greedy_tokens_match_transformers(arch, exporter):
    ref = _ref(arch)
    res = onnxkv.generate(_session(arch, exporter), ref["prompt_ids"][None], len(ref["greedy_tokens"]), eos_token_id=[])
    np.testing.assert_array_equal(res.tokens[0], ref["greedy_tokens"])


@pytest.mark.parametrize("arch,exporter", FLOAT)
def test_logits_match_transformers_at_every_step(arch, exporter):
    ref = _ref(arch)
    got = _teacher_forced(_session(arch, exporter), ref)
    want = np.concatenate([ref["prefill_logits"], ref["decode_logits"][:-1]])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch,exporter", [f for f in FLOAT if f[0] in WINDOWS])
@pytest.mark.parametrize("cache", ["paged", "tensor"])
def test_windowed_models_on_paged_and_tensor_caches(arch, exporter, cache):
    ref = _ref(arch)
    res = onnxkv.generate(
        _session(arch, exporter),
        ref["prompt_ids"][None],
        len(ref["greedy_tokens"]),
        eos_token_id=[],
        cache=onnxkv.CacheConfig("paged", block_size=4) if cache == "paged" else cache,
    )
    np.testing.assert_array_equal(res.tokens[0], ref["greedy_tokens"])


@pytest.mark.parametrize("arch", [a for a, e in EXPECTED.items() if "genai_int4" in e])
def test_int4_stays_near_its_float32_twin(arch):
    ref = _ref(arch)
    fp32 = _teacher_forced(_session(arch, "genai_fp32"), ref)
    int4 = _teacher_forced(_session(arch, "genai_int4"), ref)
    assert np.abs(int4 - fp32).max() <= INT4_TOL
    top2 = np.sort(fp32, axis=-1)[:, -2:]
    stable = top2[:, 1] - top2[:, 0] > 2 * INT4_TOL
    assert stable.sum() >= 4, "too few positions with a clear float32 choice for the comparison to mean anything"
    np.testing.assert_array_equal(int4[stable].argmax(-1), fp32[stable].argmax(-1))


@pytest.mark.parametrize("arch", [a for a, exporters in EXPECTED.items() if "torch" in exporters])
def test_torch_exports_run_every_attention_block_fused(arch):
    # transformers 5 casts the probabilities (softmax(..., dtype=float32).to(q.dtype)): identities that must
    # not keep the block in Python; Gemma 2 caps its scores (c * tanh(scores / c)), the kernel's softcap
    ops = [n.op_type for n in _session(arch, "torch").plan.nodes]
    assert ops.count("MaskedAttention") == 2  # every fixture has two layers
