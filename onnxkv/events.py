"""The storage event log: what every node execution cost in memory.

An :class:`EventLog` is opt-in (``Session(..., events=True)``).  When it is
off nothing is recorded and the plan runs its plain loop.  When on, it holds
one :class:`Event` per node execution (action ``"execute"``) and one per
storage action taken outside a node (for example a cache growth), each with
the counters of DESIGN.md and the allocator figures after the action.

This module imports nothing from onnxkv, so every layer may use it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

__all__ = ["Event", "EventLog", "COUNTER_FIELDS"]

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


class EventLog:
    """An append-only list of :class:`Event` records with summaries.

    ``enabled`` is read by the plan before each run; appending is the only
    mutation.  Not thread-safe: one log belongs to one session or state.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: list[Event] = []

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

    def summary(self) -> str:
        """A per-step table: counters summed over the step, allocator peak and time."""
        cols = ("step", "nodes", "allocs", "alloc_MB", "prefix_MB", "append_MB", "cow_MB", "peak_MB", "ms")
        rows = [cols]
        by_step: dict[int, list[Event]] = {}
        for e in self._events:
            by_step.setdefault(e.step, []).append(e)
        mb = 1.0 / (1 << 20)
        for step in sorted(by_step):
            evs = by_step[step]
            t = self.totals(step)
            rows.append((
                str(step),
                str(sum(1 for e in evs if e.action == "execute")),
                str(t["allocations"]),
                f"{t['allocated_bytes'] * mb:.3f}",
                f"{t['prefix_copied_bytes'] * mb:.3f}",
                f"{t['append_copied_bytes'] * mb:.3f}",
                f"{t['cow_copied_bytes'] * mb:.3f}",
                f"{max(e.peak for e in evs) * mb:.3f}",
                f"{sum(e.seconds for e in evs) * 1e3:.2f}",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)

    def to_dicts(self) -> list[dict]:
        return [asdict(e) for e in self._events]

    def to_json(self, path: str | None = None, indent: int | None = None) -> str:
        """The events as JSON (a list of objects); also written to ``path`` if given."""
        text = json.dumps({"events": self.to_dicts(), "totals": self.totals()}, indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text
