"""onnxkv._deprecation: the warning's category and attribution, and renamed_argument."""

from __future__ import annotations

import warnings

import pytest
from deprecations import warns_deprecated

from onnxkv import InputError
from onnxkv._deprecation import OnnxkvDeprecationWarning, renamed_argument, warn_deprecated


@renamed_argument("f", "old", "new")
def f(new, other=0):
    return new, other


def _api():
    warn_deprecated("_api: the old spelling is deprecated")


def _helper():
    warn_deprecated("_helper: deprecated", depth=2)


def _api_with_helper():
    _helper()


def test_the_warning_is_a_deprecation_warning_at_the_callers_line():
    assert issubclass(OnnxkvDeprecationWarning, DeprecationWarning)
    with warns_deprecated(__file__, "_api: the old spelling is deprecated") as record:
        _api()
    assert record[0].lineno == test_the_warning_is_a_deprecation_warning_at_the_callers_line.__code__.co_firstlineno + 3
    with warns_deprecated(__file__, "_helper: deprecated") as record:
        _api_with_helper()
    assert record[0].lineno == test_the_warning_is_a_deprecation_warning_at_the_callers_line.__code__.co_firstlineno + 6


def test_renamed_argument_forwards_the_old_keyword_with_a_warning():
    with warns_deprecated(__file__, r"f: the keyword old= is deprecated; pass new="):
        assert f(old=1, other=2) == (1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OnnxkvDeprecationWarning)
        assert f(1) == f(new=1) == (1, 0)
    for call in (lambda: f(1, old=2), lambda: f(new=1, old=2)):
        with pytest.raises(InputError, match=r"^f: old= is the deprecated name of new; pass new only once"):
            call()
    assert f.__name__ == "f" and f.__wrapped__(3) == (3, 0)


def test_onnxkv_models_is_the_deprecated_name_of_onnxkv_zoo(monkeypatch):
    import sys

    import onnxkv.zoo
    import onnxkv.zoo.gqa

    for name in [n for n in sys.modules if n == "onnxkv.models" or n.startswith("onnxkv.models.")]:
        monkeypatch.delitem(sys.modules, name)
    with warns_deprecated(__file__, r"onnxkv.models is deprecated; import onnxkv.zoo"):
        import onnxkv.models  # noqa: F401
    from onnxkv.models.gqa import build_gqa_model  # the submodules under their old names, without a second warning

    assert build_gqa_model is onnxkv.zoo.gqa.build_gqa_model
    assert sys.modules["onnxkv.models"].embedded is onnxkv.zoo.embedded
