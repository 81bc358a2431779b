"""The data model of a saved KV cache: layers, sequences and the blocks of every layer of every sequence.

A :class:`CacheSnapshot` is independent of any cache's layout in memory:
:mod:`onnxkv.cache.snapshot` turns a paged cache into one and back,
:mod:`onnxkv.cache.serialize` writes and reads it (``PagedCacheProto``),
and :mod:`onnxkv.cache.serialize_rules` states what makes one valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "PagePayload",
    "BlockRecord",
    "LayerSpec",
    "SequenceRecord",
    "OwedConversion",
    "CacheSnapshot",
    "Expectation",
]


def _bits(array: np.ndarray) -> np.ndarray:
    """The elements of ``array`` as unsigned integers of the same width, native byte order."""
    native = array.astype(array.dtype.newbyteorder("="), copy=False)
    return native.view(np.dtype(f"u{native.dtype.itemsize}"))


def _same_array(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Bit equality (so NaN payloads compare equal to themselves); both None counts as equal."""
    if a is None or b is None:
        return a is b
    return (
        a.shape == b.shape
        and a.dtype.newbyteorder("=") == b.dtype.newbyteorder("=")
        and np.array_equal(_bits(a), _bits(b))
    )


@dataclass(eq=False)
class PagePayload:
    """The keys *or* the values of one block of one layer.

    ``format`` is ``"float32"``, ``"float16"`` or ``"bfloat16"``: ``data``
    holds the stored elements ``[kv_heads, length, head_size]`` (the block's
    valid positions only) as float32, float16, or uint16 bfloat16 bit
    patterns respectively, any byte order and strides, and ``scale`` /
    ``zero_point`` are None.  Or a quantized format (``"int8"``,
    ``"uint8"``, ``"int4"``, ``"uint4"``, ``"int2"``, ``"uint2"``; see
    :mod:`onnxkv.cache.formats`): ``data`` holds the packed codes uint8
    ``[kv_heads, length, head_size * bits / 8]`` (low bits first) and
    ``scale`` / ``zero_point`` float32 ``[kv_heads * G]`` with ``G`` 1 (per
    head) or ``head_size`` (per channel); a value is ``(code - zero_point) *
    scale``.  Zero points are integers in the format's code range, except per
    channel, where they may lie outside it as a channel-zp header's do
    (|zero_point - z0| <= 128 * 2^16, z0 = 0 signed, 2^(bits-1) unsigned).

    Two payloads are equal when their formats match and their arrays have the
    same shape, element type and bits (so NaN equals the same NaN).
    """

    format: str
    data: np.ndarray
    scale: np.ndarray | None = None
    zero_point: np.ndarray | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PagePayload):
            return NotImplemented
        return (
            self.format == other.format
            and _same_array(self.data, other.data)
            and _same_array(self.scale, other.scale)
            and _same_array(self.zero_point, other.zero_point)
        )

    __hash__ = None  # mutable


@dataclass
class BlockRecord:
    """Positions ``[start, start + length)`` of layer ``layer`` of one sequence.

    ``layer`` indexes :attr:`CacheSnapshot.layers`; ``start`` is a multiple of
    the block size; ``1 <= length <= block_size``.
    """

    layer: int
    start: int
    length: int
    key: PagePayload
    value: PagePayload


@dataclass
class LayerSpec:
    """One attention layer's cache inputs.

    ``key_name``/``value_name`` are the graph inputs fed with the keys/values
    (e.g. ``"past_key_values.0.key"``); every name in a snapshot is distinct.
    ``dtype`` is the model's element type (``"float32"``, ``"float16"`` or
    ``"bfloat16"``); pages may be stored in another format.
    """

    key_name: str
    value_name: str
    kv_heads: int
    head_size: int
    dtype: str


@dataclass
class SequenceRecord:
    """One sequence (batch row) holding the valid positions ``[0, length)``.

    ``blocks`` holds every layer's blocks, in any order.  For each layer they
    start at consecutive multiples of the block size ``s, s + block_size, ...``
    with ``s <= first_position`` and cover ``[s, length)`` exactly once: every
    block but the last is full, the last ends at ``length``.  Blocks wholly
    below ``first_position`` (the first retained position; 0 unless a sliding
    window evicted older pages) may be omitted.  ``0 <= first_position <= length``.
    """

    length: int
    blocks: list[BlockRecord]
    first_position: int = 0


@dataclass(frozen=True)
class OwedConversion:
    """A conversion of full pages the saved state owed its next run: the ``role`` ("key" or "value")
    pages of layer ``layer`` (an index into :attr:`CacheSnapshot.layers`) to page format ``format``.

    A state that keeps positions for a truncate (``State.keep_for_truncate``) converts the pages its
    ``kv_format`` selector chose at the start of the next run, not with the run that chose them; a
    saved cache carries those choices so that the state loading it converts the same pages then.
    """

    layer: int
    role: str
    format: str


@dataclass
class CacheSnapshot:
    """A whole KV cache, independent of the cache's layout in memory.

    ``block_size >= 1``; at least one layer and one sequence.
    ``model_signature`` is an opaque string identifying the model; this module
    stores it and never interprets it.  ``owed``: the conversions the saved
    state owed its next run (:class:`OwedConversion`, at most one per layer and
    role), made with ``owed_residual_tokens`` of the most recent positions of
    each row kept in their format (the ``residual_tokens`` of the selector that
    chose them).
    """

    block_size: int
    layers: list[LayerSpec]
    sequences: list[SequenceRecord]
    model_signature: str = ""
    owed: list[OwedConversion] = field(default_factory=list)
    owed_residual_tokens: int = 0


@dataclass(frozen=True)
class Expectation:
    """What a reader of a cache accepts: a model's signature, block size and layers, at most ``max_sequences`` rows.

    :func:`decode` and :func:`load` check it as soon as the body is parsed,
    before a layer, sequence or block is turned into Python objects (so a
    file's repeated fields never cost memory the reader would refuse), and
    :func:`check_expectation` checks a snapshot against it.  A mismatch
    raises :class:`~onnxkv.errors.InputError` (a valid file that does not
    fit) naming the field, the file's value and the expected one.
    """

    block_size: int
    layers: tuple[LayerSpec, ...]
    #: Most rows the reader can hold (None: any number).
    max_sequences: int | None = None
    #: The model's signature (None: not checked); checked first.
    model_signature: str | None = None
