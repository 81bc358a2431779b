"""Tests of the embedded byte-level model's codec and shipped files (no torch needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onnxkv.zoo import embedded
from onnxkv.zoo.embedded import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, decode, encode

MAIN = embedded.embedded_model_dir()
DRAFT = embedded.embedded_draft_dir()


def test_special_ids() -> None:
    assert (BOS_ID, EOS_ID, PAD_ID) == (256, 257, 258)
    assert VOCAB_SIZE >= 259


@pytest.mark.parametrize("text", ["", "The ", "héllo wörld ✓ 日本語", "tab\tnew\nline", "\x00\xff"])
def test_round_trip(text: str) -> None:
    ids = encode(text)
    assert ids[0] == BOS_ID
    assert all(0 <= i < 256 for i in ids[1:])
    assert ids[1:] == list(text.encode("utf-8"))
    assert encode(text, add_bos=False) == ids[1:]
    assert decode(ids) == text


def test_specials_skipped() -> None:
    ids = [BOS_ID, *b"ab", PAD_ID, *b"c", EOS_ID, VOCAB_SIZE - 1]
    assert decode(ids) == "abc"
    assert decode(np.array(ids, dtype=np.int64)) == "abc"


def test_invalid_utf8_replaced() -> None:
    assert decode([0xE2, 0x9C]) == "\ufffd"  # truncated multi-byte sequence
    assert decode([*b"a", 0xFF, *b"b"]) == "a\ufffdb"


def _check_folder(folder, max_bytes: int) -> dict:
    assert (folder / "model.onnx").is_file()
    assert (folder / "genai_config.json").is_file()
    cfg = json.loads((folder / "genai_config.json").read_text())
    model = cfg["model"]
    assert model["bos_token_id"] == BOS_ID
    assert model["eos_token_id"] == EOS_ID
    assert model["pad_token_id"] == PAD_ID
    assert model["vocab_size"] == VOCAB_SIZE
    dec = model["decoder"]
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert dec["outputs"]["present_key_names"] == "present.%d.key"
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert total <= max_bytes, total
    return cfg


def test_embedded_files() -> None:
    assert MAIN.is_dir(), MAIN
    _check_folder(MAIN, 8 * 2**20)


def test_package_data_size() -> None:
    total = sum(p.stat().st_size for p in MAIN.parent.rglob("*") if p.is_file())
    assert total <= 8 * 2**20 + 2 * 2**20  # main <= 8 MiB, draft <= 2 MiB


def test_draft_files() -> None:
    if not DRAFT.exists():
        pytest.skip("draft model not built")
    cfg = _check_folder(DRAFT, 2 * 2**20)
    main = json.loads((MAIN / "genai_config.json").read_text())
    assert cfg["model"]["vocab_size"] == main["model"]["vocab_size"]


def _greedy(folder, prompt: list[int], steps: int) -> list[int]:
    ort = pytest.importorskip("onnxruntime")
    cfg = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(folder / "model.onnx"), so, providers=["CPUExecutionProvider"])
    n_layers, kv, hs = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_size"]
    past = {}
    for i in range(n_layers):
        for kind in ("key", "value"):
            past[f"past_key_values.{i}.{kind}"] = np.zeros((1, kv, 0, hs), np.float32)
    out_names = [o.name for o in sess.get_outputs()]
    ids = np.array([prompt], np.int64)
    total = len(prompt)
    result = []
    for _ in range(steps):
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), **past}
        outs = dict(zip(out_names, sess.run(None, feeds)))
        logits = outs["logits"]
        assert logits.shape[-1] == VOCAB_SIZE
        nxt = int(logits[0, -1].argmax())
        result.append(nxt)
        past = {k: outs[k.replace("past_key_values.", "present.")] for k in past}
        ids = np.array([[nxt]], np.int64)
        total += 1
    return result


def test_embedded_generates_text() -> None:
    """The trained model continues "The " with mostly printable ASCII bytes."""
    out = _greedy(MAIN, encode("The "), 24)
    text = decode(out)
    assert len(text) > 0
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    assert printable / len(text) > 0.9, text
