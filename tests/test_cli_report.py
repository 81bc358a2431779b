"""onnxkv report: the per-step memory table and figure of a log written by generate --events."""

from __future__ import annotations

import json
import sys

import pytest

from onnxkv.cli import main
from onnxkv.events import EventLog
from onnxkv.zoo.builders import MICRO, build_model, save_genai_folder

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 8


@pytest.fixture(scope="module")
def run_json(tmp_path_factory):
    d = tmp_path_factory.mktemp("micro_report")
    save_genai_folder(build_model("gqa", MICRO), MICRO, d)
    ev = d / "run.json"
    assert (
        main(
            [
                "generate",
                str(d),
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                str(STEPS),
                "--events",
                str(ev),
                "--threads",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    return ev


def _no_matplotlib(monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)


def _table(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["step"])
    table = [lines[start].split()]
    for line in lines[start + 1 :]:
        if not line.split() or not line.split()[0].isdigit():
            break
        table.append(line.split())
    return table


def test_report_prints_the_per_step_table(run_json, capsys):
    capsys.readouterr()
    assert main(["report", str(run_json)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"events: {len(EventLog.from_json(run_json))} records in {STEPS} steps from ")
    table = _table(out)
    header, rows = table[0], table[1:]
    assert header[:3] == ["step", "nodes", "allocs"] and "cache_KiB" in header and "cache_live_KiB" in header
    assert [r[0] for r in rows] == [str(s) for s in range(STEPS)]
    per_step = EventLog.from_json(run_json).per_step()
    for r, ps in zip(rows, per_step):
        row = dict(zip(header, r))
        assert int(row["nodes"]) == ps["nodes"] and int(row["allocs"]) == ps["allocations"]
        assert float(row["cache_KiB"]) == pytest.approx(ps["cache_committed_bytes"] / 1024, abs=1e-3)
        assert float(row["append_KiB"]) == pytest.approx(ps["append_copied_bytes"] / 1024, abs=1e-3)
    assert "total:" in out and "allocations" in out
    assert "figure:" not in out


def test_report_writes_a_png_with_o(run_json, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "memory.png"
    assert main(["report", str(run_json), "-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert "step" in out and f"figure: {png}" in out
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_report_unsupported_figure_format_is_exit_2(run_json, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["report", str(run_json), "-o", str(tmp_path / "memory.nope")]) == 2
    assert "onnxkv report: error: cannot write" in capsys.readouterr().err


def test_report_figure_path_without_extension_is_exit_2(run_json, tmp_path, capsys):
    """matplotlib would write memory.png and the report would name memory: the path is refused."""
    pytest.importorskip("matplotlib")
    assert main(["report", str(run_json), "-o", str(tmp_path / "memory")]) == 2
    err = capsys.readouterr().err
    assert "EventLog.plot: " in err and "has no extension; name the format" in err
    assert list(tmp_path.iterdir()) == []


def test_report_without_matplotlib_prints_the_table_and_a_note(run_json, monkeypatch, capsys):
    _no_matplotlib(monkeypatch)
    assert main(["report", str(run_json)]) == 0
    out, err = capsys.readouterr()
    assert len(_table(out)) == STEPS + 1
    assert len(err.strip().splitlines()) == 1 and "onnxkv[plot]" in err and "note" in err


def test_report_without_matplotlib_and_o_is_exit_2(run_json, tmp_path, monkeypatch, capsys):
    _no_matplotlib(monkeypatch)
    png = tmp_path / "memory.png"
    assert main(["report", str(run_json), "-o", str(png)]) == 2
    out, err = capsys.readouterr()
    assert len(_table(out)) == STEPS + 1  # the table is still printed
    assert "error" in err and "pip install onnxkv[plot]" in err
    assert not png.exists()


def test_report_missing_file_is_exit_2_with_a_message(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["report", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("onnxkv report: error:") and "No such file" in err and str(missing) in err


def test_report_malformed_file_is_exit_2_naming_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"events": [{"step": 0, "node": "n", "op": "Add", "allocated_bytes": "x"}]}))
    assert main(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "events[0].allocated_bytes" in err and str(bad) in err
    bad.write_text("[1, 2")
    assert main(["report", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_report_empty_log(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    EventLog().to_json(str(empty))
    assert main(["report", str(empty)]) == 0
    assert "0 records in 0 steps" in capsys.readouterr().out
    assert main(["report", str(empty), "-o", str(tmp_path / "x.png")]) == 2
    assert "no events" in capsys.readouterr().err
