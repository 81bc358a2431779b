"""Hugging Face exports (Optimum's layout: model files in onnx/, config.json and generation_config.json
beside them or beside that folder): the generation settings read from the configs, hostile config files
refused by name, and a repository folder answered with the files to choose from."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

import onnxkv
from onnxkv.errors import ModelError
from onnxkv.zoo.builders import MICRO, build_model


@pytest.fixture()
def repo(tmp_path):
    """A repository folder: onnx/model.onnx and onnx/model_quantized.onnx (the same float model), configs at the top."""
    (tmp_path / "onnx").mkdir()
    model = build_model("concat", MICRO, seed=3)
    for name in ("model.onnx", "model_quantized.onnx"):
        onnx.save(model, str(tmp_path / "onnx" / name))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"vocab_size": MICRO.vocab_size, "eos_token_id": 2, "bos_token_id": 1, "max_position_embeddings": 96}
        )
    )
    return tmp_path


def test_settings_from_the_folder_above(repo):
    m = onnxkv.load(repo / "onnx" / "model.onnx")
    assert (m.eos_token_id, m.bos_token_id, m.pad_token_id, m.max_length, m.vocab_size) == (
        [2],
        1,
        None,
        96,
        MICRO.vocab_size,
    )


def test_generation_config_takes_precedence_and_a_config_beside_the_file_first(repo):
    (repo / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5], "pad_token_id": 0}))
    m = onnxkv.load(repo / "onnx" / "model.onnx")
    assert (m.eos_token_id, m.pad_token_id) == ([4, 5], 0)
    (repo / "onnx" / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert onnxkv.load(repo / "onnx" / "model.onnx").eos_token_id == [7]


def test_genai_config_wins(repo):
    (repo / "onnx" / "genai_config.json").write_text(json.dumps({"model": {"eos_token_id": 9}}))
    assert onnxkv.load(repo / "onnx" / "model.onnx").eos_token_id == [9]


def test_generate_stops_at_the_configured_eos(repo):
    prompt = np.array([[3, 1, 4, 1, 5]])
    (repo / "config.json").write_text(json.dumps({"vocab_size": MICRO.vocab_size}))
    free = onnxkv.generate(onnxkv.Session(repo / "onnx" / "model.onnx"), prompt, 12).tokens[0]
    third = int(free[2])
    (repo / "generation_config.json").write_text(json.dumps({"eos_token_id": third}))
    stopped = onnxkv.generate(onnxkv.Session(repo / "onnx" / "model.onnx"), prompt, 12).tokens[0]
    first = int(np.flatnonzero(free == third)[0])
    assert stopped[: first + 1].tolist() == free[: first + 1].tolist() and len(stopped) <= first + 1 < len(free)


def test_repository_folder_lists_the_files(repo):
    with pytest.raises(
        FileNotFoundError, match=r"give the path of one of: onnx/model\.onnx, onnx/model_quantized\.onnx"
    ):
        onnxkv.load(repo)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "config.json is not valid JSON"),
        ("[1, 2]", "config.json must hold a JSON object, got list"),
        ('{"eos_token_id": [1, true]}', r"eos_token_id must be an int in \[0, 2147483648\), got True"),
        ('{"max_position_embeddings": 0}', r"max_position_embeddings must be an int in \[1, 2147483648\), got 0"),
        ('{"vocab_size": "big"}', "vocab_size must be an int"),
        ('{"bos_token_id": -1}', r"bos_token_id must be an int in \[0, "),
    ],
)
def test_hostile_configs_are_refused_by_name(repo, text, message):
    (repo / "config.json").write_text(text)
    with pytest.raises(ModelError, match=message):
        onnxkv.load(repo / "onnx" / "model.onnx")


def test_config_that_is_no_regular_file_or_too_large(repo):
    (repo / "config.json").unlink()
    (repo / "config.json").mkdir()
    with pytest.raises(ModelError, match="config.json is not a regular file"):
        onnxkv.load(repo / "onnx" / "model.onnx")
    os.rmdir(repo / "config.json")
    with open(repo / "config.json", "wb") as f:
        f.truncate((16 << 20) + 1)
    with pytest.raises(ModelError, match="config.json is larger than"):
        onnxkv.load(repo / "onnx" / "model.onnx")


def test_a_vocabulary_below_the_logits_width_is_refused(repo):
    (repo / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ModelError, match=rf"config.json: vocab_size 10 is below the {MICRO.vocab_size} logits"):
        onnxkv.load(repo / "onnx" / "model.onnx")


def test_token_ids_outside_the_vocabulary_are_left_out_with_a_warning(repo):
    """Tiny random-weight test models keep their family's default ids (GPT-2's 50256 in a vocabulary of 512):
    the model never makes such an id, so it is left out, and the load says so."""
    (repo / "config.json").write_text(
        json.dumps({"vocab_size": MICRO.vocab_size, "eos_token_id": [2, 50256], "pad_token_id": 50256})
    )
    with pytest.warns(RuntimeWarning) as caught:
        m = onnxkv.load(repo / "onnx" / "model.onnx")
    assert m.eos_token_id == [2] and m.pad_token_id is None
    assert sorted(str(w.message).split(": ", 2)[2] for w in caught) == [
        f"eos_token_id [50256] lies outside the vocabulary [0, {MICRO.vocab_size}): ignored",
        f"pad_token_id [50256] lies outside the vocabulary [0, {MICRO.vocab_size}): ignored",
    ]
