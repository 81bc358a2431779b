"""EventLog: JSON round trip and validation, per-step figures, the summary table and the figure."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import onnxkv
from onnxkv.events import COUNTER_FIELDS, STEP_FIELDS, Event, EventLog
from onnxkv.zoo.builders import MICRO, build_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic() -> EventLog:
    """Three steps: two cache writes in step 0, none in step 1, one in step 2."""
    log = EventLog()
    # step 0: two nodes, the first writes two caches
    log.record(
        0,
        "attn",
        "GroupQueryAttention",
        "execute",
        allocations=2,
        allocated_bytes=1000,
        committed=1000,
        live=1000,
        peak=1000,
        seconds=0.001,
    )
    log.record(
        0,
        "attn",
        "GroupQueryAttention",
        "cache_write",
        append_copied_bytes=64,
        committed=4096,
        live=2048,
        peak=4096,
        extra={"cache": "past.0.key"},
    )
    log.record(
        0,
        "attn",
        "GroupQueryAttention",
        "cache_write",
        append_copied_bytes=64,
        prefix_copied_bytes=10,
        committed=8192,
        live=4096,
        peak=8192,
        extra={"cache": "past.0.value"},
    )
    log.record(
        0,
        "mlp",
        "MatMul",
        "execute",
        allocations=1,
        allocated_bytes=500,
        workspace_peak_bytes=300,
        committed=1500,
        live=700,
        peak=1500,
        seconds=0.002,
    )
    # step 1: no cache write, figures carried over
    log.record(
        1,
        "attn",
        "GroupQueryAttention",
        "execute",
        allocations=1,
        allocated_bytes=200,
        cow_copied_bytes=32,
        committed=700,
        live=400,
        peak=1500,
        seconds=0.0005,
    )
    log.record(
        1,
        "mlp",
        "MatMul",
        "execute",
        allocated_bytes=0,
        workspace_peak_bytes=100,
        committed=700,
        live=600,
        peak=1500,
        seconds=0.0005,
    )
    # step 2: a cache write and an export (not a node)
    log.record(
        2,
        "attn",
        "GroupQueryAttention",
        "execute",
        allocations=1,
        allocated_bytes=100,
        committed=100,
        live=100,
        peak=1500,
    )
    log.record(
        2,
        "attn",
        "GroupQueryAttention",
        "cache_write",
        append_copied_bytes=16,
        committed=16384,
        live=9000,
        peak=16384,
        extra={"cache": "past.0.key"},
    )
    log.record(
        2,
        "present.0.key",
        "export",
        "export",
        allocations=1,
        allocated_bytes=50,
        prefix_copied_bytes=50,
        committed=16384,
        live=9000,
        peak=16384,
    )
    return log


def test_per_step_numbers_on_a_synthetic_log():
    rows = _synthetic().per_step()
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(tuple(r) == STEP_FIELDS for r in rows)
    r0, r1, r2 = rows
    assert (r0["nodes"], r1["nodes"], r2["nodes"]) == (2, 2, 1)  # cache writes and exports are not nodes
    assert r0["allocations"] == 3 and r0["allocated_bytes"] == 1500
    assert r0["append_copied_bytes"] == 128 and r0["prefix_copied_bytes"] == 10 and r0["cow_copied_bytes"] == 0
    assert r0["workspace_peak_bytes"] == 300  # the largest, not the sum
    # the cache allocator's figures after the last cache write of the step ...
    assert (r0["cache_committed_bytes"], r0["cache_live_bytes"]) == (8192, 4096)
    # ... carried over through a step without one
    assert (r1["cache_committed_bytes"], r1["cache_live_bytes"]) == (8192, 4096)
    assert (r2["cache_committed_bytes"], r2["cache_live_bytes"]) == (16384, 9000)
    # temporaries: from node executions only, never from the cache allocator
    assert (r0["temp_peak_bytes"], r0["temp_live_max_bytes"]) == (1500, 1000)
    assert (r1["temp_peak_bytes"], r1["temp_live_max_bytes"]) == (1500, 600)
    assert (r2["temp_peak_bytes"], r2["temp_live_max_bytes"]) == (1500, 100)
    assert r1["cow_copied_bytes"] == 32 and r1["workspace_peak_bytes"] == 100
    assert r2["allocations"] == 2 and r2["allocated_bytes"] == 150 and r2["prefix_copied_bytes"] == 50
    assert r0["seconds"] == pytest.approx(0.003) and r2["seconds"] == 0.0


def test_per_step_agrees_with_totals():
    log = _synthetic()
    rows = log.per_step()
    for step, r in zip(log.steps(), rows):
        t = log.totals(step)
        assert {k: r[k] for k in COUNTER_FIELDS} == t
    t = log.totals()
    for k in COUNTER_FIELDS:
        if k != "workspace_peak_bytes":
            assert sum(r[k] for r in rows) == t[k]


def test_per_step_without_cache_writes_or_events():
    log = EventLog()
    assert log.per_step() == []
    log.record(0, "n", "Add", "execute", allocated_bytes=8, committed=8, live=8, peak=8)
    log.record(3, "", "grow", "storage")  # a step with no node executions
    r0, r3 = log.per_step()
    assert r0["cache_committed_bytes"] is None and r0["cache_live_bytes"] is None
    assert r3["step"] == 3 and r3["nodes"] == 0 and r3["temp_peak_bytes"] is None


def test_summary_table_has_the_cache_columns_and_one_line_per_step():
    log = _synthetic()
    lines = log.summary().splitlines()
    assert len(lines) == 4
    header = lines[0].split()
    assert header[:3] == ["step", "nodes", "allocs"] and header[-1] == "ms"
    assert "cache_KiB" in header and "cache_live_KiB" in header and "tmp_peak_KiB" in header
    row0 = dict(zip(header, lines[1].split()))
    assert row0["cache_KiB"] == "8.000" and row0["cache_live_KiB"] == "4.000" and row0["alloc_KiB"] == "1.465"
    assert row0["ms"] == "3.00"
    raw = log.summary(unit="B").splitlines()
    assert dict(zip(raw[0].split(), raw[2].split()))["cache_B"] == "8192"
    assert log.summary(unit="MiB").splitlines()[0].split()[3] == "alloc_MiB"
    with pytest.raises(ValueError, match="unit"):
        log.summary(unit="MB")
    # no cache write yet: a dash, not zero
    log2 = EventLog()
    log2.record(0, "n", "Add", "execute", allocated_bytes=8)
    h, r = log2.summary().splitlines()
    assert dict(zip(h.split(), r.split()))["cache_B"] == "-"


def test_from_json_round_trip_text_and_path(tmp_path):
    log = _synthetic()
    path = tmp_path / "run.json"
    text = log.to_json(str(path), indent=1)
    for source in (text, text.encode(), str(path), path):
        back = EventLog.from_json(source)
        assert back.to_dicts() == log.to_dicts()
        assert back.totals() == log.totals() and back.per_step() == log.per_step()
        assert all(isinstance(e, Event) for e in back)
    assert EventLog.from_json(path).source == str(path)
    # a bare list of events, and unknown keys from a newer writer, are accepted
    items = json.loads(text)["events"]
    items[0]["future_field"] = 1
    back = EventLog.from_json(json.dumps(items))
    assert len(back) == len(log) and back[0].allocated_bytes == 1000
    # missing optional fields take the dataclass defaults
    back = EventLog.from_json('{"events": [{"step": 2, "node": "n", "op": "Add"}]}')
    assert back[0].action == "execute" and back[0].allocated_bytes == 0 and back[0].extra == {}


def test_from_json_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        EventLog.from_json(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="path or JSON text"):
        EventLog.from_json(42)


def _ev(**over) -> dict:
    d = {"step": 0, "node": "n", "op": "Add", "action": "execute", "allocated_bytes": 8, "seconds": 0.1, "extra": {}}
    d.update(over)
    return d


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("   \n", "empty"),
        ("{not json", "not valid JSON .*line 1"),
        ("12", "expected a JSON object with an 'events' list, got an integer"),
        ('{"totals": {}}', "no 'events' key"),
        ('{"events": {"step": 0}}', "'events' must be a list, got an object"),
        ('{"events": [], "totals": [1]}', "'totals' must be an object"),
        ('{"events": [3]}', r"events\[0\]: expected an object, got an integer"),
        (json.dumps({"events": [_ev(), {"node": "n"}]}), r"events\[1\]: missing 'step', 'op'"),
        (json.dumps({"events": [_ev(step=-1)]}), r"events\[0\]\.step: expected a non-negative integer, got -1"),
        (json.dumps({"events": [_ev(step="0")]}), r"events\[0\]\.step: expected a non-negative integer"),
        (json.dumps({"events": [_ev(step=True)]}), r"events\[0\]\.step: expected a non-negative integer"),
        (
            json.dumps({"events": [_ev(allocated_bytes=10**400)]}),  # used to be an OverflowError in summary
            r"events\[0\]\.allocated_bytes: expected a non-negative integer, got 1000.* \(at most 2\*\*63 - 1\)",
        ),
        ("[" * 100_000, "nested too deeply"),
        (json.dumps({"events": [_ev(), _ev(allocated_bytes=1.5)]}), r"events\[1\]\.allocated_bytes"),
        (json.dumps({"events": [_ev(committed=None)]}), r"events\[0\]\.committed"),
        (json.dumps({"events": [_ev(node=3)]}), r"events\[0\]\.node: expected a string, got an integer"),
        (json.dumps({"events": [_ev(seconds=-1.0)]}), r"events\[0\]\.seconds: expected a non-negative number"),
        ('{"events": [{"step": 0, "node": "n", "op": "Add", "seconds": NaN}]}', r"events\[0\]\.seconds"),
        (json.dumps({"events": [_ev(extra=[1])]}), r"events\[0\]\.extra: expected an object, got a list"),
    ],
)
def test_from_json_rejects_malformed_input_naming_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        EventLog.from_json(path)
    assert str(path) in str(info.value)  # the file is named


def test_from_json_rejects_a_binary_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="not a UTF-8 text file"):
        EventLog.from_json(path)


def _generate(kind: str, steps: int, **kw) -> onnxkv.Session:
    sess = onnxkv.Session(build_model(kind, MICRO), threads=1, events=True)
    res = onnxkv.generate(sess, np.array([[1, 2, 3, 4]]), steps, eos_token_id=[], **kw)
    assert res.tokens.shape == (1, steps)
    return sess


def test_per_step_on_a_real_run_with_in_place_caches(tmp_path):
    sess = _generate("gqa", 6)
    log = sess.events
    rows = log.per_step()
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["nodes"] == len(sess.plan.nodes) for r in rows)
    kv_row = MICRO.num_kv_heads * MICRO.head_size * 4  # one token of K (or V), float32, batch 1
    caches = 2 * MICRO.num_layers
    assert rows[0]["append_copied_bytes"] == caches * 4 * kv_row  # the 4-token prompt
    assert all(r["append_copied_bytes"] == caches * kv_row for r in rows[1:])
    assert all(r["prefix_copied_bytes"] == 0 and r["cow_copied_bytes"] == 0 for r in rows)
    writes = [e for e in log if e.action == "cache_write"]
    assert len(writes) == 6 * caches
    for r in rows:
        last = [e for e in writes if e.step == r["step"]][-1]
        assert (r["cache_committed_bytes"], r["cache_live_bytes"]) == (last.committed, last.live)
        # the caches hold at least the tokens written so far
        assert r["cache_committed_bytes"] >= r["cache_live_bytes"] >= caches * (4 + r["step"]) * kv_row
        assert r["temp_peak_bytes"] >= r["temp_live_max_bytes"] > 0
        assert r["allocated_bytes"] > 0 and r["allocations"] > 0
    assert rows[0]["allocated_bytes"] > rows[1]["allocated_bytes"]  # the prompt step moves more
    assert len(log.summary().splitlines()) == 7
    # and the same numbers after a round trip through the file generate --events writes
    log.to_json(str(tmp_path / "run.json"))
    assert EventLog.from_json(tmp_path / "run.json").per_step() == rows


def test_per_step_on_the_tensor_path_has_no_cache_figures():
    rows = _generate("concat", 3, cache="tensor").events.per_step()
    assert [r["cache_committed_bytes"] for r in rows] == [None, None, None]
    assert rows[2]["prefix_copied_bytes"] > rows[1]["prefix_copied_bytes"] > 0  # the past is copied again


def test_plot_writes_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    log = _generate("gqa", 5).events
    png = tmp_path / "memory.png"
    fig = log.plot(png)
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert any("bytes held (" in s for s in labels) and any("bytes per step (" in s for s in labels)
    assert fig._suptitle.get_text().startswith("onnxkv memory per step: 5 steps")
    svg = tmp_path / "memory.svg"
    log.plot(str(svg), title="my run")
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    # the synthetic log: log scale, zeros, a step without nodes, the tensor path's missing cache figures
    _synthetic().plot(tmp_path / "synthetic.png")
    _generate("concat", 3, cache="tensor").events.plot(tmp_path / "tensor.png")
    assert (tmp_path / "tensor.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_of_an_empty_log_is_an_error(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="empty"):
        EventLog().plot(tmp_path / "x.png")


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install onnxkv\[plot\]"):
        _synthetic().plot(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
