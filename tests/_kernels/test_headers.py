"""The C headers of onnxkv/_kernels (the sources, found from the repository
root the tests run from): every header compiles on its own with the C
compiler, in the default build and in the portable one (the macro meson.build
sets for ``-Dsimd=disabled``), and the include structure stays flat: no
include cycle, and no header's text expanded more than twice into any
translation unit of a kernel module (its Cython module and its C sources:
attention_unit.h, the work units of one instruction set, is expanded once,
by the C file of each level).
"""

import re
import shlex
import shutil
import subprocess
import sysconfig
from collections import Counter
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "onnxkv" / "_kernels"
HEADERS = sorted(p.name for p in KERNELS.glob("*.h"))
SOURCES = sorted(p.name for p in KERNELS.glob("*.c"))

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
GUARD = re.compile(r"\A(?:\s*/\*.*?\*/)*\s*#ifndef\s+(\w+)[ \t]*\n\s*#define\s+\1[ \t]*\n", re.S)


def _compiler():
    cc = shlex.split(sysconfig.get_config_var("CC") or "") or ["cc"]
    return cc if shutil.which(cc[0]) else None


def _portable_macro():
    """The macro meson.build defines for the scalar-only build."""
    found = re.search(r"'-D(OKV_NO_\w+)'", (KERNELS / "meson.build").read_text())
    assert found, "meson.build: no -DOKV_NO_* flag for the scalar-only build"
    return found.group(1)


def _includes(name):
    return INCLUDE.findall((KERNELS / name).read_text())


def _local(name):
    return (KERNELS / name).is_file()


@pytest.fixture(scope="module")
def sources():
    if not HEADERS:
        pytest.skip(f"no C headers in {KERNELS} (tests run from an installed package without sources)")


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("header", HEADERS or ["<none>"])
def test_header_compiles_on_its_own(sources, header, portable):
    _syntax_check(["-x", "c", "-I", str(KERNELS), str(KERNELS / header)], portable)


def _syntax_check(source: list[str], portable: bool, warnings: tuple[str, ...] = ()) -> None:
    """``cc -fsyntax-only`` on ``source`` (arguments), in the default or the portable build; skips without a
    compiler."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler (sysconfig CC or cc) on PATH")
    flags = [f"-D{_portable_macro()}"] if portable else []
    cmd = [*cc, "-fsyntax-only", *warnings, "-Werror=implicit-function-declaration", *flags, *source]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert run.returncode == 0, f"{' '.join(cmd)}\n{run.stderr}"


def test_no_include_cycle(sources):
    state = {}  # header -> "open" while on the stack, "done" after

    def visit(name, path):
        if state.get(name) == "open":
            raise AssertionError(f"include cycle: {' -> '.join(path + [name])}")
        if state.get(name) == "done":
            return
        state[name] = "open"
        for inc in _includes(name):
            if _local(inc):
                visit(inc, path + [name])
        state[name] = "done"

    for header in HEADERS:
        visit(header, [])
    assert HEADERS and all(state[h] == "done" for h in HEADERS)  # every header walked, no cycle met


def _expansions(roots):
    """How often the text of each local header is expanded when roots are
    included in order: a header with an include guard once, one without on
    every #include (conditional includes counted as taken)."""
    counts, defined = Counter(), set()

    def expand(name):
        text = (KERNELS / name).read_text()
        guard = GUARD.match(text)
        if guard:
            if guard.group(1) in defined:
                return
            defined.add(guard.group(1))
        counts[name] += 1
        for inc in INCLUDE.findall(text):
            if _local(inc):
                expand(inc)

    for root in roots:
        expand(root)
    return counts


def _entry_headers(pyx):
    """The headers of a kernel module's translation unit, in order: those of
    its ``cdef extern from`` blocks and of the .pxi / .pxd files it includes
    or cimports from this folder."""
    text = pyx.read_text()
    for name in re.findall(r'^include\s+"([^"]+)"', text, re.M):
        text += (KERNELS / name).read_text()
    for name in re.findall(
        r"^(?:from\s+onnxkv\._kernels\.(\w+)\s+cimport|cimport\s+onnxkv\._kernels\.(\w+))", text, re.M
    ):
        pxd = KERNELS / f"{''.join(name)}.pxd"
        if pxd.is_file():
            text = pxd.read_text() + text
    return [h for h in re.findall(r'cdef\s+extern\s+from\s+"([^"]+\.h)"', text) if _local(h)]


def _c_headers(source):
    """The local headers a C source includes, in order."""
    return [h for h in _includes(source) if _local(h)]


@pytest.mark.parametrize("unit", sorted(p.name for p in KERNELS.glob("*.pyx")) + SOURCES or ["<none>"])
def test_no_header_expanded_more_than_twice(sources, unit):
    roots = _c_headers(unit) if unit.endswith(".c") else _entry_headers(KERNELS / unit)
    counts = _expansions(roots)
    too_often = {h: n for h, n in counts.items() if n > 2}
    assert not too_often, f"{unit}: headers expanded more often than allowed: {too_often}"


def test_the_checks_follow_the_includes(sources):
    # the expansion count reaches attention.pyx's headers through its extern blocks and their includes (guarded
    # headers once), and each level's C file expands the unguarded per-level template once
    counts = _expansions(_entry_headers(KERNELS / "attention.pyx"))
    assert counts["attention.h"] == counts["attention_types.h"] == counts["simd_cpu.h"] == 1
    assert counts["attention_units.h"] == 1 and "attention_unit.h" not in counts
    for level in ("scalar", "avx2", "avx512"):
        assert _expansions(_c_headers(f"attention_unit_{level}.c"))["attention_unit.h"] == 1


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("source", SOURCES or ["<none>"])
def test_c_source_compiles(sources, source, portable):
    # each level's translation unit compiles on its own, with the build's warnings, in both builds
    _syntax_check(["-I", str(KERNELS), str(KERNELS / source)], portable, ("-std=c11", "-Wall"))
