"""Recording of kernel calls, for compiled steps (:mod:`onnxkv._kernels.step`).

While a :class:`Recorder` is installed on a thread (``with recorder:``), the
kernels that a compiled step can replay note each call they run on that thread
-- after their checks passed and the kernel ran -- as ``(kind, arrays, ints,
floats)``: the kind (a ``step.KIND_*`` code), the arrays whose memory the call
read or wrote (kept alive by the recorder), and its scalar parameters.  Kernels
of other kinds note nothing; a caller that records must therefore only record
code whose every write goes through noting kernels (the plan's compilable
operators).  Installing a recorder is per thread: kernel calls of other threads
are never noted.

Operators that run a kernel whose call depends on per-run state outside the
step's values (a cache's committed length) note the call themselves
(:func:`current`), name the cache buffers the call writes (:meth:`Recorder.cache`:
the replay takes them from the run's caches) and register an *effect*
(:meth:`Recorder.effect`): an object whose ``before(rt)`` prepares a replay
and ``after(rt)`` stages what the recorded call did, as the operator would
have (see :mod:`onnxkv.plan.compiled_step`).
"""
from cpython.ref cimport PyObject, Py_XINCREF, Py_XDECREF

cdef extern from *:
    """
    static _Thread_local PyObject *okv_rec_current = NULL;
    """
    PyObject *okv_rec_current


cdef object recorder():
    """The calling thread's installed Recorder, or None (cheap: one thread-local read)."""
    if okv_rec_current == NULL:
        return None
    return <object>okv_rec_current


cdef void refuse(str reason):
    """Tell the calling thread's recorder, if any, that a kernel call ran that cannot be replayed."""
    rec = recorder()
    if rec is not None:
        rec.refused.append(reason)


#: The kind codes of the calls operators note themselves (see the .pxd).
DECODE_TOKEN = KIND_DECODE_TOKEN
MASK_LENGTHS = KIND_MASK_LENGTHS
DECODE_PAGED = KIND_DECODE_PAGED
CACHE_ROWS = KIND_CACHE_ROWS
MASKED_DECODE = KIND_MASKED_DECODE
CONVERT = KIND_CONVERT
SCATTER_ROWS = KIND_SCATTER_ROWS
NONPAD_DECODE = KIND_NONPAD_DECODE
PAGE_ROWS = KIND_PAGE_ROWS
MASKED_PAGED = KIND_MASKED_PAGED
#: A DECODE_TOKEN call's cache type code by element type (attention_types.h's OKV_KV_*).
DECODE_CACHE_TYPES = {"float32": 0, "float16": 1, "bfloat16": 2}


def current():
    """The calling thread's installed :class:`Recorder`, or None."""
    return recorder()


class Recorder:
    """The kernel calls noted on this thread while installed (``with rec:``).

    Attributes:
        calls: ``(kind, arrays, ints, floats)`` per noted call, in call order.
        refused: why calls that ran could not be noted (a recording with any cannot be replayed).
        caches: cache name (or (name, attribute)) -> the array of that cache a noted call used (:meth:`cache`).
        effects: the effects of noted calls, in call order (:meth:`effect`).
        ragged: the arrays a noted call reads whole with a last dim that may differ from run to run
            (:meth:`ragged_last`).
        transient: a call could not be noted for values of this run that later runs of the same shapes
            need not share (a prompt's attention, where a verification of as many tokens takes the fused
            decode call): a step recorded from it is used for this run only.
        pack_views: set by the recording caller: the node may return a packed copy of a strided view
            (``Slice``) because its readers compute the same values from either layout.
    """

    def __init__(self) -> None:
        self.calls = []
        self.refused = []
        self.caches = {}
        self.effects = []
        self.ragged = []
        self.transient = False
        self.pack_views = False

    def note(self, int kind, tuple arrays, tuple ints, tuple floats) -> None:
        self.calls.append((kind, arrays, ints, floats))

    def cache(self, name, buffer) -> None:
        """A noted call used ``buffer``: the whole buffer of the run's cache ``name`` (a str), or the table
        ``attribute`` of the cache ``name`` for a key ``(name, attribute)`` (replays take what that cache has
        then)."""
        self.caches[name] = buffer

    def ragged_last(self, array) -> None:
        """The call just noted reads ``array`` whole and takes its last dim from it when replayed (a kind that
        says so in ``_record.pxd``): a replay accepts any length there."""
        self.ragged.append(array)

    def effect(self, effect) -> None:
        """Register the effect of the call just noted (``before(rt)`` / ``after(rt)``)."""
        self.effects.append(effect)

    def __enter__(self):
        global okv_rec_current
        if okv_rec_current != NULL:
            raise RuntimeError("Recorder: a recorder is already installed on this thread")
        Py_XINCREF(<PyObject *>self)
        okv_rec_current = <PyObject *>self
        return self

    def __exit__(self, *exc) -> None:
        global okv_rec_current
        cdef PyObject *cur = okv_rec_current
        okv_rec_current = NULL
        Py_XDECREF(cur)
