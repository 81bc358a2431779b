"""The storage event log: what every node execution cost in memory.

An :class:`EventLog` is opt-in (``Session(..., events=True)``).  When it is
off nothing is recorded and the plan runs its plain loop.  When on, it holds
one :class:`Event` per node execution (action ``"execute"``) and one per
storage action taken outside a node (for example a cache growth), each with
the counters of docs/DESIGN.md and the allocator figures after the action.

This module imports nothing from onnxkv, so every layer may use it.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields

__all__ = ["Event", "EventLog", "COUNTER_FIELDS", "STEP_FIELDS", "CACHE_ACTIONS"]

#: Counter fields summed per step by :meth:`EventLog.summary`.
COUNTER_FIELDS = (
    "allocations",
    "allocated_bytes",
    "prefix_copied_bytes",
    "append_copied_bytes",
    "cow_copied_bytes",
    "reuse_count",
    "dequantized_bytes",
    "workspace_peak_bytes",
)

#: Actions whose allocator figures are the *cache* allocator's (not the temporaries').
CACHE_ACTIONS = frozenset(
    {"cache_write", "fork", "reorder", "append_rows", "truncate", "checkpoint", "restore", "evict"}
)

#: Keys of every row of :meth:`EventLog.per_step`, in table order.
STEP_FIELDS = (
    "step",
    "nodes",
    *COUNTER_FIELDS,
    "cache_committed_bytes",
    "cache_live_bytes",
    "temp_peak_bytes",
    "temp_live_max_bytes",
    "seconds",
)

_INT_FIELDS = (*COUNTER_FIELDS, "committed", "live", "peak")


@dataclass
class Event:
    """One node execution or storage action.

    ``step`` counts runs of the owning session or state (0-based); ``node`` and
    ``op`` name the node (empty for actions outside a node).  Byte counters
    are exact counts of bytes the action allocated or copied.  ``committed``,
    ``live`` and ``peak`` are the allocator's figures after the action, and
    ``seconds`` the wall time of the node.
    """

    step: int
    node: str
    op: str
    action: str = "execute"
    allocations: int = 0
    allocated_bytes: int = 0
    prefix_copied_bytes: int = 0
    append_copied_bytes: int = 0
    cow_copied_bytes: int = 0
    reuse_count: int = 0
    dequantized_bytes: int = 0
    workspace_peak_bytes: int = 0
    committed: int = 0
    live: int = 0
    peak: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def figure_format(path: str | os.PathLike, api: str) -> str:
    """The figure format ``path`` names by its extension (``png``, ``svg``, ``pdf``, ...), checked before
    anything is drawn: a path without one is refused, where matplotlib would write ``path.png`` instead
    of ``path``."""
    suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    if not suffix:
        raise ValueError(f"{api}: {os.fspath(path)!r} has no extension; name the format: .png, .svg or .pdf")
    return suffix


class EventLog:
    """An append-only list of :class:`Event` records with summaries.

    ``enabled`` is read by the plan before each run; appending is the only
    mutation.  Not thread-safe: one log belongs to one session or state.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: list[Event] = []
        #: Where :meth:`from_json` read the log from (``None`` for a recorded log).
        self.source: str | None = None

    def append(self, event: Event) -> None:
        self._events.append(event)

    def record(self, step: int, node: str, op: str, action: str, **fields) -> Event:
        """Append an event built from keyword fields (counters, allocator figures)."""
        ev = Event(step=step, node=node, op=op, action=action, **fields)
        self._events.append(ev)
        return ev

    def clear(self) -> None:
        self._events.clear()

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)

    def __getitem__(self, i: int) -> Event:
        return self._events[i]

    @property
    def events(self) -> list[Event]:
        return list(self._events)

    def steps(self) -> list[int]:
        return sorted({e.step for e in self._events})

    def totals(self, step: int | None = None) -> dict[str, int]:
        """Sum of every counter over all events, or over one step."""
        out = dict.fromkeys(COUNTER_FIELDS, 0)
        for e in self._events:
            if step is None or e.step == step:
                for k in COUNTER_FIELDS:
                    if k == "workspace_peak_bytes":
                        out[k] = max(out[k], e.workspace_peak_bytes)
                    else:
                        out[k] += getattr(e, k)
        return out

    def per_step(self) -> list[dict]:
        """One dict per step (keys :data:`STEP_FIELDS`), in step order.

        * ``nodes``: node executions (action ``"execute"``) in the step;
        * the :data:`COUNTER_FIELDS`: summed over every event of the step
          (``workspace_peak_bytes``: the largest), as in :meth:`totals`;
        * ``cache_committed_bytes`` / ``cache_live_bytes``: the cache
          allocator's figures after the last cache write of the step, carried
          over from the previous step when the step wrote no cache, ``None``
          until the log holds a cache write (for example on the tensor path);
        * ``temp_peak_bytes``: the temporaries allocator's ``peak`` (its
          largest ``live`` so far, so it never decreases), and
          ``temp_live_max_bytes``: the largest ``live`` after a node of this
          step; both ``None`` in a step without node executions;
        * ``seconds``: the summed node times.
        """
        by_step: dict[int, list[Event]] = {}
        for e in self._events:
            by_step.setdefault(e.step, []).append(e)
        rows: list[dict] = []
        cache_committed: int | None = None
        cache_live: int | None = None
        for step in sorted(by_step):
            counters = dict.fromkeys(COUNTER_FIELDS, 0)
            nodes = 0
            temp_peak: int | None = None
            temp_live: int | None = None
            seconds = 0.0
            for e in by_step[step]:
                for k in COUNTER_FIELDS:
                    v = getattr(e, k)
                    counters[k] = max(counters[k], v) if k == "workspace_peak_bytes" else counters[k] + v
                seconds += e.seconds
                if e.action in CACHE_ACTIONS:
                    cache_committed, cache_live = e.committed, e.live
                elif e.action == "execute":
                    nodes += 1
                    temp_peak = e.peak if temp_peak is None else max(temp_peak, e.peak)
                    temp_live = e.live if temp_live is None else max(temp_live, e.live)
            rows.append(
                {
                    "step": step,
                    "nodes": nodes,
                    **counters,
                    "cache_committed_bytes": cache_committed,
                    "cache_live_bytes": cache_live,
                    "temp_peak_bytes": temp_peak,
                    "temp_live_max_bytes": temp_live,
                    "seconds": seconds,
                }
            )
        return rows

    def summary(self, unit: str | None = None) -> str:
        """A per-step table (one line per step, from :meth:`per_step`).

        Columns: step, node executions, allocations, then bytes in ``unit``
        (``"B"``, ``"KiB"``, ``"MiB"`` or ``"GiB"``; default: the largest unit
        in which the biggest figure is at least 1): allocated, prefix / append
        / copy-on-write copied, cache committed and live (``-`` before the
        first cache write), the temporaries allocator's peak and the largest
        temporaries live in the step, and the step's node time in ms.
        """
        return _format_table(self.per_step(), unit)

    def to_dicts(self) -> list[dict]:
        return [asdict(e) for e in self._events]

    def to_json(self, path: str | None = None, indent: int | None = None) -> str:
        """The log as JSON, ``{"events": [...], "totals": {...}}``; also written to ``path`` if given.

        :meth:`from_json` reads it back.
        """
        text = json.dumps({"events": self.to_dicts(), "totals": self.totals()}, indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, source: str | bytes | os.PathLike) -> EventLog:
        """Load a log written by :meth:`to_json` (or ``onnxkv generate --events``).

        ``source`` is a path, or the JSON text itself (a string starting with
        ``{`` or ``[``).  The file holds ``{"events": [...], "totals": {...}}``
        (a bare list of events is accepted too).  Each event needs ``step``,
        ``node`` and ``op``; the other :class:`Event` fields default as in the
        dataclass and unknown keys are ignored.  A malformed file raises
        ``ValueError`` naming the file, the event index and the field.
        """
        name, text = _read_source(source)
        if not text.strip():
            raise ValueError(f"{name}: empty, expected the JSON written by EventLog.to_json")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        except RecursionError:
            raise ValueError(f"{name}: JSON nested too deeply for an event log") from None
        if isinstance(data, dict):
            if "events" not in data:
                keys = ", ".join(repr(k) for k in list(data)[:5]) or "none"
                raise ValueError(
                    f"{name}: no 'events' key at the top level (keys: {keys}); expected "
                    '{"events": [...], "totals": {...}} as written by EventLog.to_json'
                )
            events = data["events"]
            totals = data.get("totals")
            if totals is not None and not isinstance(totals, dict):
                raise ValueError(f"{name}: 'totals' must be an object, got {_kind(totals)}")
        elif isinstance(data, list):
            events = data
        else:
            raise ValueError(f"{name}: expected a JSON object with an 'events' list, got {_kind(data)}")
        if not isinstance(events, list):
            raise ValueError(f"{name}: 'events' must be a list, got {_kind(events)}")
        log = cls()
        for i, d in enumerate(events):
            log.append(_event_from_dict(d, f"{name}: events[{i}]"))
        log.source = name
        return log

    def plot(self, path: str | os.PathLike, title: str | None = None):
        """Draw the memory of every step and save it to ``path`` (format from the extension: .png, .svg, .pdf).

        Three panels share the step axis: bytes held after the step (cache
        committed and live, temporaries peak and largest live), bytes moved in
        the step (allocated; append, prefix and copy-on-write copied; log
        scale), and allocations per step.  Needs matplotlib (``pip install
        onnxkv[plot]``); pyplot is not used, so no window opens and the
        global backend is left alone.  Returns the ``matplotlib.figure.Figure``.
        """
        try:
            from matplotlib.figure import Figure
            from matplotlib.ticker import FuncFormatter, MaxNLocator
        except ImportError as e:
            raise ImportError("EventLog.plot needs matplotlib: pip install onnxkv[plot]") from e
        fmt = figure_format(path, "EventLog.plot")
        rows = self.per_step()
        if not rows:
            raise ValueError("EventLog.plot: the log is empty (was the session built with events=True?)")
        steps = [r["step"] for r in rows]
        markers = len(rows) <= 80

        def series(key, scale, zero_gap=False):
            out = []
            for r in rows:
                v = r[key]
                out.append(math.nan if v is None or (zero_gap and v == 0) else v / scale)
            return out

        fig = Figure(figsize=(9.0, 8.0), layout="constrained")
        ax_held, ax_moved, ax_allocs = fig.subplots(3, 1, sharex=True, height_ratios=(3, 3, 1.6))

        # (key, label, colour, line style, width): committed is drawn wide and pale so that
        # live, which often equals it, stays visible on top.
        held_keys = (
            ("cache_committed_bytes", "cache committed", "C0", "-", 5.0),
            ("cache_live_bytes", "cache live", "C1", "-", 1.5),
            ("temp_live_max_bytes", "temporaries: largest live in step", "C2", "-", 1.5),
            ("temp_peak_bytes", "temporaries: allocator peak so far", "C2", "--", 1.5),
        )
        held_max = max((r[k] or 0) for r in rows for k, *_ in held_keys)
        unit, scale = _unit(held_max)
        for key, label, color, style, width in held_keys:
            ys = series(key, scale)
            if all(math.isnan(y) for y in ys):
                label += " (no cache write logged)"
            ax_held.plot(
                steps,
                ys,
                style,
                color=color,
                label=label,
                linewidth=width,
                alpha=0.45 if width > 2 else 1.0,
                marker="o" if markers and width <= 2 else None,
                markersize=3,
            )
        ax_held.set_ylabel(f"bytes held ({unit})")
        ax_held.set_ylim(bottom=0)
        ax_held.set_title("held: caches after the step, temporaries during it", loc="left", fontsize="medium")

        moved_keys = (
            ("allocated_bytes", "allocated", "C3"),
            ("append_copied_bytes", "append copied", "C4"),
            ("prefix_copied_bytes", "prefix copied", "C5"),
            ("cow_copied_bytes", "copy-on-write copied", "C6"),
        )
        moved_max = max(r[k] for r in rows for k, *_ in moved_keys)
        unit, scale = _unit(moved_max)
        positive = [r[k] for r in rows for k, *_ in moved_keys if r[k] > 0]
        log_moved = bool(positive) and max(positive) / min(positive) >= 20
        for key, label, color in moved_keys:
            ys = series(key, scale, zero_gap=log_moved)
            if not any(r[key] for r in rows):
                label += " (none)"
            ax_moved.plot(steps, ys, color=color, label=label, marker="o" if markers else None, markersize=3)
        if log_moved:
            ax_moved.set_yscale("log")
            plain = FuncFormatter(lambda v, _pos: f"{v:g}")
            ax_moved.yaxis.set_major_formatter(plain)
        else:
            ax_moved.set_ylim(bottom=0)
        ax_moved.set_ylabel(f"bytes per step ({unit})")
        ax_moved.set_title(
            "moved in the step" + (" (log scale; zero values not drawn)" if log_moved else ""),
            loc="left",
            fontsize="medium",
        )

        allocs = [r["allocations"] for r in rows]
        ax_allocs.bar(steps, allocs, width=0.8, color="C7", label="allocations")
        ax_allocs.set_ylabel("allocations")
        ax_allocs.set_xlabel("step (session run; in generate, step 0 is the prompt)")
        ax_allocs.xaxis.set_major_locator(MaxNLocator(integer=True))

        for ax in (ax_held, ax_moved, ax_allocs):
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
        if title is None:
            src = self.source
            title = f"onnxkv memory per step: {len(rows)} steps, {len(self._events)} events"
            if src and not src.startswith("<"):
                title += f"\n{os.path.basename(src)}"
        fig.suptitle(title)
        fig.savefig(path, dpi=110, format=fmt)
        return fig


_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def _unit(largest: float, unit: str | None = None) -> tuple[str, int]:
    """``unit`` and its size; by default the largest unit in which ``largest`` is at least 1."""
    if unit is not None:
        for name, size in _UNITS:
            if name == unit:
                return name, size
        raise ValueError(f"unit must be one of {', '.join(n for n, _ in _UNITS)}, got {unit!r}")
    for name, size in _UNITS:
        if largest >= size:
            return name, size
    return "B", 1


_BYTE_COLUMNS = (
    ("allocated_bytes", "alloc"),
    ("prefix_copied_bytes", "prefix"),
    ("append_copied_bytes", "append"),
    ("cow_copied_bytes", "cow"),
    ("cache_committed_bytes", "cache"),
    ("cache_live_bytes", "cache_live"),
    ("temp_peak_bytes", "tmp_peak"),
    ("temp_live_max_bytes", "tmp_max"),
)


def _format_table(rows: list[dict], unit: str | None = None) -> str:
    largest = max((r[k] or 0 for r in rows for k, _ in _BYTE_COLUMNS), default=0)
    uname, size = _unit(largest, unit)
    digits = 0 if size == 1 else 3

    def fmt(v):
        return "-" if v is None else (f"{v}" if digits == 0 else f"{v / size:.{digits}f}")

    cols = ("step", "nodes", "allocs", *(f"{h}_{uname}" for _, h in _BYTE_COLUMNS), "ms")
    table = [cols]
    for r in rows:
        table.append(
            (
                str(r["step"]),
                str(r["nodes"]),
                str(r["allocations"]),
                *(fmt(r[k]) for k, _ in _BYTE_COLUMNS),
                f"{r['seconds'] * 1e3:.2f}",
            )
        )
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(t, widths)) for t in table)


def _kind(v) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
        int: "an integer",
        float: "a number",
    }.get(type(v), type(v).__name__)


def _read_source(source) -> tuple[str, str]:
    if isinstance(source, (bytes, bytearray)):
        source = bytes(source).decode("utf-8", errors="strict")
        return "<JSON text>", source
    if isinstance(source, str) and source.lstrip()[:1] in ("{", "["):
        return "<JSON text>", source
    try:
        path = os.fspath(source)
    except TypeError:
        raise TypeError(f"EventLog.from_json: expected a path or JSON text, got {type(source).__name__}") from None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO's open would wait for a writer
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):  # a FIFO or device could block or never end
                raise ValueError(f"{path}: not a regular file; expected the JSON written by EventLog.to_json")
            if st.st_size > EVENT_LOG_BYTES_LIMIT:
                raise ValueError(
                    f"{path}: {st.st_size} bytes, more than an event log may hold ({EVENT_LOG_BYTES_LIMIT})"
                )
            return str(path), f.read().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file; expected the JSON written by EventLog.to_json") from None


_EVENT_FIELDS = {f.name for f in fields(Event)}
#: Largest event log file read (a long Engine run with pool records is a few tens of MB).
EVENT_LOG_BYTES_LIMIT = 1 << 30


def _event_from_dict(d, where: str) -> Event:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object, got {_kind(d)}")
    missing = [k for k in ("step", "node", "op") if k not in d]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(repr(k) for k in missing)}")
    kw = {}
    for k, v in d.items():
        if k not in _EVENT_FIELDS:
            continue  # written by a newer version: ignored
        if k == "step" or k in _INT_FIELDS:
            if type(v) is not int or not 0 <= v < 2**63:
                raise ValueError(f"{where}.{k}: expected a non-negative integer, got {v!r:.40} (at most 2**63 - 1)")
        elif k in ("node", "op", "action"):
            if not isinstance(v, str):
                raise ValueError(f"{where}.{k}: expected a string, got {_kind(v)}")
        elif k == "seconds":
            if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{where}.seconds: expected a non-negative number, got {v!r}")
            v = float(v)
        elif k == "extra":
            if not isinstance(v, dict):
                raise ValueError(f"{where}.extra: expected an object, got {_kind(v)}")
        kw[k] = v
    return Event(**kw)
