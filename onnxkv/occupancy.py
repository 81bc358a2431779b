"""Page-pool occupancy over an engine's steps, read from its event log: a table and a figure.

An :class:`onnxkv.Engine` whose session logs events records, with every ``engine_step`` event, what its
page pool holds (``extra["pool"]``, see :mod:`onnxkv.engine.occupancy`): pages by holder (each request,
``"shared"``, ``"prefix cache"``) and payload bytes by holder and page format.  :func:`pool_records`
reads those records (from a live log or one read back by :meth:`EventLog.from_json`), :func:`pool_table`
summarises them and :func:`plot_pool` draws them; ``onnxkv report EVENTS --pool FILE`` does both.

This module imports nothing of onnxkv but the event log.
"""

from __future__ import annotations

import os

from onnxkv.events import EventLog, figure_format

__all__ = ["pool_records", "pool_table", "plot_pool"]

_FIXED = ("shared", "prefix cache")  # holders drawn after the requests, in this order


def pool_records(log: EventLog) -> list[dict]:
    """The pool record of every ``engine_step`` event that has one, in step order (engine step 0 first).

    Each is the dict :meth:`onnxkv.Engine.pool_occupancy` returns.  Raises ValueError naming the event
    whose record is malformed (a hostile or hand-edited log).
    """
    out = []
    for i, ev in enumerate(log):
        if ev.action != "engine_step" or not ev.extra.get("pool"):
            continue
        rec = ev.extra["pool"]
        holders = rec.get("holders") if isinstance(rec, dict) else None
        ok = isinstance(holders, dict) and isinstance(rec.get("pages"), int)
        for h in holders.values() if ok else ():
            ok = ok and isinstance(h, dict) and isinstance(h.get("pages"), int) and isinstance(h.get("bytes"), dict)
            ok = ok and all(isinstance(k, str) and isinstance(v, int) for k, v in h["bytes"].items())
        if not ok:
            raise ValueError(f"pool_records: event {i} (engine_step) has a malformed 'pool' record: {rec!r}")
        out.append(rec)
    return out


def _holders(records: list[dict]) -> list[str]:
    """Every holder name, requests by id first, then the fixed ones."""
    names = {n for r in records for n in r["holders"]}
    reqs = sorted((n for n in names if n not in _FIXED), key=lambda n: (len(n), n))
    return reqs + [n for n in _FIXED if n in names]


def _formats(records: list[dict]) -> list[str]:
    return sorted({f for r in records for h in r["holders"].values() for f in h["bytes"]})


def pool_table(log: EventLog) -> str:
    """A few lines on the pool over the logged engine steps: how many, the peak (pages, bytes by format
    and holder counts at the step of most pages) and the bytes each format held at its own peak; ``""``
    when the log has no pool record."""
    records = pool_records(log)
    if not records:
        return ""
    mib = 1 / (1 << 20)
    at = max(range(len(records)), key=lambda i: records[i]["pages"])
    peak = records[at]
    bound = f" of {peak['max_pages']}" if peak.get("max_pages") else ""
    held = {f: sum(h["bytes"].get(f, 0) for h in peak["holders"].values()) for f in _formats([peak])}
    reqs = sum(1 for n in peak["holders"] if n not in _FIXED)
    lines = [
        f"pool: {len(records)} engine steps; peak {peak['pages']}{bound} pages at engine step {at} "
        f"({reqs} requests holding pages"
        + "".join(f", {n} {peak['holders'][n]['pages']}" for n in _FIXED if n in peak["holders"])
        + ")",
        "  at the peak: " + ", ".join(f"{f} {b * mib:.2f} MiB" for f, b in held.items()),
    ]
    most = []
    for f in _formats(records):
        per = [sum(h["bytes"].get(f, 0) for h in r["holders"].values()) for r in records]
        i = max(range(len(per)), key=per.__getitem__)
        most.append(f"{f} {per[i] * mib:.2f} MiB (step {i})")
    lines.append("  each format at its most: " + ", ".join(most))
    return "\n".join(lines)


def plot_pool(log: EventLog, path: str | os.PathLike, title: str | None = None):
    """Draw the pool over the engine steps and save it to ``path`` (.png, .svg, .pdf).

    Two stacked panels share the engine-step axis: pages by holder (each request a colour, shared
    pages and prefix-cache pages grey; the pool's page bound dashed) and payload bytes by page format
    (the byte bound dashed).  Needs matplotlib; pyplot is not used.  Returns the Figure.  Raises
    ValueError when the log has no pool record (an engine whose session logged events, batched).
    """
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError("plot_pool needs matplotlib: pip install onnxkv[plot]") from e
    fmt = figure_format(path, "plot_pool")
    records = pool_records(log)
    if not records:
        raise ValueError(
            "plot_pool: the log has no engine pool record (an Engine over paged GroupQueryAttention "
            "caches, its session built with events=True)"
        )
    steps = list(range(len(records)))
    names, fmts = _holders(records), _formats(records)
    fig = Figure(figsize=(9.0, 7.0), layout="constrained")
    ax_pages, ax_bytes = fig.subplots(2, 1, sharex=True)

    reqs = [n for n in names if n not in _FIXED]
    cmap = colormaps["tab20"]
    colors = [cmap(i % 20) for i in range(len(reqs))] + [("0.45", "0.75")[_FIXED.index(n)] for n in names[len(reqs) :]]
    pages = [[r["holders"].get(n, {}).get("pages", 0) for r in records] for n in names]
    ax_pages.stackplot(steps, pages, colors=colors, labels=names, linewidth=0)
    bound = records[-1].get("max_pages")
    if bound:
        ax_pages.axhline(bound, color="k", linestyle="--", linewidth=1, label=f"max_pages {bound}")
    ax_pages.set_ylabel("pages")
    ax_pages.set_title("pages by holder (requests, then shared and prefix-cache pages)", loc="left", fontsize="medium")

    mib = float(1 << 20)
    by_fmt = [[sum(h["bytes"].get(f, 0) for h in r["holders"].values()) / mib for r in records] for f in fmts]
    fcolors = [colormaps["Set2"](i % 8) for i in range(len(fmts))]
    ax_bytes.stackplot(steps, by_fmt, colors=fcolors, labels=fmts, linewidth=0)
    bbound = records[-1].get("max_bytes")
    if bbound:
        ax_bytes.axhline(bbound / mib, color="k", linestyle="--", linewidth=1, label="max_cache_bytes")
    ax_bytes.set_ylabel("payload bytes (MiB)")
    ax_bytes.set_xlabel("engine step")
    ax_bytes.set_title("payload bytes by page format", loc="left", fontsize="medium")
    ax_bytes.xaxis.set_major_locator(MaxNLocator(integer=True))

    for ax in (ax_pages, ax_bytes):
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    if len(names) <= 16:
        ax_pages.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    else:  # too many requests to name: the fixed holders and the bound only
        handles, labels = ax_pages.get_legend_handles_labels()
        keep = [i for i, lab in enumerate(labels) if lab not in reqs]
        ax_pages.legend(
            [handles[i] for i in keep],
            [labels[i] for i in keep],
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize="small",
            frameon=False,
            title=f"{len(reqs)} requests",
        )
    ax_bytes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    if title is None:
        title = f"onnxkv page pool over {len(records)} engine steps ({len(reqs)} requests)"
        src = log.source
        if src and not src.startswith("<"):
            title += f"\n{os.path.basename(src)}"
    fig.suptitle(title)
    fig.savefig(path, dpi=110, format=fmt)
    return fig
