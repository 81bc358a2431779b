"""The embedded default model: a tiny byte-level Llama decoder shipped with onnxkv.

Contract
--------
* The model files live in package data folders found relative to this file:
  ``embedded_model_dir()`` holds ``model.onnx`` (+ ``model.onnx.data``) and
  ``genai_config.json`` as written by the ONNX Runtime GenAI model builder
  (fp32, CPU, ``com.microsoft.GroupQueryAttention`` with rotary embedding,
  inputs ``input_ids``/``attention_mask``/``past_key_values.%d.key|value``,
  outputs ``logits``/``present.%d.key|value``). ``embedded_draft_dir()`` holds a
  smaller model of the same vocabulary for speculative decoding (it may be
  absent in a build that did not train it; check ``.exists()``).
* Vocabulary: token ids ``0..255`` are the raw UTF-8 byte values,
  ``BOS_ID = 256``, ``EOS_ID = 257``, ``PAD_ID = 258``; ids ``259..VOCAB_SIZE-1``
  are unused padding of the vocabulary and never produced by ``encode``.
* ``encode`` turns text into UTF-8 bytes (optionally preceded by BOS);
  ``decode`` drops every id >= 256 and decodes the bytes with
  ``errors="replace"``, so it never raises on a partial UTF-8 sequence.

The models were made by ``scripts/train_embedded.py`` (trained on the Python
standard library's docstrings); this module imports only the standard library.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "NUM_BYTES",
    "EMBEDDED_DIR",
    "EMBEDDED_DRAFT_DIR",
    "embedded_model_dir",
    "embedded_draft_dir",
    "encode",
    "decode",
]

#: Number of byte tokens (ids 0..255 are byte values).
NUM_BYTES: int = 256
#: Beginning-of-sequence token id.
BOS_ID: int = 256
#: End-of-sequence token id.
EOS_ID: int = 257
#: Padding token id (used for left padding in batches).
PAD_ID: int = 258
#: Size of the model's vocabulary (logits width); 259..263 are unused ids.
VOCAB_SIZE: int = 264

_DATA = pathlib.Path(__file__).resolve().parent / "data"
#: Folder of the embedded default model (model.onnx, model.onnx.data, genai_config.json).
EMBEDDED_DIR: pathlib.Path = _DATA / "embedded"
#: Folder of the embedded draft model (same vocabulary, smaller), if it was built.
EMBEDDED_DRAFT_DIR: pathlib.Path = _DATA / "embedded_draft"


def embedded_model_dir() -> pathlib.Path:
    """Return the folder of the embedded default model (installed package data)."""
    return EMBEDDED_DIR


def embedded_draft_dir() -> pathlib.Path:
    """Return the folder of the embedded draft model (same vocabulary as the default)."""
    return EMBEDDED_DRAFT_DIR


def encode(text: str, add_bos: bool = True) -> list[int]:
    """Encode ``text`` as its UTF-8 bytes, preceded by ``BOS_ID`` if ``add_bos``.

    No EOS is appended. Every returned id is in ``range(256)`` except the BOS.
    """
    ids = list(text.encode("utf-8"))
    return [BOS_ID, *ids] if add_bos else ids


def decode(ids: Iterable[int]) -> str:
    """Decode token ids to text: ids outside ``0..255`` (specials, unused) are skipped,
    the remaining bytes are decoded as UTF-8 with ``errors="replace"``.

    Accepts any iterable of integers (lists, NumPy arrays).
    """
    return bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES).decode("utf-8", errors="replace")
