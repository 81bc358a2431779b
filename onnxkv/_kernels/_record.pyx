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


class Recorder:
    """The kernel calls noted on this thread while installed (``with rec:``).

    Attributes:
        calls: ``(kind, arrays, ints, floats)`` per noted call, in call order.
        refused: why calls that ran could not be noted (a recording with any cannot be replayed).
    """

    def __init__(self) -> None:
        self.calls = []
        self.refused = []

    def note(self, int kind, tuple arrays, tuple ints, tuple floats) -> None:
        self.calls.append((kind, arrays, ints, floats))

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
