"""Every script in ``examples/`` runs on the embedded model, draws its figure and measures sane numbers.

Each script runs in a subprocess with small settings (a few seconds each), as a
user would run it, and writes its JSON and PNG into a temporary folder.  The
checks are on what the numbers must satisfy whatever the machine's speed:
copy-on-write copies and holds fewer bytes than copy-per-beam, greedy
speculative decoding reproduces greedy generation, float32 pages agree with
themselves and quantized pages hold fewer bytes.  Timing decides nothing here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: The example scripts (helpers start with an underscore).
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def run(script: str, out: Path, *args: str) -> dict:
    """Run ``examples/<script>`` with ``--out out --threads 1`` and ``args``; return its JSON, check its PNG."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--out", str(out), "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    name = script.removesuffix(".py")
    png = out / f"{name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{script} drew no PNG at {png}"
    assert str(png) in done.stdout, f"{script} did not say where its figure is:\n{done.stdout}"
    return json.loads((out / f"{name}.json").read_text(encoding="utf-8"))


def test_every_example_is_tested():
    assert SCRIPTS == ["beam_memory.py", "page_formats.py", "speculative_sweep.py"]


def test_beam_memory(tmp_path):
    result = run("beam_memory.py", tmp_path, "--beams", "4", "--prompt-tokens", "40", "--new-tokens", "5")
    paged, tensor = result["modes"]["paged"], result["modes"]["tensor"]
    steps = len(tensor["step_ms"])
    assert steps >= 1 and all(
        len(m[k]) == steps for m in (paged, tensor) for k in ("copied_bytes", "committed_bytes", "step_ms")
    )
    # copy per beam gathers 4 beams x (40 + step) tokens x 2048 bytes every step; copy-on-write at most a page a beam
    assert all(t >= 4 * 40 * 2048 for t in tensor["copied_bytes"])
    assert all(p <= 4 * 16 * 2048 for p in paged["copied_bytes"])
    assert sum(paged["copied_bytes"]) < sum(tensor["copied_bytes"])
    assert paged["committed_bytes"][-1] < tensor["committed_bytes"][-1]
    assert all(ms > 0 for m in (paged, tensor) for ms in m["step_ms"])
    assert len(paged["best_beam"]) == len(tensor["best_beam"]) == 5


def test_speculative_sweep(tmp_path):
    result = run("speculative_sweep.py", tmp_path, "--draft-tokens", "1,4", "--new-tokens", "16", "--repeats", "1")
    rows = result["rows"]
    assert {(r["prompt"], r["mode"], r["draft_tokens"]) for r in rows} == {
        (p, m, k) for p in ("natural", "repetitive") for m in ("draft", "lookup") for k in (1, 4)
    }
    for r in rows:
        assert r["identical"] and r["new_tokens"] == 16, r
        # the prefill run gives one token, every later target run its accepted tokens and one of its own
        assert r["accepted"] + r["target_runs"] == 16 and 0 <= r["accepted"] <= r["proposed"], r
        assert r["acceptance"] == (r["accepted"] / r["proposed"] if r["proposed"] else 0.0) and r["speedup"] > 0
    # the draft model learnt the target's data: it proposes tokens the target accepts
    assert any(r["accepted"] > 0 for r in rows if r["mode"] == "draft")


def test_page_formats(tmp_path):
    result = run(
        "page_formats.py", tmp_path, "--policies", "fp32,fp16,int8,int4", "--new-tokens", "32", "--prompts", "1"
    )
    rows = {r["policy"]: r for r in result["rows"]}
    assert rows["fp32"]["dequantized_bytes"] == 0 < rows["int8"]["dequantized_bytes"]
    held = [rows[p]["bytes_held"] for p in ("fp32", "fp16", "int8", "int4")]
    assert held == sorted(held, reverse=True) and len(set(held)) == 4
    for r in rows.values():
        assert 0.0 <= r["agreement"] <= 1.0 and r["mean_kl"] >= 0.0
    assert rows["int4"]["mean_kl"] > rows["fp16"]["mean_kl"]
