"""onnxkv.occupancy and `onnxkv report --pool`: an engine's pool records read back from its event log,
summarised, drawn; malformed records and logs without any rejected with a message."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import onnxkv
from onnxkv.cli import main
from onnxkv.events import EventLog
from onnxkv.occupancy import plot_pool, pool_records, pool_table
from onnxkv.zoo import embedded

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory):
    """The event log of an engine: a request alone, then three more sharing its prompt's first pages."""
    session = onnxkv.Session(str(embedded.embedded_model_dir()), threads=1, events=True)
    engine = onnxkv.Engine(session, cache=onnxkv.CacheConfig("paged", block_size=16), max_pages=128)
    head = "import numpy as np\nimport onnx\nfrom onnxkv import Session\n"
    first = engine.add_request(np.array(embedded.encode(head + "a"), np.int64), 12, eos_token_id=[])
    while not first.tokens:
        engine.step()
    for tail in ("b = 1", "c = 22", "d = 333"):
        engine.add_request(np.array(embedded.encode(head + tail), np.int64), 12, eos_token_id=[])
    engine.run()
    path = tmp_path_factory.mktemp("pool") / "engine.json"
    session.events.to_json(str(path))
    return path, engine.steps


def test_records_read_back_one_per_engine_step(engine_log):
    path, steps = engine_log
    records = pool_records(EventLog.from_json(path))
    assert len(records) == steps
    assert all(r["max_pages"] == 128 for r in records)
    assert any("shared" in r["holders"] for r in records)
    assert "prefix cache" in records[-1]["holders"]  # all finished: the cached prompt pages remain
    assert pool_records(EventLog()) == [] and pool_table(EventLog()) == ""


def test_table_names_the_peak(engine_log):
    path, steps = engine_log
    log = EventLog.from_json(path)
    records = pool_records(log)
    text = pool_table(log)
    peak = max(r["pages"] for r in records)
    assert text.startswith(f"pool: {steps} engine steps; peak {peak} of 128 pages at engine step ")
    assert "float32" in text and "shared" in text


@pytest.mark.parametrize(
    "bad",
    [
        "not a dict",
        {"pages": 3},
        {"pages": 3, "holders": {"request 0": {"pages": "3", "bytes": {}}}},
        {"pages": 3, "holders": {"request 0": {"pages": 3, "bytes": {"float32": 1.5}}}},
        {"pages": 3, "holders": {"request 0": {"pages": 3, "bytes": []}}},
    ],
)
def test_a_malformed_record_is_rejected_naming_its_event(tmp_path, bad, capsys):
    log = EventLog()
    log.record(0, "", "", "engine_step", extra={"pool": {}})
    log.record(0, "", "", "engine_step", extra={"pool": bad})
    with pytest.raises(ValueError, match="event 1 .engine_step. has a malformed 'pool' record"):
        pool_records(log)
    path = tmp_path / "bad.json"
    log.to_json(str(path))
    assert main(["report", str(path)]) == 2
    assert "malformed 'pool' record" in capsys.readouterr().err


def test_report_prints_the_pool_lines_and_draws_it(engine_log, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _ = engine_log
    png = tmp_path / "pool.png"
    capsys.readouterr()
    assert main(["report", str(path), "--pool", str(png)]) == 0
    out = capsys.readouterr().out
    assert "pool: " in out and f"figure: {png}" in out
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    fig = plot_pool(EventLog.from_json(path), tmp_path / "pool.svg", title="t")
    pages_ax, bytes_ax = fig.axes[:2]
    assert pages_ax.get_ylabel() == "pages" and bytes_ax.get_xlabel() == "engine step"
    labels = pages_ax.get_legend_handles_labels()[1]
    assert labels[:4] == [f"request {i}" for i in range(4)] and "shared" in labels and "prefix cache" in labels


def test_report_pool_path_without_extension_is_exit_2(engine_log, tmp_path, capsys):
    """matplotlib would write pool.png and the report would name pool: the path is refused."""
    pytest.importorskip("matplotlib")
    path, _ = engine_log
    capsys.readouterr()
    assert main(["report", str(path), "--pool", str(tmp_path / "pool")]) == 2
    assert "plot_pool: " in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_report_pool_of_a_log_without_engine_records_is_exit_2(tmp_path, capsys):
    plain = tmp_path / "plain.json"
    log = EventLog()
    log.record(0, "n", "Add", "execute")
    log.to_json(str(plain))
    assert main(["report", str(plain), "--pool", str(tmp_path / "x.png")]) == 2
    assert "no engine pool records" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(ValueError, match="no engine pool record"):
        plot_pool(log, tmp_path / "y.png")


def test_report_pool_without_matplotlib_is_exit_2(engine_log, tmp_path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)
    path, _ = engine_log
    png = tmp_path / "pool.png"
    assert main(["report", str(path), "--pool", str(png)]) == 2
    out, err = capsys.readouterr()
    assert "pool: " in out and "pip install onnxkv[plot]" in err and not png.exists()


def test_the_record_survives_json(engine_log):
    path, _ = engine_log
    raw = json.loads(path.read_text())
    events = raw["events"] if isinstance(raw, dict) else raw
    steps = [e for e in events if e.get("action") == "engine_step"]
    assert steps and all("holders" in e["extra"]["pool"] for e in steps)
