"""Every graph form of the MICRO decoder matches the NumPy reference through a prefill and
four decode steps, for one sequence and for a padded batch of two."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx.defs import OpSchema

from onnxkv.zoo.builders import (
    FAMILIES,
    MICRO,
    SMALL,
    TINY,
    DecoderConfig,
    build_attention_model,
    build_model,
    default_position_ids,
    genai_config,
    random_weights,
    reference_forward,
    save_genai_folder,
)

ort = pytest.importorskip("onnxruntime")

CFG = MICRO
TOL = 1e-4
STEPS = 4
PROMPTS = {1: [7], 2: [7, 4]}


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=0)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, CFG.vocab_size, n).tolist()


def register_simplified_layer_norm() -> None:
    """Tell ``onnx.checker`` about ONNX Runtime's default-domain contrib op, as ORT defines it."""
    if onnx.defs.has("SimplifiedLayerNormalization"):
        return
    floats = ["tensor(float)", "tensor(float16)", "tensor(double)", "tensor(bfloat16)"]
    onnx.defs.register_schema(
        OpSchema(
            "SimplifiedLayerNormalization",
            "",
            1,
            inputs=[OpSchema.FormalParameter("X", "T"), OpSchema.FormalParameter("scale", "V")],
            outputs=[
                OpSchema.FormalParameter("Y", "V"),
                OpSchema.FormalParameter("inv_std_var", "U", param_option=OpSchema.FormalParameterOption.Optional),
            ],
            type_constraints=[("T", floats, ""), ("U", ["tensor(float)", "tensor(double)"], ""), ("V", floats, "")],
            attributes=[
                OpSchema.Attribute("axis", OpSchema.AttrType.INT, ""),
                OpSchema.Attribute("epsilon", OpSchema.AttrType.FLOAT, ""),
                OpSchema.Attribute("stash_type", OpSchema.AttrType.INT, ""),
            ],
        )
    )


class Runner:
    """Drives one graph form the way a generator would and returns per-row valid logits.

    ``padding="left"``: prompts left-padded, ``attention_mask`` grows by one column per
    step, ``position_ids = max(cumsum(mask) - 1, 0)`` (attention, concat, tensorscatter).
    ``padding="right"``: row ``r`` of ``attention_mask`` is ``len_r`` ones and its new token
    lands in cache slot ``len_r`` (required by gqa; also works for tensorscatter).
    gqa gets no ``position_ids``; tensorscatter gets ``write_indices`` (first slot written
    this step) and a cache / ``attention_mask`` of ``max_length`` slots; ``shared`` starts
    gqa from a ``max_length`` buffer (GenAI's past_present_share_buffer).
    """

    def __init__(self, family: str, weights, session=None, padding: str | None = None, shared: bool = False) -> None:
        self.padding = padding or ("right" if family == "gqa" else "left")
        self.static = family == "tensorscatter"
        self.positions = family != "gqa"
        self.capacity = CFG.max_length if self.static or shared else 0
        if session is None:
            options = ort.SessionOptions()
            options.log_severity_level = 3  # TensorScatter warns that it copies past to present
            model = build_model(family, CFG, weights=weights)
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self.session = session

    def run(self, ids: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": ids, "attention_mask": self.mask}
        if self.static:
            feeds["attention_mask"] = np.pad(self.mask, ((0, 0), (0, CFG.max_length - self.mask.shape[1])))
            feeds["write_indices"] = self.write
        if self.positions:
            feeds["position_ids"] = (
                self.write[:, None] + np.arange(ids.shape[1])
                if self.padding == "right"
                else default_position_ids(self.mask, ids.shape[1])
            )
        for i, (k, v) in enumerate(self.past):
            feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = k, v
        outs = self.session.run(None, feeds)
        self.past = list(zip(outs[1::2], outs[2::2]))
        return outs[0]

    def prefill(self, prompts: list[list[int]]) -> list[np.ndarray]:
        batch, width = len(prompts), max(map(len, prompts))
        self.lens = np.array([len(p) for p in prompts])
        self.write = np.zeros(batch, dtype=np.int64)
        pad = [[CFG.pad_token_id] * (width - len(p)) for p in prompts]
        right = self.padding == "right"
        ids = [p + q if right else q + p for p, q in zip(prompts, pad)]
        real = np.arange(width) < self.lens[:, None] if right else np.arange(width) >= width - self.lens[:, None]
        self.mask = real.astype(np.int64)
        empty = np.zeros((batch, CFG.num_kv_heads, self.capacity, CFG.head_size), np.float32)
        self.past = [(empty, empty)] * CFG.num_layers
        logits = self.run(np.array(ids, dtype=np.int64))
        return [logits[r, :n] if right else logits[r, width - n :] for r, n in enumerate(self.lens)]

    def step(self, next_tokens: list[int]) -> np.ndarray:
        if self.padding == "right":
            self.write = self.lens.astype(np.int64)
            self.lens = self.lens + 1
            self.mask = (np.arange(self.lens.max()) < self.lens[:, None]).astype(np.int64)
        else:
            self.write = np.full(len(next_tokens), self.mask.shape[1], dtype=np.int64)
            self.lens = self.lens + 1
            self.mask = np.concatenate([self.mask, np.ones((len(next_tokens), 1), np.int64)], axis=1)
        return self.run(np.array(next_tokens, dtype=np.int64)[:, None])[:, 0]

    def cache(self, layer: int, kind: int, row: int) -> np.ndarray:
        """Row ``row``'s cached keys (``kind`` 0) or values (1) of real tokens, [kv_heads, n, head]."""
        cached = self.past[layer][kind][row]
        if self.padding == "right":
            return cached[:, : self.lens[row]]
        return cached[:, np.flatnonzero(self.mask[row])]


def check_against_reference(runner: Runner, weights, batch: int) -> list[np.ndarray]:
    """Prefill + STEPS decode steps; every row must match the reference run on that row alone."""
    prompts = [tokens(n, seed=10 + r) for r, n in enumerate(PROMPTS[batch])]
    cont = [tokens(STEPS, seed=20 + r) for r in range(batch)]
    refs = [reference_forward(CFG, weights, np.array([p + c]))[0][0] for p, c in zip(prompts, cont)]
    got = runner.prefill(prompts)
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(got[r], refs[r][: len(p)], atol=TOL, rtol=0)
    for t in range(STEPS):
        logits = runner.step([c[t] for c in cont])
        for r, p in enumerate(prompts):
            np.testing.assert_allclose(logits[r], refs[r][len(p) + t], atol=TOL, rtol=0)
            got[r] = np.concatenate([got[r], logits[r][None]])
    for r, (p, c) in enumerate(zip(prompts, cont)):
        _, present = reference_forward(CFG, weights, np.array([p + c]))
        for layer in range(CFG.num_layers):
            for kind in (0, 1):
                np.testing.assert_allclose(runner.cache(layer, kind, r), present[layer][kind][0], atol=TOL, rtol=0)
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_model_is_valid_onnx(family):
    if family == "gqa":
        register_simplified_layer_norm()
    onnx.checker.check_model(build_model(family, CFG), full_check=True)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_reference(family, batch, weights):
    check_against_reference(Runner(family, weights), weights, batch)


def test_gqa_shared_buffer_matches_reference(weights):
    runner = Runner("gqa", weights, shared=True)
    check_against_reference(runner, weights, 2)
    assert runner.past[0][0].shape[2] == CFG.max_length


def test_tensorscatter_right_padding_with_ragged_write_indices(weights):
    check_against_reference(Runner("tensorscatter", weights, padding="right"), weights, 2)


def test_attention_opset24_matches_reference(weights):
    model = build_attention_model(CFG, weights, opset=24)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 24)]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    check_against_reference(Runner("attention", weights, session=session), weights, 2)


def test_attention_with_a_finite_mask_bias_matches_reference(weights):
    """mask_bias: a float attn_mask (0 / the bias) built with Where; ONNX Runtime runs it as the reference,
    left padding included."""
    model = build_attention_model(CFG, weights, mask_bias=-1e9)
    assert any(n.op_type == "Where" for n in model.graph.node)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    check_against_reference(Runner("attention", weights, session=session), weights, 2)


@pytest.mark.parametrize("bias", [0.0, 1.0, float("-inf"), float("nan")])
def test_attention_mask_bias_must_be_finite_and_negative(bias):
    with pytest.raises(ValueError, match="mask_bias must be a finite negative float or None"):
        build_attention_model(CFG, mask_bias=bias)


def test_tensorscatter_with_reference_evaluator(weights):
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(build_model("tensorscatter", CFG, weights=weights))
    check_against_reference(Runner("tensorscatter", weights, session=evaluator), weights, 2)


def test_families_agree(weights):
    results = {family: check_against_reference(Runner(family, weights), weights, 2) for family in FAMILIES}
    for family, rows in results.items():
        for row, expected in zip(rows, results["gqa"]):
            np.testing.assert_allclose(row, expected, atol=TOL, rtol=0, err_msg=family)


def test_reference_left_padding_equals_unpadded(weights):
    ids = tokens(5, seed=3)
    padded, _ = reference_forward(CFG, weights, np.array([[0, 0] + ids]), np.array([[0, 0, 1, 1, 1, 1, 1]]))
    alone, _ = reference_forward(CFG, weights, np.array([ids]))
    np.testing.assert_allclose(padded[0, 2:], alone[0], atol=1e-5)


def test_save_genai_folder(tmp_path, weights):
    model = build_model("gqa", CFG, weights=weights)
    save_genai_folder(model, CFG, tmp_path)
    config = json.loads((tmp_path / "genai_config.json").read_text())
    assert config == genai_config(CFG)
    decoder = config["model"]["decoder"]
    assert decoder["filename"] == "model.onnx"
    assert (decoder["head_size"], decoder["hidden_size"]) == (CFG.head_size, CFG.hidden_size)
    assert decoder["inputs"] == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    assert decoder["outputs"] == {
        "logits": "logits",
        "present_key_names": "present.%d.key",
        "present_value_names": "present.%d.value",
    }
    assert (decoder["num_attention_heads"], decoder["num_hidden_layers"], decoder["num_key_value_heads"]) == (
        CFG.num_heads,
        CFG.num_layers,
        CFG.num_kv_heads,
    )
    assert config["model"]["type"] == "llama" and config["model"]["vocab_size"] == CFG.vocab_size
    assert config["search"]["max_length"] == CFG.max_length and config["search"]["past_present_share_buffer"]
    names = {i.name for i in onnx.load(tmp_path / "model.onnx").graph.input}
    assert {decoder["inputs"]["past_key_names"] % i for i in range(CFG.num_layers)} <= names


def test_genai_runtime_generates_like_reference(tmp_path, weights):
    og = pytest.importorskip("onnxruntime_genai")
    save_genai_folder(build_model("gqa", CFG, weights=weights), CFG, tmp_path)
    model = og.Model(str(tmp_path))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=16, do_sample=False)
    generator = og.Generator(model, params)
    sequence = tokens(5, seed=4)
    generator.append_tokens(np.array(sequence, dtype=np.int32))
    for _ in range(STEPS):
        generator.generate_next_token()
    for _ in range(STEPS):
        logits, _ = reference_forward(CFG, weights, np.array([sequence]))
        sequence.append(int(logits[0, -1].argmax()))
    assert generator.get_sequence(0).tolist() == sequence


@pytest.mark.parametrize("cfg", [MICRO, TINY, SMALL])
def test_presets(cfg):
    assert cfg.head_size * cfg.num_heads == cfg.hidden_size and cfg.num_heads % cfg.num_kv_heads == 0


@pytest.mark.parametrize(
    "bad", [dict(num_heads=3), dict(num_kv_heads=3), dict(head_size=7), dict(pad_token_id=97), dict(hidden_size=0)]
)
def test_config_validation(bad):
    fields = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    with pytest.raises(ValueError):
        DecoderConfig(**{**fields, **bad})


def test_random_weights_are_reproducible():
    a, b = random_weights(CFG, seed=5), random_weights(CFG, seed=5)
    np.testing.assert_array_equal(a.layers[1].q_proj, b.layers[1].q_proj)
    assert a.layers[0].q_proj.shape == (CFG.hidden_size, CFG.q_size) and a.lm_head.dtype == np.float32
    assert not np.allclose(a.layers[0].input_norm, 1.0)


def test_unknown_family():
    with pytest.raises(ValueError):
        build_model("mamba", CFG)
