"""The package's size rule: every source file of ``onnxkv/`` (Python, Cython, C) holds one job, and no
file is over 600 lines; ``runtime/state.py``, the storage-agnostic State, stays under 350."""

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "onnxkv"
SOURCES = sorted(p for ext in ("py", "pyx", "pxi", "pxd", "h", "c") for p in PACKAGE.rglob(f"*.{ext}"))


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_the_package_has_sources():
    assert len(SOURCES) > 50


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_source_file_is_over_600_lines(path):
    assert _lines(path) <= 600, f"{path.relative_to(PACKAGE)}: {_lines(path)} lines (at most 600)"


def test_state_stays_under_350_lines():
    assert _lines(PACKAGE / "runtime" / "state.py") < 350
