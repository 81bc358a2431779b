"""The generation settings of a Hugging Face export: ``config.json`` and ``generation_config.json``.

Optimum's exports (the layout of the ``onnx-community`` and ``Xenova`` repositories) keep the model
files in an ``onnx/`` folder and the model's ``config.json`` and ``generation_config.json`` beside
that folder, or beside the file itself.  :func:`read_hf_settings` finds them for a model file that has
no ``genai_config.json`` and returns what onnxkv reads from them: ``eos_token_id`` (a list; the
generation config's over the model config's, as transformers takes them), ``bos_token_id``,
``pad_token_id``, ``vocab_size`` and ``max_length`` (``max_position_embeddings``).  The files are
untrusted input: each is read only if it is a regular file of at most 16 MiB holding a JSON object,
and every key read must be an int in its range, else :class:`~onnxkv.errors.ModelError` names the file,
the key and the value.  A token id at or past ``vocab_size`` is left out with a ``RuntimeWarning``
naming it: the model never makes such an id (the tiny random-weight models of test repositories keep
their family's default ids, 50256 in a vocabulary of 512).
"""

from __future__ import annotations

import stat
import warnings
from pathlib import Path

from onnxkv.errors import ModelError
from onnxkv.model.config_files import BYTES_LIMIT, config_int, read_object

__all__ = ["read_hf_settings"]

#: Largest vocabulary size or context length taken.
_INT_LIMIT = 1 << 31
_TOKENS = ("eos_token_id", "bos_token_id", "pad_token_id")


def _read(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when there is no such file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ModelError(f"load: cannot stat {path}: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"load: {path} is not a regular file")
    if st.st_size > BYTES_LIMIT:
        raise ModelError(f"load: {path} is larger than {BYTES_LIMIT} bytes")
    return read_object(path)


def _tokens(cfg: dict, key: str, path: Path, vocab: int) -> list[int] | None:
    """``cfg[key]`` as a list of token ids (None when absent or null).  An id at or past ``vocab`` is left
    out with a warning: the model never makes it (tiny test configs keep their family's default ids)."""
    value = cfg.get(key)
    if value is None:
        return None
    items = [config_int({key: v}, key, path, 0, _INT_LIMIT) for v in (value if isinstance(value, list) else [value])]
    kept = [t for t in items if t < vocab]
    if len(kept) < len(items):
        warnings.warn(
            f"load: {path}: {key} {[t for t in items if t >= vocab]} lies outside the vocabulary [0, {vocab}): ignored",
            RuntimeWarning,
            stacklevel=4,
        )
    return kept


def _token(cfg: dict, key: str, path: Path, vocab: int) -> int | None:
    """``cfg[key]`` as one token id (None when absent, null, or outside the vocabulary: see :func:`_tokens`)."""
    if isinstance(cfg.get(key), list):
        raise ModelError(f"load: {path}: {key} must be an int in [0, {vocab}), got {cfg[key]!r:.60}")
    ids = _tokens(cfg, key, path, vocab)
    return ids[0] if ids else None


def read_hf_settings(model_file: Path) -> dict | None:
    """The generation settings of the Hugging Face configs next to ``model_file`` (its folder, else the
    folder above it), or None when neither folder has a ``config.json``.  Keys: ``eos_token_id`` (list),
    ``bos_token_id``, ``pad_token_id``, ``vocab_size``, ``max_length`` (each None when unknown), and
    ``path`` (the config.json read).

    Raises:
        ModelError: a config file that is not a regular file, too large, not a JSON object, or a key
            read from it of another type or out of range (naming the file, key and value).
    """
    for folder in (model_file.parent, model_file.parent.parent):
        config = _read(folder / "config.json")
        if config is not None:
            break
    else:
        return None
    path = folder / "config.json"
    vocab = config_int(config, "vocab_size", path, 1, _INT_LIMIT)
    top = vocab if vocab is not None else _INT_LIMIT
    out = {
        "path": path,
        "vocab_size": vocab,
        "max_length": config_int(config, "max_position_embeddings", path, 1, _INT_LIMIT),
        "eos_token_id": _tokens(config, "eos_token_id", path, top),
        "bos_token_id": _token(config, "bos_token_id", path, top),
        "pad_token_id": _token(config, "pad_token_id", path, top),
    }
    gen_path = folder / "generation_config.json"
    generation = _read(gen_path)
    if generation is not None:
        eos = _tokens(generation, "eos_token_id", gen_path, top)
        if eos:
            out["eos_token_id"] = eos
        for key in ("bos_token_id", "pad_token_id"):
            value = _token(generation, key, gen_path, top)
            if value is not None:
                out[key] = value
    out["eos_token_id"] = out["eos_token_id"] or []
    return out
