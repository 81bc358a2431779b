"""Checks of the arguments the generation APIs share (generate, beam_search, speculative_generate).

Every check runs once per call, before any model runs, and raises
:class:`~onnxkv.errors.InputError` whose message starts with the API's name
(``api``) and names the argument, its value and what was expected.  Counts
are Python or NumPy ints (never bools or floats), real numbers are finite
ints or floats (never bools), token ids lie in ``[0, vocab)`` when the
vocabulary is known.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
import onnx

from onnxkv.errors import InputError

__all__ = [
    "as_session",
    "int_arg",
    "optional_int",
    "real_arg",
    "callback_arg",
    "bool_arg",
    "token_id",
    "token_ids",
    "check_prompt",
]


def as_session(api: str, name: str, value, threads: int | None):
    """``value`` itself when it is a Session, else a new Session of it (a Model, ModelProto or path)."""
    from onnxkv.model.load import Model
    from onnxkv.runtime.session import Session

    optional_int(api, "threads", threads, 1)
    if isinstance(value, Session):
        return value
    if not isinstance(value, (Model, onnx.ModelProto, str, os.PathLike)):
        raise InputError(
            f"{api}: {name} must be a Session, a Model, a ModelProto or a path, got {type(value).__name__}"
        )
    return Session(value, threads=threads)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def int_arg(api: str, name: str, value, low: int) -> int:
    """``value`` as an int ≥ ``low``."""
    if not _is_int(value) or value < low:
        raise InputError(f"{api}: {name} must be an int ≥ {low}, got {value!r}")
    return int(value)


def optional_int(api: str, name: str, value, low: int) -> int | None:
    """None, or ``value`` as an int ≥ ``low``."""
    if value is None:
        return None
    if not _is_int(value) or value < low:
        raise InputError(f"{api}: {name} must be an int ≥ {low} or None, got {value!r}")
    return int(value)


def real_arg(
    api: str, name: str, value, low: float | None = None, high: float | None = None, low_open: bool = False
) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``; None: unbounded)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    try:
        ok = ok and math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        ok = False
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        raise InputError(
            f"{api}: {name} must be a finite number in {'(' if low_open or low is None else '['}{lo}, "
            f"{hi}{')' if high is None else ']'}, got {value!r:.80}"
        )
    return float(value)


def bool_arg(api: str, name: str, value) -> bool:
    """``value`` when it is True or False (a Python or NumPy bool)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"{api}: {name} must be True or False, got {value!r}")
    return bool(value)


def callback_arg(api: str, name: str, value) -> Callable | None:
    """``value`` when it is callable or None."""
    if value is not None and not callable(value):
        raise InputError(f"{api}: {name} must be callable or None, got {type(value).__name__}")
    return value


def token_id(api: str, name: str, value, vocab: int | None) -> int:
    """``value`` as a token id: an int in ``[0, vocab)`` (``vocab`` None: ≥ 0)."""
    if not _is_int(value) or value < 0 or (vocab is not None and value >= vocab):
        raise InputError(f"{api}: {name} {value!r} is outside the vocabulary: expected an int in [0, {vocab})")
    return int(value)


def token_ids(api: str, name: str, value, default: list[int], vocab: int | None) -> list[int]:
    """``value`` as a list of token ids: None (``default``), one id, or a list or tuple of ids."""
    if value is None:
        return list(default)
    if _is_int(value):
        return [token_id(api, name, value, vocab)]
    if not isinstance(value, (list, tuple, np.ndarray)) or (isinstance(value, np.ndarray) and value.ndim != 1):
        raise InputError(f"{api}: {name} must be an int, a list of ints or None, got {value!r:.80}")
    return [token_id(api, f"{name}[{i}]", v, vocab) for i, v in enumerate(value)]


def _as_array(api: str, name: str, value) -> np.ndarray:
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as e:  # ragged nested lists
        raise InputError(f"{api}: {name} must be a rectangular array, got {type(value).__name__}: {e}") from None


def check_prompt(api: str, input_ids, attention_mask, vocab: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prompt as int64 ids [B, L], 0/1 mask [B, L] and real lengths [B].

    ``input_ids``: int [B, L] or [L], left-padded; ``attention_mask``: 0/1 of
    the same shape, or None (no padding).  Every real (unpadded) id must be
    in ``[0, vocab)``.
    """
    ids = _as_array(api, "input_ids", input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise InputError(f"{api}: input_ids must be [batch, length] with length ≥ 1, got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise InputError(f"{api}: input_ids must be integers, got dtype {ids.dtype}")
    if ids.dtype.kind == "u" and ids.size and ids.max() > np.iinfo(np.int64).max:
        raise InputError(f"{api}: input_ids must be in [0, {vocab}), got max {ids.max()}")
    ids = ids.astype(np.int64)
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask = _as_array(api, "attention_mask", attention_mask)
        if mask.ndim == 1:
            mask = mask[None, :]
        if mask.shape != ids.shape:
            raise InputError(f"{api}: attention_mask shape {mask.shape} differs from input_ids {ids.shape}")
        if mask.dtype.kind not in "iub" or not np.isin(mask, (0, 1)).all():
            raise InputError(f"{api}: attention_mask must hold only 0 and 1")
        mask = mask.astype(np.int64)
    # Left padding: once a row has a 1, it has no 0 after it.
    started = np.cumsum(mask, axis=1) > 0
    if np.any(started & (mask == 0)):
        rows = np.nonzero(np.any(started & (mask == 0), axis=1))[0].tolist()
        raise InputError(
            f"{api}: rows {rows} of attention_mask are right-padded or have holes; "
            "prompts must be left-padded (zeros first)"
        )
    lengths = mask.sum(axis=1)
    if np.any(lengths == 0):
        raise InputError(f"{api}: rows {np.nonzero(lengths == 0)[0].tolist()} have no tokens")
    real = ids[mask == 1]
    if real.size and (real.min() < 0 or (vocab is not None and real.max() >= vocab)):
        raise InputError(f"{api}: input_ids must be in [0, {vocab}), got min {real.min()}, max {real.max()}")
    return ids, mask, lengths


def check_length(api: str, session, length: int, max_new_tokens: int, whose: str = "the model's") -> None:
    """InputError unless ``length`` prompt tokens and ``max_new_tokens`` more fit the positions of
    ``session``'s model: its ``max_length`` and the rows of every table its graph indexes by position
    (:attr:`Session.position_tables <onnxkv.runtime.session.Session.position_tables>`).  ``whose`` names
    the model in the message ("the draft model's")."""
    if session.model.max_length is not None and length + max_new_tokens > session.model.max_length:
        raise InputError(
            f"{api}: prompt length {length} + max_new_tokens {max_new_tokens} exceeds {whose} "
            f"max_length {session.model.max_length}"
        )
    for table, rows in session.position_tables.items():
        if length + max_new_tokens > rows:
            raise InputError(
                f"{api}: prompt length {length} + max_new_tokens {max_new_tokens} exceeds the {rows} positions "
                f"of {whose} {table}"
            )
