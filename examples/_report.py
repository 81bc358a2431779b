"""What every example script shares: its output folder, a text table, the JSON file and the figure.

Each example writes ``<out>/<name>.json`` (its measurements) and
``<out>/<name>.png`` (its figure) and prints a table.  ``<out>`` is the
``--out`` argument, by default ``examples/out/`` beside the scripts (ignored
by git).  Figures are drawn on matplotlib ``Figure`` objects without pyplot:
files only, no display needed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

#: Default output folder of the examples (not committed).
DEFAULT_OUT = Path(__file__).resolve().parent / "out"


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every example takes: ``--out`` and ``--threads``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON and PNG (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="kernel and BLAS threads (default: %(default)s)")
    return ap


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """``rows`` as a fixed-width text table of ``columns`` (floats with 4 significant digits)."""

    def cell(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def save(out: Path, name: str, result: dict, figure) -> tuple[Path, Path]:
    """Write ``result`` to ``out/name.json`` and ``figure`` (a matplotlib Figure) to ``out/name.png``."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    figure.savefig(png_path, dpi=110, bbox_inches="tight")
    return json_path, png_path


def new_figure(width: float, height: float):
    """An empty matplotlib ``Figure`` of ``width`` x ``height`` inches, drawn without pyplot.

    No window opens and matplotlib's global backend is left alone (``pip install
    ".[plot]"`` installs matplotlib).
    """
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))
