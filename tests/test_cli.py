"""The onnxkv command: generate and inspect, on a saved model and the embedded default."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

import onnxkv
from onnxkv import load
from onnxkv.cli import main
from onnxkv.zoo import embedded
from onnxkv.zoo.builders import MICRO, build_model, save_genai_folder


@pytest.fixture(scope="module")
def genai_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("micro")
    save_genai_folder(build_model("gqa", MICRO), MICRO, d)
    return d


def test_generate_prints_ids_speed_memory_and_writes_events(genai_dir, tmp_path, capsys):
    ev = tmp_path / "events.json"
    assert (
        main(
            [
                "generate",
                str(genai_dir),
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "20",
                "--events",
                str(ev),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    ids = out.splitlines()[0]
    assert ids.startswith("ids:") and 1 <= len(ids.split()[1:]) <= 20
    assert "tokens/s" in out and "memory:" in out and "KV copied" in out
    assert "generating 20/20 tokens" in err  # progress display on long runs
    data = json.loads(ev.read_text())
    assert data["events"] and "prefix_copied_bytes" in data["totals"]


def test_generate_with_a_paged_cache_prints_the_same_tokens(genai_dir, capsys):
    args = ["generate", str(genai_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--threads", "1", "--quiet"]
    assert main(args) == 0
    want = capsys.readouterr().out.splitlines()[0]
    assert main(args + ["--cache", "paged", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == want
    assert "copy-on-write" in out


def test_inspect_reports_convention_ops_fallbacks_io(genai_dir, capsys):
    assert main(["inspect", str(genai_dir)]) == 0
    out = capsys.readouterr().out
    assert "cache: group_query_attention" in out
    assert "com.microsoft::GroupQueryAttention" in out
    assert "fallback nodes (onnx.reference): 0" in out
    assert "input_ids: int64" in out and "present.0.key" in out
    assert re.search(
        r"weights: \d+\.\d\d MiB in kernel layouts, \d+\.\d\d MiB read from file mappings, \d+\.\d\d MiB other", out
    )


def test_inspect_shows_a_float16_files_declared_types_and_its_cast_caches(tmp_path, capsys):
    """A float16 file with float32 inputs (keep_io_types): its pasts as the file declares them, noted as held
    in float16, and the count of cast caches."""
    pytest.importorskip("onnxruntime")
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    path = tmp_path / "model.onnx"
    onnx.save(convert_float_to_float16(build_model("gqa", MICRO, seed=1), keep_io_types=True), str(path))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"cast caches: {2 * MICRO.num_layers} float32 pasts held as float16" in out
    assert re.search(r"past_key_values\.0\.key: float32 \[.*\] \(held as float16\)", out)


def test_errors_are_reported_not_raised(genai_dir, tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing.onnx")]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["generate", str(genai_dir), "--prompt-ids", "a,b"]) == 2
    assert "onnxkv generate: error: --prompt-ids must be comma-separated" in capsys.readouterr().err
    assert main(["generate", str(genai_dir), "--prompt-ids", "1,2", "--do-sample", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_hostile_arguments_end_in_one_line_errors(genai_dir, tmp_path, capsys):
    """Each used to end in a traceback, a silently ignored option, or an error after the whole run."""
    usage = [  # argument errors exit 2 with one line, as argparse's own do
        (["--prompt-ids", str(2**63)], "token ids"),
        (["--prompt-ids", "1,2", "--temperature", "0.5", "--top-k", "3"], "--temperature, --top-k need --do-sample"),
        (["--prompt-ids", "1,2", "--prompt", "The "], "give --prompt or --prompt-ids, not both"),
    ]
    usage += [
        (["--prompt-ids", "1,2", "--events", events], "--events must name a file in an existing folder")
        for events in ("", str(tmp_path), str(tmp_path / "no" / "run.json"))
    ]
    for extra, message in usage:
        assert main(["generate", str(genai_dir), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("onnxkv generate: error: ") and message in err and err.count("\n") == 1
    fifo = tmp_path / "fifo.onnx"
    os.mkfifo(fifo)
    assert main(["inspect", str(fifo)]) == 2  # it used to block reading the FIFO
    assert "not a regular file" in capsys.readouterr().err
    assert main(["report", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    deep = tmp_path / "[deep].json"  # a file name that looks like JSON text
    deep.write_text("[" * 100_000)
    assert main(["report", str(deep)]) == 2
    assert "nested too deeply" in capsys.readouterr().err


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_generate_quantizes_weights_first(genai_dir, tmp_path, monkeypatch, capsys, weights):
    """--weights quantizes a copy in a temporary folder (removed afterwards) and generates with it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert (
        main(
            [
                "generate",
                str(genai_dir),
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "8",
                "--threads",
                "1",
                "--quiet",
                "--weights",
                weights,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        out.splitlines()[0] == f"weights: 15 MatMuls quantized to {weights} (block 32), 0 left float; "
        f"initializers {out.split('initializers ')[1].split(chr(10))[0]}"
    )
    assert len(out.splitlines()[1].split()[1:]) == 8 and "tokens/s" in out
    assert list(tmp_path.iterdir()) == []


def test_generate_quantizes_a_model_file_with_its_config(genai_dir, tmp_path, monkeypatch, capsys):
    """A model file's genai_config.json (read by onnxkv.load beside the file) goes with its quantized copy."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    loaded = []
    monkeypatch.setattr(onnxkv, "load", lambda path: loaded.append(load(path)) or loaded[-1])
    assert (
        main(
            [
                "generate",
                str(genai_dir / "model.onnx"),
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "4",
                "--quiet",
                "--threads",
                "1",
                "--weights",
                "int8",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("weights: 15 MatMuls quantized to int8")
    (model,) = loaded
    assert model.path.parent.parent == tmp_path and model.genai_config == json.loads(
        (genai_dir / "genai_config.json").read_text()
    )
    assert list(tmp_path.iterdir()) == []


def test_generate_quantizes_the_embedded_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["generate", "--prompt", "The ", "--max-new-tokens", "16", "--quiet", "--weights", "int8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("weights: 21 MatMuls quantized to int8 (block 32)")
    text = [line for line in out.splitlines() if line.startswith("text:")][0]
    assert text.startswith("text: The ") and len(text) > len("text: The ") + 5
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        main(["generate", "--weights", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


@pytest.mark.skipif(
    not (embedded.embedded_model_dir() / "genai_config.json").exists(), reason="embedded model not built"
)
def test_embedded_default_prints_text(tmp_path):
    # Run outside the source tree so the installed package (with its compiled kernels) is imported.
    r = subprocess.run(
        [sys.executable, "-m", "onnxkv", "generate", "--prompt", "The ", "--max-new-tokens", "24", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    text = [line for line in r.stdout.splitlines() if line.startswith("text:")][0]
    assert text.startswith("text: The ") and len(text) > len("text: The ") + 5
    r = subprocess.run(
        [sys.executable, "-m", "onnxkv", "inspect"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0 and "group_query_attention" in r.stdout


def test_generate_takes_the_cache_config_and_sampling_options(genai_dir, capsys):
    base = ["generate", str(genai_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--threads", "1", "--quiet"]
    runs = {}
    for name, extra in {
        "greedy": [],
        "tensor": ["--cache", "tensor"],
        "fp16": ["--cache", "contiguous", "--kv-format", "fp16"],
        "int8": ["--kv-format", "int8", "--block-size", "4"],
        "sampled": ["--do-sample", "--temperature", "5", "--seed", "1"],
        "sampled again": ["--do-sample", "--temperature", "5", "--seed", "1"],
    }.items():
        assert main(base + extra) == 0, name
        runs[name] = capsys.readouterr().out.splitlines()[0]
    assert runs["tensor"] == runs["greedy"]
    assert runs["sampled"] == runs["sampled again"]
    assert main(base + ["--cache", "tensor", "--block-size", "4"]) == 2
    assert "block_size=4 needs kind='paged', got kind='tensor'" in capsys.readouterr().err
