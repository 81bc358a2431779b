"""The onnxkv command: generate and inspect, on a saved model and the embedded default."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from onnxkv.cli import main
from onnxkv.models import embedded
from onnxkv.models.builders import MICRO, build_model, save_genai_folder


@pytest.fixture(scope="module")
def genai_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("micro")
    save_genai_folder(build_model("gqa", MICRO), MICRO, d)
    return d


def test_generate_prints_ids_speed_memory_and_writes_events(genai_dir, tmp_path, capsys):
    ev = tmp_path / "events.json"
    assert main(["generate", str(genai_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "20",
                 "--events", str(ev), "--threads", "1"]) == 0
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


def test_errors_are_reported_not_raised(genai_dir, tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing.onnx")]) == 2
    assert "error" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="comma-separated"):
        main(["generate", str(genai_dir), "--prompt-ids", "a,b"])
    assert main(["generate", str(genai_dir), "--prompt-ids", "1,2", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


@pytest.mark.skipif(not (embedded.embedded_model_dir() / "genai_config.json").exists(),
                    reason="embedded model not built")
def test_embedded_default_prints_text(tmp_path):
    # Run outside the source tree so the installed package (with its compiled kernels) is imported.
    r = subprocess.run([sys.executable, "-m", "onnxkv", "generate", "--prompt", "The ", "--max-new-tokens", "24",
                        "--quiet"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = [line for line in r.stdout.splitlines() if line.startswith("text:")][0]
    assert text.startswith("text: The ") and len(text) > len("text: The ") + 5
    r = subprocess.run([sys.executable, "-m", "onnxkv", "inspect"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0 and "group_query_attention" in r.stdout
