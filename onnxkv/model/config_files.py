"""The JSON config files of a model folder (``genai_config.json``, Hugging Face's ``config.json`` and
``generation_config.json``), read as untrusted input: one JSON object per file, every int key checked in
its range before it is used.  Imports only ``json`` and :mod:`onnxkv.errors`.
"""

from __future__ import annotations

import json
from pathlib import Path

from onnxkv.errors import ModelError

__all__ = ["BYTES_LIMIT", "read_object", "config_int"]

#: Largest config file read (they hold a few KB).
BYTES_LIMIT = 16 << 20


def read_object(path: Path) -> dict:
    """The JSON object in ``path`` (a regular file the caller checked against :data:`BYTES_LIMIT`);
    ModelError when it is unreadable, not JSON, or not an object."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelError(f"load: {path} is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"load: {path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def config_int(section: dict, key: str, path: Path, low: int, high: int, where: str = "") -> int | None:
    """``section[key]`` as an int in [low, high), or None when absent or null; ModelError naming the file and
    the key (``where.key`` with a ``where``) otherwise."""
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        name = f"{where}.{key}" if where else key
        raise ModelError(f"load: {path}: {name} must be an int in [{low}, {high}), got {value!r:.60}")
    return value
