"""Deprecated name of :mod:`onnxkv.zoo` (the small model builders and the embedded model).

``import onnxkv.models`` and ``from onnxkv.models.<module> import ...`` keep
working for one release: they emit an :class:`~onnxkv.OnnxkvDeprecationWarning`
and give the same module objects as ``onnxkv.zoo`` (the name ``models`` sat
beside :mod:`onnxkv.model`, the loader, and the two were easy to confuse).
"""

import importlib
import pkgutil
import sys

from onnxkv import zoo
from onnxkv._deprecation import warn_deprecated

warn_deprecated("onnxkv.models is deprecated; import onnxkv.zoo (the same modules)")

# Every submodule of onnxkv.zoo under its old name too, so that `import onnxkv.models.gqa` finds it.
for _info in pkgutil.iter_modules(zoo.__path__):
    _module = importlib.import_module(f"onnxkv.zoo.{_info.name}")
    sys.modules[f"{__name__}.{_info.name}"] = _module
    globals()[_info.name] = _module
del _info, _module
