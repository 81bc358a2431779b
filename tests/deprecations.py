"""Test helper: a deprecated spelling of onnxkv's API warns, naming the replacement, at the caller's line."""

from __future__ import annotations

import contextlib

import pytest

from onnxkv._deprecation import OnnxkvDeprecationWarning


@contextlib.contextmanager
def warns_deprecated(caller: str, match: str):
    """Expect OnnxkvDeprecationWarnings, one matching ``match``, every one attributed to the file ``caller``."""
    with pytest.warns(OnnxkvDeprecationWarning, match=match) as record:
        yield record
    ours = [w for w in record if issubclass(w.category, OnnxkvDeprecationWarning)]
    assert [w.filename for w in ours] == [caller] * len(ours), [(w.filename, str(w.message)) for w in ours]
