"""Every code block of the README (and of docs/*.md) runs as written.

The ``python`` blocks of one page run in order in one fresh namespace, inside a
temporary folder, so a block may use what an earlier block of the same page
defined (and nothing else); a deprecated spelling of onnxkv's API in them fails
the test.  The ``onnxkv`` commands of ``bash`` blocks run in a
subprocess; installs (``pip``), ``pytest`` and the benchmark scripts are left to
CI and to the benchmark runs.  Tracebacks name the page and its line.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from onnxkv._deprecation import OnnxkvDeprecationWarning

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: A fenced block, possibly indented (inside a list item): its indent, language and body.
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL
)
#: Languages of blocks this test knows what to do with ("" is a synopsis, not code).
LANGUAGES = {"python", "bash", ""}


def blocks(page: Path) -> list[tuple[str, int, str]]:
    """(language, line of the first code line, code with the fence's indent removed) of each fenced block."""
    text = page.read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        indent = m["indent"]
        lines = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in m["body"].splitlines()]
        found.append((m["lang"], text.count("\n", 0, m.start("body")) + 1, "\n".join(lines) + "\n"))
    return found


def onnxkv_commands(code: str) -> list[list[str]]:
    """The arguments of each ``onnxkv ...`` command of a bash block (also inside ``a && b``), comments dropped."""
    commands = []
    for line in code.splitlines():
        words = shlex.shlex(line, posix=True, punctuation_chars=True)
        words.whitespace_split = True
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";"):
                if command[:1] == ["onnxkv"]:
                    commands.append(command[1:])
                command = []
            else:
                command.append(word)
    return commands


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_block_has_a_known_language():
    for page in PAGES:
        for lang, line, _ in blocks(page):
            assert lang in LANGUAGES, f"{_id(page)}:{line}: a ```{lang} block is neither run nor marked as a synopsis"


def test_the_readme_has_runnable_blocks():
    langs = [lang for lang, _, _ in blocks(ROOT / "README.md")]
    assert langs.count("python") >= 2
    assert [c for lang, _, code in blocks(ROOT / "README.md") if lang == "bash" for c in onnxkv_commands(code)]


@pytest.mark.parametrize("page", [p for p in PAGES if any(b[0] == "python" for b in blocks(p))], ids=_id)
def test_python_blocks_run_in_order(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    ran = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", OnnxkvDeprecationWarning)
        for lang, line, code in blocks(page):
            if lang == "python":
                # Leading newlines keep the page's line numbers in tracebacks; a block that raises fails the test.
                exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
                ran += 1
    assert ran and set(namespace) - {"__name__", "__builtins__"}, f"{_id(page)}: no python block defined anything"


@pytest.mark.parametrize(
    "args",
    [c for p in PAGES for lang, _, code in blocks(p) if lang == "bash" for c in onnxkv_commands(code)],
    ids=" ".join,
)
def test_onnxkv_commands_of_bash_blocks_run(args, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "onnxkv", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"onnxkv {shlex.join(args)} failed:\n{done.stdout}\n{done.stderr}"
