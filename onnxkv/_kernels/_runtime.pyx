"""Kernel settings: the thread count, instruction set and tuning of every kernel call.

Each Python thread has its own current settings (a C thread-local
``okv_settings``, simd.h).  A thread starts with the process defaults -- the
thread count of ``_cpus.default_threads()`` (``OMP_NUM_THREADS``, else the
CPUs this process may run on within its cgroup's CPU quota), the best
instruction set the build, CPU and OS allow (capped by ``ONNXKV_MAX_SIMD``,
below), AMX where available -- and its settings change only through
that thread: :func:`use_settings` (a context manager that restores them on
exit), or the per-switch setters (:func:`set_num_threads`,
:func:`set_simd_enabled`, the attention and matmul modules' test switches),
which act on the calling thread only as well.

Every kernel's Python wrapper copies the calling thread's settings once
(``okv_settings_get``, declared in ``_runtime.pxd``; about a nanosecond) and
passes the copy down to its C code and OpenMP loops: no kernel reads a global
setting and OpenMP workers never read thread-local state, so two sessions
running in two Python threads with different settings never see each other's.

``ONNXKV_MAX_SIMD`` (read once, at import): ``scalar``, ``avx2`` or
``avx512``, the widest level the kernels may use in this process -- levels
above it are treated as if the CPU lacked them (:func:`simd_levels` stops
there, and no setting or switch can select them).  It lets one machine run
everything as a narrower one would (the tests run the kernels at each level
of the machine this way); unset or empty, every level the build, CPU and OS
allow.
"""
from libc.stdint cimport int64_t, uint64_t
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

import operator
import os

from ._cpus import MAX_THREADS, default_threads

cdef extern from "simd.h" nogil:
    int okv_openmp_enabled()
    int okv_omp_num_procs()
    int okv_simd_compiled()
    int okv_cpu_simd_ok()
    int okv_cpu_avx512_ok()
    int okv_cpu_amx_ok()
    int okv_cpu_bf16_ok()
    void okv_cpu_flags(int *flags)
    int OKV_HAVE_VNNI
    int OKV_HAVE_AMX
    int OKV_HAVE_BF16

cdef extern from *:
    """
    /* The calling thread's settings: cur (valid once init is set), and for the
       tests the settings the thread's last kernel call took and its count. */
    typedef struct { int init; long long calls; okv_settings cur, seen; } okv_thread_settings;
    static _Thread_local okv_thread_settings okv_tls;
    """
    ctypedef struct okv_thread_settings:
        int init
        long long calls
        okv_settings cur
        okv_settings seen
    okv_thread_settings okv_tls


_LEVELS = ("scalar", "avx2", "avx512")


def _max_level(environ) -> int:
    """Index in _LEVELS of the widest level ``ONNXKV_MAX_SIMD`` in ``environ`` allows (all when unset or empty)."""
    value = environ.get("ONNXKV_MAX_SIMD", "")
    if value == "":
        return len(_LEVELS) - 1
    if value not in _LEVELS:
        raise ValueError(f"ONNXKV_MAX_SIMD: must be 'scalar', 'avx2' or 'avx512' (the widest instruction-set level "
                         f"the kernels may use) or empty, got {value!r}")
    return _LEVELS.index(value)

_KEEP = object()   # KernelSettings.replace: a field not given
# Fields of okv_settings below the public three (threads, simd level, amx): tuning switches of the
# attention and matmul modules, in the order of the struct.
_TUNING = ("prefetch", "pf_qk_lines", "prefill_rg", "split_tasks", "paged_heads", "adaptive", "vnni", "flash")

cdef int _max = _max_level(os.environ)
# What this process may run: the build (okv_simd_compiled; the CPU checks answer 0 for a set it left
# out), the CPU and OS, and ONNXKV_MAX_SIMD.  AMX runs inside the AVX-512 tiles only.
cdef int _cpu_ok = _max >= 1 and okv_simd_compiled() and okv_cpu_simd_ok()
cdef int _avx512_ok = _cpu_ok and _max >= 2 and okv_cpu_avx512_ok()
cdef int _amx_ok = _avx512_ok and okv_cpu_amx_ok()
# bfloat16 products (prefill_precision="bf16") need AVX-512-BF16 at the AVX-512 level; AMX-BF16 is not used.
cdef int _bf16_ok = _avx512_ok and okv_cpu_bf16_ok()
_PRECISIONS = ("float32", "bf16")
# The process defaults: set here, at import, and never changed (a thread's settings start as a copy).
cdef okv_settings _defaults = okv_settings(
    threads=default_threads(), simd=_cpu_ok, avx512=_avx512_ok, amx=_amx_ok, prefetch=2,
    pf_qk_lines=48, prefill_rg=4, split_tasks=0, paged_heads=0, adaptive=1, vnni=1, flash=1, bf16=0)


cdef inline okv_thread_settings *_thread() noexcept nogil:
    cdef okv_thread_settings *t = &okv_tls
    if not t.init:
        t.cur = _defaults
        t.init = 1
    return t


cdef okv_settings okv_settings_get() noexcept nogil:
    """A copy of the calling thread's settings, for one kernel call (recorded for ``_settings_seen``)."""
    cdef okv_thread_settings *t = _thread()
    t.seen = t.cur
    t.calls += 1
    return t.cur


cdef okv_settings *okv_settings_mine() noexcept nogil:
    """The calling thread's settings themselves, for the setters and getters (never for a kernel)."""
    return &_thread().cur


cdef int okv_avx512_usable() noexcept nogil:
    """1 when this process may run the AVX-512 level (build, CPU and OS, ONNXKV_MAX_SIMD)."""
    return _avx512_ok


cdef int okv_amx_usable() noexcept nogil:
    """1 when this process may run the AMX tiles (inside the AVX-512 level)."""
    return _amx_ok


cdef int okv_bf16_usable() noexcept nogil:
    """1 when this process may run the AVX-512-BF16 products (prefill_precision="bf16")."""
    return _bf16_ok


def simd_levels() -> tuple:
    """The instruction-set levels the kernels can run in this process, lowest
    first: ``"scalar"``, then ``"avx2"`` (AVX2+FMA+F16C), then ``"avx512"``
    (AVX-512 F/BW/VL/DQ tiles of attention and matmul_packed) -- those the
    build has (``-Dsimd=disabled``: scalar only), the CPU and OS run and
    ``ONNXKV_MAX_SIMD`` allows."""
    return _LEVELS[:1 + bool(_cpu_ok) + bool(_avx512_ok)]


cdef int _checked_threads(threads) except -1:
    if threads is None:
        return _defaults.threads
    try:
        n = operator.index(threads)
    except TypeError:
        n = None
    if n is None or isinstance(threads, bool) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"KernelSettings: threads must be an int in [1, {MAX_THREADS}] or None, got {threads!r}")
    return n


def _why_not(level: str) -> str:
    """Why the level ``level`` (one of _LEVELS, not in simd_levels()) cannot run in this process."""
    if not okv_simd_compiled():
        return ("this build has the scalar path only (built with -Dsimd=disabled, or by a compiler or for a "
                "target without the x86 SIMD paths)")
    cpu = {"avx2": okv_cpu_simd_ok(), "avx512": okv_cpu_simd_ok() and okv_cpu_avx512_ok()}.get(level, 1)
    if not cpu:  # the CPU first: lifting the cap would not make it runnable
        return "this CPU and OS cannot run it"
    return f"ONNXKV_MAX_SIMD={_LEVELS[_max]!r} caps the levels of this process"


cdef int _set_level(okv_settings *s, simd) except -1:
    """The SIMD fields of ``s`` for the level name ``simd`` ("auto" or one of _LEVELS)."""
    levels = simd_levels()
    if not isinstance(simd, str) or (simd != "auto" and simd not in _LEVELS):
        raise ValueError(f"KernelSettings: simd must be 'auto', 'avx512', 'avx2' or 'scalar', got {simd!r}")
    if simd not in levels and simd != "auto":
        raise ValueError(f"KernelSettings: simd={simd!r} is not available: {_why_not(simd)} (levels available: "
                         f"{', '.join(map(repr, levels))}; 'auto' takes the best)")
    level = levels[len(levels) - 1] if simd == "auto" else simd
    s.simd = level != "scalar"
    s.avx512 = level == "avx512"
    return 0


cdef int _set_amx(okv_settings *s, amx) except -1:
    if not isinstance(amx, bool):
        raise ValueError(f"KernelSettings: amx must be True or False, got {amx!r}")
    s.amx = _amx_ok if amx else 0
    return 0


cdef int _set_precision(okv_settings *s, precision) except -1:
    if not isinstance(precision, str) or precision not in _PRECISIONS:
        raise ValueError(f"KernelSettings: prefill_precision must be 'float32' or 'bf16', got {precision!r}")
    if precision == "bf16" and not _bf16_ok:
        why = ("this build has no AVX-512-BF16 kernels" if not OKV_HAVE_BF16 else
               "the AVX-512 level cannot run here" if not _avx512_ok else "this CPU has no AVX-512-BF16")
        raise ValueError(f"KernelSettings: prefill_precision='bf16' is not available: {why} (it needs the "
                         "AVX-512-BF16 dot products; 'float32' runs everywhere)")
    s.bf16 = precision == "bf16"
    return 0


def bf16_available() -> bool:
    """True when ``prefill_precision="bf16"`` can be set in this process (AVX-512-BF16 at the AVX-512 level)."""
    return bool(_bf16_ok)


cdef tuple _fields(const okv_settings *s):
    return (s.threads, s.simd, s.avx512, s.amx, s.bf16, s.prefetch, s.pf_qk_lines, s.prefill_rg,
            s.split_tasks, s.paged_heads, s.adaptive, s.vnni, s.flash)


cdef class KernelSettings:
    """Immutable kernel settings: the value :func:`use_settings` installs for the
    calling thread and :func:`current_settings` returns.

    threads: OpenMP threads of every kernel, an int in [1, MAX_THREADS], or None
        for the process default (``OMP_NUM_THREADS``, else the CPUs this
        process may run on within its cgroup's CPU quota: ``_cpus``).
    simd: the instruction-set level: "auto" (the best of :func:`simd_levels`),
        "avx512", "avx2" or "scalar"; a level this process cannot run (the
        build, CPU and OS, ``ONNXKV_MAX_SIMD``) is rejected, naming why.  The ``simd`` attribute names the level chosen.
    amx: let paged_attention score quantized keys on the AMX-INT8 tiles inside
        its AVX-512 tiles where the CPU and OS allow it (the ``amx`` attribute
        is False where they do not).
    prefill_precision: "float32", or "bf16": ``matmul_packed`` products of at
        least ``BF16_MIN_ROWS`` rows and the tiled prefill attention of calls of
        at least as many query tokens (prompt chunks; decode steps and
        speculative verifications have fewer) round their operands to bfloat16
        (nearest even, subnormals to zero) and accumulate in float32
        (AVX-512-BF16 dot products; the portable twin at a lower ``simd``
        level).  Refused, naming why, where the CPU has no
        AVX-512-BF16 (:func:`bf16_available`).

    Every value is checked: a bad one raises ValueError naming the field.  The
    settings also carry the private tuning switches of the attention and
    matmul modules (process defaults in a new value; a value from
    :func:`current_settings` keeps the thread's).  Results may differ in
    float32 rounding between levels, with AMX, and between thread counts
    (attention's cache split); with equal settings they are bit for bit equal.
    """
    cdef okv_settings s

    def __init__(self, threads=None, simd="auto", amx=True, prefill_precision="float32"):
        self.s = _defaults
        self.s.threads = _checked_threads(threads)
        _set_level(&self.s, simd)
        _set_amx(&self.s, amx)
        _set_precision(&self.s, prefill_precision)

    @property
    def threads(self) -> int:
        return self.s.threads

    @property
    def simd(self) -> str:
        if not self.s.simd:
            return "scalar"
        return "avx512" if self.s.avx512 else "avx2"

    @property
    def amx(self) -> bool:
        return bool(self.s.amx)

    @property
    def prefill_precision(self) -> str:
        return "bf16" if self.s.bf16 else "float32"

    def replace(self, *, threads=_KEEP, simd=_KEEP, amx=_KEEP, prefill_precision=_KEEP) -> KernelSettings:
        """A copy with the given fields changed (checked as in the constructor)."""
        cdef KernelSettings r = KernelSettings.__new__(KernelSettings)
        r.s = self.s
        if threads is not _KEEP:
            r.s.threads = _checked_threads(threads)
        if simd is not _KEEP:
            _set_level(&r.s, simd)
        if amx is not _KEEP:
            _set_amx(&r.s, amx)
        if prefill_precision is not _KEEP:
            _set_precision(&r.s, prefill_precision)
        return r

    def __eq__(self, other):
        if not isinstance(other, KernelSettings):
            return NotImplemented
        return _fields(&self.s) == _fields(&(<KernelSettings>other).s)

    def __hash__(self):
        return hash(_fields(&self.s))

    def __repr__(self):
        tuning = [f"_{name}={v}" for name, v, d in zip(_TUNING, _fields(&self.s)[5:], _fields(&_defaults)[5:])
                  if v != d]
        return (f"KernelSettings(threads={self.s.threads}, simd={self.simd!r}, amx={self.amx}"
                + (", prefill_precision='bf16'" if self.s.bf16 else "")
                + "".join(", " + t for t in tuning) + ")")


cdef KernelSettings _wrap(const okv_settings *s):
    cdef KernelSettings r = KernelSettings.__new__(KernelSettings)
    r.s = s[0]
    return r


def current_settings() -> KernelSettings:
    """The calling thread's kernel settings (the process defaults in a thread
    that never changed them)."""
    return _wrap(okv_settings_mine())


cdef class _SettingsScope:
    """The context manager of :func:`use_settings`."""
    cdef okv_settings new, old
    cdef object settings
    cdef bint active

    def __enter__(self):
        if self.active:
            raise RuntimeError("use_settings: this context manager is already active (call use_settings again "
                               "to nest)")
        cdef okv_settings *mine = okv_settings_mine()
        self.old = mine[0]
        mine[0] = self.new
        self.active = True
        return self.settings

    def __exit__(self, *exc):
        okv_settings_mine()[0] = self.old
        self.active = False
        return False


def use_settings(settings):
    """Context manager: the calling thread's kernels run with ``settings``
    inside the ``with`` block; on exit the thread gets back the settings it
    had on entry (whatever was set inside).  Blocks nest.  Other threads are
    not affected.  Yields ``settings``."""
    if not isinstance(settings, KernelSettings):
        raise ValueError(f"use_settings: settings must be a KernelSettings, got {type(settings).__name__}")
    cdef _SettingsScope scope = _SettingsScope.__new__(_SettingsScope)
    scope.new = (<KernelSettings>settings).s
    scope.settings = settings
    return scope


def _settings_seen():
    """Test hook: (the settings the calling thread's last kernel call took, or
    None before its first, and the number of kernel calls the thread made)."""
    cdef okv_thread_settings *t = _thread()
    return (_wrap(&t.seen) if t.calls else None), int(t.calls)


def set_num_threads(n):
    """Set the number of OpenMP threads the calling thread's kernels use
    (``1 <= n <= MAX_THREADS``; other threads keep theirs, see
    :func:`use_settings`).  Without OpenMP the value is stored but kernels run
    on one thread."""
    n = int(n)
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"n: number of threads must be in [1, {MAX_THREADS}], got {n}")
    okv_settings_mine().threads = n


def get_num_threads():
    """Number of threads the calling thread's kernels use (default:
    ``OMP_NUM_THREADS``, else the CPUs available to the process; ``_cpus``)."""
    return okv_settings_mine().threads


def openmp_enabled():
    """True when the kernels were compiled with OpenMP."""
    return bool(okv_openmp_enabled())


def set_simd_enabled(flag):
    """Enable (default) or disable the SIMD paths of the calling thread's
    kernels (other threads keep theirs).  Disabling forces the portable scalar
    path (used by the tests); enabling has no effect on a CPU without
    AVX2+FMA+F16C."""
    okv_settings_mine().simd = _cpu_ok if flag else 0


def simd_path():
    """``"avx2+fma+f16c"`` when the calling thread's kernels run the AVX2 path, else ``"scalar"``."""
    return "avx2+fma+f16c" if okv_settings_mine().simd else "scalar"


def cpu_features():
    """CPU features as detected at run time (all False in a build without the
    x86 SIMD paths, which does not ask the CPU) plus build facts: ``simd_compiled``
    (the x86 SIMD paths were built: not ``-Dsimd=disabled``), ``vnni_compiled``
    and ``amx_compiled`` (the compiler could build those sets), ``openmp``;
    ``simd_usable``: the AVX2 level may run (build, CPU, ``ONNXKV_MAX_SIMD``)."""
    cdef int f[7]
    okv_cpu_flags(f)
    return {
        "avx": bool(f[0]), "avx2": bool(f[1]), "fma": bool(f[2]), "f16c": bool(f[3]),
        "avx512f": bool(f[4]), "sse4_2": bool(f[5]), "popcnt": bool(f[6]),
        "simd_compiled": bool(okv_simd_compiled()),
        "vnni_compiled": bool(OKV_HAVE_VNNI), "amx_compiled": bool(OKV_HAVE_AMX),
        "bf16_compiled": bool(OKV_HAVE_BF16), "bf16_usable": bool(_bf16_ok),
        "simd_usable": bool(_cpu_ok),
        "openmp": bool(okv_openmp_enabled()),
        "omp_num_procs": int(okv_omp_num_procs()),
    }


# -- the late-team heuristic of the decode-sized products (matmul_packed, matmul_nbits) -----------------

DEF SOLO_NS = 20000000       # products run on the calling thread alone for 20 ms the first time the team was late
DEF SOLO_MAX_NS = 2000000000  # ... doubling each time the team is late again, up to 2 s
DEF ON_TIME_RESET = 4096     # team products on time in a row that bring the solo span back to SOLO_NS
DEF LATE_MIN_NS = 300000     # a wait for the team (ns) counts as late above this and above the caller's own share
DEF LATE_RUN = 2             # late products in a row that start a solo span (one alone is a wake-up hiccup)
DEF WINDOW_NS = 20000000     # the calling thread's wait for a core is read once per 20 ms of team products
DEF OFF_SHARE = 4            # runnable but waiting for a core over 1 / OFF_SHARE of a window: a solo span starts

cdef extern from "run_delay.h" nogil:
    long long okv_thread_run_delay()
    uint64_t okv_thread_id()

# Process-wide state (changed with the GIL held; results never depend on it).  Whether it is used is a
# setting of the calling thread (okv_settings.adaptive).
cdef int _solo_left = 0      # products still to run alone whatever the time (set by tests and benchmarks)
cdef int64_t _solo_until = 0   # team products before this time (okv_now_ns) run alone; 0: none
cdef int64_t _solo_span = SOLO_NS   # length of the next solo span (ns)
cdef int _late_run = 0       # late products in a row
cdef int _on_time = 0        # team products on time in a row
cdef int _retrying = 0       # the team runs again after a solo span: its first product decides alone
cdef int64_t _win_wall = 0   # the window's start (okv_now_ns) and the caller's run-queue delay then
cdef long long _win_delay = -1
cdef uint64_t _win_thread = 0  # the thread whose delay _win_delay is (another thread's is not comparable)


cdef int64_t okv_now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef int okv_team_threads(okv_settings s, int nt) noexcept nogil:
    """The team size of the next product that would use nt threads.  On cores
    shared with other processes a team member is often off its core, and every
    parallel region then waits for it, up to a scheduler time slice or more (a
    decode step runs dozens of products): after LATE_RUN products in a row
    whose caller waited for its team longer than its own share took (and
    LATE_MIN_NS), products run on the calling thread alone for a solo span,
    then the team is tried again, and if that first team product is late too
    the next span starts at once (a retry costs one stall, not LATE_RUN).  The
    span is a time, not a count of products (a tiny model runs thousands of
    products where a large one runs dozens in the same time, and a stall costs
    both the same): SOLO_NS at first, doubling up to SOLO_MAX_NS each time the
    team is late again before ON_TIME_RESET of its products in a row were on
    time.  Under a steady load on the other cores retries become rare; on free
    cores no product is late, so the team always runs.

    A team that waits for nobody can still cost the calling thread its core:
    the members spinning between products, the calling thread and another
    process are more runnable threads than cores, and the scheduler takes the
    calling thread off its core for whole time slices.  So once per window of
    WINDOW_NS of team products the calling thread's run-queue delay is read
    (/proc/thread-self/schedstat, Linux): runnable but waiting for a core for
    more than a quarter of the window, the next products start a solo span as
    a late team does.  Callers hold the GIL (it guards the state)."""
    global _solo_left, _solo_until, _retrying
    cdef int64_t now
    if nt > 1 and s.adaptive:
        if _solo_left > 0:
            _solo_left -= 1
            return 1
        now = okv_now_ns()
        if _solo_until != 0:
            if now < _solo_until:
                return 1
            _solo_until = 0
            _retrying = 1
        if _preempted(now):
            _solo_start(now)
            return 1
    return nt


cdef int _preempted(int64_t now) noexcept nogil:
    """Whether the calling thread waited for a core (runnable, not running) for over 1 / OFF_SHARE of the
    window of WINDOW_NS or more that ends now (then a new one starts); 0 while the window runs, or where
    the OS cannot say.  Time the caller sleeps or blocks is no such wait."""
    if now - _win_wall < WINDOW_NS:
        return 0
    return _window_ends(now, okv_thread_run_delay(), okv_thread_id())


cdef int _window_ends(int64_t now, long long delay, uint64_t thread) noexcept nogil:
    """The window ends at ``now`` with the run-queue delay ``delay`` (-1: unknown) of thread ``thread``:
    whether the delay grew by over 1 / OFF_SHARE of it (a window another thread started is not judged);
    a new window starts."""
    global _win_wall, _win_delay, _win_thread
    cdef int hit = (delay >= 0 and _win_delay >= 0 and thread == _win_thread
                    and OFF_SHARE * (delay - _win_delay) > now - _win_wall)
    _win_wall, _win_delay, _win_thread = now, delay, thread
    return hit


cdef void _solo_start(int64_t now) noexcept nogil:
    """Products run alone from now for the solo span, which doubles for the next time (up to SOLO_MAX_NS)."""
    global _solo_until, _solo_span, _late_run, _on_time
    _solo_until = now + _solo_span
    _solo_span = min(2 * _solo_span, SOLO_MAX_NS)
    _late_run = 0
    _on_time = 0


cdef void okv_team_finished(okv_settings s, int64_t t0, int64_t caller_done) noexcept nogil:
    """A product of a team ended: it started at t0 and the calling thread finished its share at
    caller_done (okv_now_ns); informs okv_team_threads.  With the GIL held."""
    global _solo_until, _late_run, _solo_span, _on_time, _retrying
    cdef int64_t now = okv_now_ns()
    cdef int64_t wait = now - caller_done
    if s.adaptive and wait > LATE_MIN_NS and wait > caller_done - t0:
        _on_time = 0
        _late_run += 1
        if _late_run >= LATE_RUN or _retrying:
            _solo_start(now)
    else:
        _late_run = 0
        _on_time += 1
        if _on_time >= ON_TIME_RESET:
            _solo_span = SOLO_NS
            _on_time = 0
    _retrying = 0


cdef int okv_team_solo(int solo) noexcept:
    """Sets the products still to run alone (and ends a solo span and the run-queue window); returns the
    previous count (for tests and benchmarks)."""
    global _solo_left, _solo_until, _win_wall, _win_delay
    cdef int old = _solo_left
    _solo_left = solo
    _solo_until = 0
    _win_wall, _win_delay = 0, -1
    return old


def _team_report(bint late, int times=1):
    """Test hook: report ``times`` team products to the late-team heuristic as late (the caller waited 1 ms
    after a 1 ns share) or on time, under the calling thread's settings, each after asking for a team of
    two (okv_team_threads: a product inside a solo span runs alone and reports nothing); returns the
    nanoseconds of the current solo span still to run (0: none)."""
    cdef int64_t now
    cdef okv_settings s = okv_settings_get()
    for _ in range(times):
        if okv_team_threads(s, 2) == 1:
            continue
        now = okv_now_ns()
        if late:
            okv_team_finished(s, now - 1000001, now - 1000000)
        else:
            okv_team_finished(s, now - 1000000000, now)
    return max(0, _solo_until - okv_now_ns()) if _solo_until else 0


def _team_state():
    """Test hook: the heuristic's state: products left to run alone, ns of the solo span still to run, the
    next span's ns, late products in a row, on-time products in a row, whether a retry is pending."""
    return {"solo_left": _solo_left, "solo_ns_left": max(0, _solo_until - okv_now_ns()) if _solo_until else 0,
            "next_span_ns": _solo_span, "late_run": _late_run, "on_time": _on_time, "retrying": bool(_retrying)}


def _team_window(int64_t now, long long delay, uint64_t thread=1):
    """Test hook: end the run-queue window at ``now`` (ns) with the delay ``delay`` (ns, -1: unknown) of
    thread ``thread`` if WINDOW_NS have passed since it started, as a team product asking for its team then
    would; returns whether that starts a solo span (the caller was kept off its core over a quarter of it)."""
    if now - _win_wall < WINDOW_NS:
        return False
    if _window_ends(now, delay, thread):
        _solo_start(now)
        return True
    return False


def _run_delay():
    """Test hook: the calling thread's run-queue delay in ns (-1 where the OS cannot say)."""
    return okv_thread_run_delay()


def _team_expire():
    """Test hook: end the current solo span now, as if its time had run out (the next team product retries)."""
    global _solo_until
    if _solo_until:
        _solo_until = 1
