"""Deprecated spellings of the public API: one warning helper and one decorator.

An old spelling keeps working for one release and emits an
:class:`OnnxkvDeprecationWarning` (a :class:`DeprecationWarning`) whose
message names the API, the old spelling and the new one.  The warning points
at the line that called the public API (``stacklevel``), so a call from inside
onnxkv is attributed to onnxkv's own module: the test configuration
(``pyproject.toml``) turns those into errors (onnxkv never uses a spelling it
deprecates), while a user's call shows the user's line.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

from onnxkv.errors import InputError

__all__ = ["OnnxkvDeprecationWarning", "warn_deprecated", "renamed_argument"]


class OnnxkvDeprecationWarning(DeprecationWarning):
    """A spelling of onnxkv's API that keeps working for one release only."""


def warn_deprecated(message: str, depth: int = 1) -> None:
    """Emit ``message`` as an OnnxkvDeprecationWarning attributed to the caller of a public API.

    ``depth`` counts the onnxkv frames from the caller of this function up to
    the public API itself: 1 when the public API calls this function
    directly, 2 from a helper the public API calls, and so on.
    """
    warnings.warn(message, OnnxkvDeprecationWarning, stacklevel=depth + 2)


def renamed_argument(api: str, old: str, new: str) -> Callable:
    """Decorator: keyword ``old`` of ``api`` is the deprecated name of its first parameter ``new``.

    A call passing ``old=`` warns and runs as if it had passed ``new=``; a
    call passing both (or ``old=`` and the first argument by position)
    raises :class:`~onnxkv.errors.InputError` naming both.
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if old in kwargs:
                if args or new in kwargs:
                    raise InputError(f"{api}: {old}= is the deprecated name of {new}; pass {new} only once")
                warn_deprecated(
                    f"{api}: the keyword {old}= is deprecated; pass {new}= (or the first argument by position)"
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return wrap
