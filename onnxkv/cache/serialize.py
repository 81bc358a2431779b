"""Serialisation of a KV cache to bytes and files: the ``PagedCacheProto`` format.

The format is independent of any cache's internals.  A cache is first turned
into a :class:`CacheSnapshot` (a neutral data model: layers, sequences and the
blocks of every layer of every sequence), which this module writes and reads.
The wire format is documented in ``paged_cache.proto`` beside this module: a
24-byte header (magic ``b"ONNXKVPC"``, format version, CRC-32 and length of
the body) followed by one protobuf ``PagedCacheProto`` message.  Payload bytes
are little-endian.  The descriptor is built here at import time (no generated
code, no protoc) in a private descriptor pool.

Decoding is strict: a malformed, truncated or foreign input raises
:class:`~onnxkv.errors.SerializationError` naming the problem, and never yields
a partly valid snapshot.  :func:`validate` states every rule; :func:`encode`
and :func:`save` apply it before writing anything, :func:`decode` and
:func:`load` before returning.  NaN and Inf elements of page data are data and
are kept; quantization scales must be finite.  Decoding costs memory
proportional to the input's size only: the body length is checked against
the bytes present before the protobuf parser runs, and :func:`load` can refuse
a file by its size before reading it.
"""

from __future__ import annotations

import os
import stat
import struct
import tempfile
import zlib
from dataclasses import dataclass

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from onnxkv.cache.formats import CHANNEL_ZP_MAX_UNIT_LOG2
from onnxkv.errors import InputError, SerializationError

__all__ = [
    "PagePayload",
    "BlockRecord",
    "LayerSpec",
    "SequenceRecord",
    "CacheSnapshot",
    "Expectation",
    "PagedCacheProto",
    "MAGIC",
    "VERSION",
    "encode",
    "decode",
    "save",
    "load",
    "validate",
    "check_expectation",
]

#: First eight bytes of every file.
MAGIC = b"ONNXKVPC"
#: File format version written to the header and to ``PagedCacheProto.version``.
VERSION = 1
# magic, uint32 version, uint32 CRC-32 of the body, uint64 body length.
_HEADER = struct.Struct("<8sIIQ")

_INT64_MAX = 2**63 - 1

#: Page formats: name -> element type on the wire (and of ``PagePayload.data`` up to byte order).
_FORMATS: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # bit patterns: the upper half of a float32
}
#: Quantized page formats: name -> (bits per code, smallest code, largest code); data is packed codes (uint8).
_QUANTIZED: dict[str, tuple[int, int, int]] = {
    "int8": (8, -128, 127), "uint8": (8, 0, 255), "int4": (4, -8, 7), "uint4": (4, 0, 15),
    "int2": (2, -2, 1), "uint2": (2, 0, 3),
}
#: Element types a model's cache inputs may have (``LayerSpec.dtype``).
_MODEL_DTYPES = ("float32", "float16", "bfloat16")


# --------------------------------------------------------------------------- data model


def _bits(array: np.ndarray) -> np.ndarray:
    """The elements of ``array`` as unsigned integers of the same width, native byte order."""
    native = array.astype(array.dtype.newbyteorder("="), copy=False)
    return native.view(np.dtype(f"u{native.dtype.itemsize}"))


def _same_array(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Bit equality (so NaN payloads compare equal to themselves); both None counts as equal."""
    if a is None or b is None:
        return a is b
    return (a.shape == b.shape and a.dtype.newbyteorder("=") == b.dtype.newbyteorder("=")
            and np.array_equal(_bits(a), _bits(b)))


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
        return (self.format == other.format and _same_array(self.data, other.data)
                and _same_array(self.scale, other.scale) and _same_array(self.zero_point, other.zero_point))

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


@dataclass
class CacheSnapshot:
    """A whole KV cache, independent of the cache's layout in memory.

    ``block_size >= 1``; at least one layer and one sequence.
    ``model_signature`` is an opaque string identifying the model; this module
    stores it and never interprets it.
    """

    block_size: int
    layers: list[LayerSpec]
    sequences: list[SequenceRecord]
    model_signature: str = ""


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


# --------------------------------------------------------------------------- protobuf schema

_PACKAGE = "onnxkv.cache"
# (message, ((field name, number, type, repeated), ...)); a type that is not a
# scalar type name is a message of this package.  paged_cache.proto documents
# the same schema (checked by the tests).
_SCHEMA: tuple[tuple[str, tuple[tuple[str, int, str, bool], ...]], ...] = (
    ("PagedCacheProto", (
        ("version", 1, "int64", False),
        ("block_size", 2, "int64", False),
        ("layers", 3, "LayerProto", True),
        ("sequences", 4, "SequenceProto", True),
        ("model_signature", 5, "string", False),
    )),
    ("LayerProto", (
        ("key_name", 1, "string", False),
        ("value_name", 2, "string", False),
        ("kv_heads", 3, "int64", False),
        ("head_size", 4, "int64", False),
        ("dtype", 5, "string", False),
    )),
    ("SequenceProto", (
        ("length", 1, "int64", False),
        ("blocks", 2, "BlockProto", True),
        ("first_position", 3, "int64", False),
    )),
    ("BlockProto", (
        ("layer", 1, "int64", False),
        ("start", 2, "int64", False),
        ("length", 3, "int64", False),
        ("key", 4, "PageProto", False),
        ("value", 5, "PageProto", False),
    )),
    ("PageProto", (
        ("format", 1, "string", False),
        ("data", 2, "bytes", False),
        ("scale", 3, "bytes", False),
        ("zero_point", 4, "bytes", False),
        ("scale_dims", 5, "int64", True),
    )),
)


def _build_message_class() -> type[message.Message]:
    """Build ``PagedCacheProto`` from :data:`_SCHEMA` in a private descriptor pool."""
    fdp = descriptor_pb2.FileDescriptorProto(name="onnxkv/cache/paged_cache.proto", package=_PACKAGE,
                                             syntax="proto3")
    scalar = {"int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
              "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
              "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES}
    for message_name, fields in _SCHEMA:
        proto = fdp.message_type.add(name=message_name)
        for name, number, type_name, repeated in fields:
            f = proto.field.add(name=name, number=number, json_name=name,
                                label=(descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED if repeated
                                       else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL))
            if type_name in scalar:
                f.type = scalar[type_name]
            else:
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
                f.type_name = f".{_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    descriptor = pool.FindMessageTypeByName(f"{_PACKAGE}.PagedCacheProto")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)


#: The protobuf message class of a file's body (nested messages are reached through its fields).
PagedCacheProto = _build_message_class()


# --------------------------------------------------------------------------- validation


def _fail(where: str, problem: str) -> SerializationError:
    return SerializationError(f"{where}: {problem}")


def _describe(value: object) -> str:
    return "an empty list" if isinstance(value, list) and not value else type(value).__name__


def _check_int(value: object, where: str, what: str, low: int, high: int = _INT64_MAX) -> int:
    """``value`` as an int in ``[low, high]`` (numpy integers accepted, bool not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _fail(where, f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise _fail(where, f"{what} must be in [{low}, {high}], got {value}")
    return int(value)


def _check_text(value: object, where: str, what: str, allow_empty: bool = False) -> None:
    """``value`` is a str protobuf can store (UTF-8 encodable)."""
    if not isinstance(value, str):
        raise _fail(where, f"{what} must be a str, got {type(value).__name__} {value!r}")
    if not value and not allow_empty:
        raise _fail(where, f"{what} must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _fail(where, f"{what} {value!r} is not encodable as UTF-8 ({exc.reason})") from None


def _check_layers(layers: object, where: str) -> None:
    if not isinstance(layers, list) or not layers:
        raise _fail(where, f"layers must be a non-empty list of LayerSpec, got {_describe(layers)}")
    seen: dict[str, str] = {}
    for i, layer in enumerate(layers):
        at = f"{where}: layer {i}"
        if not isinstance(layer, LayerSpec):
            raise _fail(at, f"expected a LayerSpec, got {type(layer).__name__}")
        for attr in ("key_name", "value_name"):
            name = getattr(layer, attr)
            _check_text(name, at, attr)
            if name in seen:
                raise _fail(at, f"{attr} {name!r} is already the {seen[name]}")
            seen[name] = f"{attr} of layer {i}"
        _check_int(layer.kv_heads, at, "kv_heads", 1)
        _check_int(layer.head_size, at, "head_size", 1)
        if layer.dtype not in _MODEL_DTYPES:
            raise _fail(at, f"dtype must be one of {', '.join(_MODEL_DTYPES)}, got {layer.dtype!r}")


def _check_block_position(layer: object, start: object, length: object, n_layers: int, block_size: int,
                          where: str) -> None:
    """A block's layer index, start and length (no payloads)."""
    _check_int(layer, where, "layer index", -_INT64_MAX - 1)
    if not 0 <= layer < n_layers:
        raise _fail(where, f"layer index {layer} is out of range: the snapshot has {n_layers} layers")
    start = _check_int(start, where, "start", 0)
    if start % block_size:
        raise _fail(where, f"start {start} is not a multiple of block_size {block_size}")
    _check_int(length, where, "length", 1, block_size)


def _format_dtype(page_format: object, where: str, role: str) -> np.dtype:
    if not isinstance(page_format, str) or (page_format not in _FORMATS and page_format not in _QUANTIZED):
        raise _fail(where, f"{role} page has unknown format {page_format!r} "
                           f"(supported: {', '.join([*_FORMATS, *_QUANTIZED])})")
    return _FORMATS.get(page_format, np.dtype(np.uint8))


def _row_bytes(page_format: str, head_size: int, where: str, role: str) -> int:
    """Bytes of one token's packed codes; a float format's element bytes are handled by the caller."""
    bits = _QUANTIZED[page_format][0]
    if head_size * bits % 8:
        raise _fail(where, f"{role} page of format {page_format!r} needs head_size * {bits} bits to fill whole "
                           f"bytes, head_size is {head_size}")
    return head_size * bits // 8


def _check_params(page_format: str, scale, zero_point, heads: int, head_size: int, where: str, role: str) -> None:
    """Quantization parameters: float32 [heads * G] each, G in {1, head_size}; scale > 0; zero points
    integral and in the format's code range (per channel: within a channel-zp header's reach)."""
    bits, lo, hi = _QUANTIZED[page_format]
    for name, a in (("scale", scale), ("zero_point", zero_point)):
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.newbyteorder("<") != np.dtype("<f4"):
            raise _fail(where, f"{role} page of format {page_format!r} needs a 1-D float32 {name}, got "
                               f"{None if a is None else getattr(a, 'shape', type(a).__name__)}")
    if scale.shape != zero_point.shape or scale.size not in (heads, heads * head_size):
        raise _fail(where, f"{role} page scale/zero_point have {scale.size}/{zero_point.size} entries, expected "
                           f"{heads} (one per head) or {heads * head_size} (one per head and channel)")
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise _fail(where, f"{role} page scales must be finite and > 0")
    if scale.size == heads * head_size and head_size > 1:  # a channel-zp header's zero points: z0 + w * o
        z0 = 0 if lo < 0 else 1 << (bits - 1)
        lo, hi = z0 - (128 << CHANNEL_ZP_MAX_UNIT_LOG2), z0 + (128 << CHANNEL_ZP_MAX_UNIT_LOG2)
    if not (np.isfinite(zero_point).all() and (zero_point == np.rint(zero_point)).all()
            and zero_point.min() >= lo and zero_point.max() <= hi):
        raise _fail(where, f"{role} page zero points must be integers in [{lo}, {hi}] ({page_format})")


def _check_page(page: object, role: str, shape: tuple[int, int, int], where: str) -> None:
    """One payload against its block's expected element shape ``[kv_heads, length, head_size]``."""
    if page is None:
        raise _fail(where, f"missing {role} page")
    if not isinstance(page, PagePayload):
        raise _fail(where, f"{role} page must be a PagePayload, got {type(page).__name__}")
    wire = _format_dtype(page.format, where, role)
    data = page.data
    if not isinstance(data, np.ndarray):
        raise _fail(where, f"{role} page data must be a numpy array, got {type(data).__name__}")
    if data.dtype.newbyteorder("<") != wire:
        raise _fail(where, f"{role} page of format {page.format!r} must hold {wire.newbyteorder('=').name} "
                           f"elements, got {data.dtype.name} (dtype mismatch)")
    if page.format in _QUANTIZED:
        packed = (shape[0], shape[1], _row_bytes(page.format, shape[2], where, role))
        if data.shape != packed:
            raise _fail(where, f"{role} page data has shape {data.shape}, expected {packed} "
                               f"(kv_heads, length, packed code bytes per token)")
        _check_params(page.format, page.scale, page.zero_point, shape[0], shape[2], where, role)
        return
    if data.shape != shape:
        raise _fail(where, f"{role} page data has shape {data.shape}, expected {shape} (kv_heads, length, head_size)")
    for attr in ("scale", "zero_point"):
        if getattr(page, attr) is not None:
            raise _fail(where, f"{role} page of float format {page.format!r} must not have a {attr}")


def _check_coverage(blocks: list[tuple[int, int, int]], layer: int, length: int, first_position: int,
                    block_size: int, where: str) -> None:
    """One layer's blocks ``(start, length, index)`` sorted by start tile ``[s, length)``, ``s <= first_position``."""
    if not blocks:
        if first_position < length:
            raise _fail(where, f"layer {layer} has no blocks: positions [{first_position}, {length}) are not covered")
        return
    first_start = blocks[0][0]
    if first_start > first_position:
        raise _fail(where, f"layer {layer}: positions [{first_position}, {first_start}) are not covered "
                           f"(its first block starts at {first_start})")
    end = first_start
    for k, (start, block_length, index) in enumerate(blocks):
        if k and start == blocks[k - 1][0]:
            raise _fail(where, f"layer {layer}: blocks {blocks[k - 1][2]} and {index} both start at {start} "
                               "(duplicate block)")
        if start > end:
            raise _fail(where, f"layer {layer}: positions [{end}, {start}) are not covered (gap before block {index})")
        end = start + block_length
        if end > length:
            raise _fail(where, f"layer {layer}: block {index} covers [{start}, {end}), past the sequence length "
                               f"{length}")
        if k < len(blocks) - 1 and block_length != block_size:
            raise _fail(where, f"layer {layer}: block {index} at start {start} holds {block_length} positions but "
                               f"is not the layer's last block; every block before the last must hold "
                               f"block_size {block_size}")
    if end < length:
        raise _fail(where, f"layer {layer}: positions [{end}, {length}) are not covered (blocks end at {end}, "
                           f"sequence length is {length})")


def _validate(snapshot: object, api: str) -> None:
    if not isinstance(snapshot, CacheSnapshot):
        raise _fail(api, f"expected a CacheSnapshot, got {type(snapshot).__name__}")
    block_size = _check_int(snapshot.block_size, api, "block_size", 1)
    _check_text(snapshot.model_signature, api, "model_signature", allow_empty=True)
    layers = snapshot.layers
    _check_layers(layers, api)
    if not isinstance(snapshot.sequences, list) or not snapshot.sequences:
        raise _fail(api, f"sequences must be a non-empty list of SequenceRecord, got {_describe(snapshot.sequences)}")
    for i, seq in enumerate(snapshot.sequences):
        at = f"{api}: sequence {i}"
        if not isinstance(seq, SequenceRecord):
            raise _fail(at, f"expected a SequenceRecord, got {type(seq).__name__}")
        length = _check_int(seq.length, at, "length", 0)
        first_position = _check_int(seq.first_position, at, "first_position", 0, length)
        if not isinstance(seq.blocks, list):
            raise _fail(at, f"blocks must be a list of BlockRecord, got {type(seq.blocks).__name__}")
        by_layer: list[list[tuple[int, int, int]]] = [[] for _ in layers]
        for j, block in enumerate(seq.blocks):
            where = f"{at} block {j}"
            if not isinstance(block, BlockRecord):
                raise _fail(where, f"expected a BlockRecord, got {type(block).__name__}")
            _check_block_position(block.layer, block.start, block.length, len(layers), block_size, where)
            spec = layers[block.layer]
            shape = (spec.kv_heads, int(block.length), spec.head_size)
            _check_page(block.key, "key", shape, where)
            _check_page(block.value, "value", shape, where)
            by_layer[block.layer].append((int(block.start), int(block.length), j))
        for layer, blocks in enumerate(by_layer):
            _check_coverage(sorted(blocks), layer, length, first_position, block_size, at)


def validate(snapshot: CacheSnapshot) -> None:
    """Check every rule of the data model; raise :class:`SerializationError` naming the first broken one.

    Rules: ``block_size >= 1``; at least one layer, each with non-empty
    distinct input names, ``kv_heads >= 1``, ``head_size >= 1`` and a dtype of
    ``float32``/``float16``/``bfloat16``; at least one sequence with
    ``0 <= first_position <= length``; every block names an existing layer,
    starts at a non-negative multiple of ``block_size``, holds
    ``1..block_size`` positions and has a key and a value page of a known
    format whose data has that format's element type and shape
    ``[kv_heads, length, head_size]`` and no quantization parameters (float
    formats), or, for the quantized formats (int8, uint8, int4, uint4, int2,
    uint2; ``head_size * bits`` a multiple of 8), packed codes uint8
    ``[kv_heads, length, head_size * bits / 8]`` with float32
    ``scale``/``zero_point`` of ``kv_heads`` or ``kv_heads * head_size``
    entries: every scale finite and > 0 (a NaN or infinite scale is
    rejected, unlike NaN and Inf page data, which are kept), zero points
    integral and in the format's code range (per channel, within the reach
    of a channel-zp header, see :class:`PagePayload`); each layer's blocks
    of a sequence tile it as :class:`SequenceRecord` describes: no two
    blocks start at the same position, no gap, every block but the last
    holds ``block_size`` positions and none ends past ``length`` (blocks
    are aligned and hold at most ``block_size`` positions, so blocks never
    overlap); all integers fit in int64; strings are UTF-8 encodable.

    The rules concern the snapshot alone: whether it fits a model or a
    state (names, geometry, capacity, pages) is checked by the loader
    (:func:`onnxkv.cache.snapshot.paged_from_snapshot`).
    """
    _validate(snapshot, "validate")


def _check_counts(expected: Expectation, signature: str, block_size: int, layers: int, sequences: int,
                  api: str) -> None:
    if expected.model_signature is not None and signature != expected.model_signature:
        raise InputError(f"{api}: the saved cache belongs to another model (signature mismatch)")
    if block_size != expected.block_size:
        raise InputError(f"{api}: the saved cache has block_size={block_size}, the state uses {expected.block_size}; "
                         f"create the state with block_size={block_size}")
    if layers != len(expected.layers):
        raise InputError(f"{api}: the saved cache has {layers} layers, the model has {len(expected.layers)}")
    if expected.max_sequences is not None and sequences > expected.max_sequences:
        raise InputError(f"{api}: the saved cache has {sequences} sequences, the state can hold at most "
                         f"{expected.max_sequences} rows (each needs a page of its own to run)")


def _check_layer_specs(expected: Expectation, layers: list[LayerSpec], api: str) -> None:
    for i, (got, want) in enumerate(zip(layers, expected.layers)):
        if got != want:
            saved = (got.key_name, got.value_name, got.kv_heads, got.head_size, got.dtype)
            model = (want.key_name, want.value_name, want.kv_heads, want.head_size, want.dtype)
            raise InputError(f"{api}: saved layer {i} (names, kv_heads, head_size, dtype) {saved} does not match the "
                             f"model's {model}")


def check_expectation(snapshot: CacheSnapshot, expected: Expectation, api: str = "check_expectation") -> None:
    """Raise :class:`~onnxkv.errors.InputError` (messages start with ``api``) unless ``snapshot`` has
    ``expected``'s signature (if given), block size and layers and at most its ``max_sequences`` sequences."""
    _check_counts(expected, snapshot.model_signature, snapshot.block_size, len(snapshot.layers),
                  len(snapshot.sequences), api)
    _check_layer_specs(expected, snapshot.layers, api)


# --------------------------------------------------------------------------- encoding


def _encode_page(page: PagePayload, proto: message.Message) -> None:
    proto.format = page.format
    if page.format in _QUANTIZED:
        proto.data = np.ascontiguousarray(page.data, dtype=np.uint8).tobytes()
        proto.scale = page.scale.astype("<f4", copy=False).tobytes()
        proto.zero_point = page.zero_point.astype("<f4", copy=False).tobytes()
        proto.scale_dims.extend([page.data.shape[0], page.scale.size // page.data.shape[0]])
        return
    proto.data = page.data.astype(_FORMATS[page.format], copy=False).tobytes()


def encode(snapshot: CacheSnapshot) -> bytes:
    """The file bytes of ``snapshot`` (header + ``PagedCacheProto``); validates first (nothing is built if invalid)."""
    _validate(snapshot, "encode")
    proto = PagedCacheProto(version=VERSION, block_size=int(snapshot.block_size),
                            model_signature=snapshot.model_signature)
    for spec in snapshot.layers:
        proto.layers.add(key_name=spec.key_name, value_name=spec.value_name, kv_heads=int(spec.kv_heads),
                         head_size=int(spec.head_size), dtype=spec.dtype)
    for seq in snapshot.sequences:
        seq_proto = proto.sequences.add(length=int(seq.length), first_position=int(seq.first_position))
        for block in seq.blocks:
            block_proto = seq_proto.blocks.add(layer=int(block.layer), start=int(block.start),
                                               length=int(block.length))
            _encode_page(block.key, block_proto.key)
            _encode_page(block.value, block_proto.value)
    body = proto.SerializeToString()
    return _HEADER.pack(MAGIC, VERSION, zlib.crc32(body), len(body)) + body


def save(snapshot: CacheSnapshot, path: str | os.PathLike[str]) -> bytes:
    """Write ``snapshot`` to ``path`` atomically; return the bytes written (:func:`encode`).

    The snapshot is validated and encoded before any file is touched; the
    bytes go to a temporary file in the same directory (readable by its owner
    only: it holds conversation state) that then replaces ``path``, so a
    failure never leaves a partial file or destroys the previous one.
    """
    blob = encode(snapshot)
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".paged-cache-", suffix=".tmp", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return blob


# --------------------------------------------------------------------------- decoding


def _parse(data: memoryview, api: str) -> message.Message:
    """Check the header and parse the body (``data``: the file's bytes); every framing or protobuf problem raises."""
    if len(data) < _HEADER.size:
        raise _fail(api, f"truncated input: {len(data)} bytes, the header alone needs {_HEADER.size}")
    magic, version, crc, body_length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise _fail(api, f"not an onnxkv paged cache: bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _fail(api, f"unsupported file format version {version}, this reader supports {VERSION}")
    actual = len(data) - _HEADER.size
    if actual < body_length:
        raise _fail(api, f"truncated input: the header announces a {body_length}-byte body, "
                         f"only {actual} bytes follow")
    if actual > body_length:
        raise _fail(api, f"{actual - body_length} trailing bytes after the {body_length}-byte body")
    body = data[_HEADER.size:]
    body_crc = zlib.crc32(body)
    if body_crc != crc:
        raise _fail(api, f"checksum mismatch: body CRC-32 is {body_crc:#010x}, "
                         f"the header says {crc:#010x} (corrupted data)")
    proto = PagedCacheProto()
    try:
        proto.ParseFromString(body)
    # upb reports invalid UTF-8 in string fields as DecodeError, the pure-Python parser as UnicodeDecodeError.
    except (message.DecodeError, UnicodeDecodeError) as exc:
        raise _fail(api, f"the body is not a valid PagedCacheProto message: {exc}") from exc
    proto.DiscardUnknownFields()
    if proto.ByteSize() != body_length:
        raise _fail(api, f"the body holds {body_length} bytes, but only {proto.ByteSize()} belong "
                         "to PagedCacheProto fields (unknown fields, repeated singular fields or a "
                         "non-canonical encoding)")
    if proto.version != VERSION:
        raise _fail(api, f"PagedCacheProto.version is {proto.version}, expected {VERSION} "
                         "(the header's version)")
    return proto


def _decode_page(block: message.Message, role: str, spec: LayerSpec, where: str) -> PagePayload:
    """The ``role`` ("key"/"value") page of a block whose layer index and length were checked."""
    if not block.HasField(role):
        raise _fail(where, f"missing {role} page")
    page = getattr(block, role)
    wire = _format_dtype(page.format, where, role)
    if page.format in _QUANTIZED:
        return _decode_quantized(page, role, spec, block.length, where)
    if page.scale or page.zero_point or len(page.scale_dims):
        raise _fail(where, f"{role} page of format {page.format!r} carries quantization parameters "
                           "(scale, zero_point or scale_dims); float formats take none")
    shape = (spec.kv_heads, block.length, spec.head_size)
    expected = spec.kv_heads * block.length * spec.head_size * wire.itemsize
    if len(page.data) != expected:
        raise _fail(where, f"{role} page holds {len(page.data)} data bytes, expected {expected} = kv_heads "
                           f"{shape[0]} * length {shape[1]} * head_size {shape[2]} * {wire.itemsize} bytes "
                           f"({page.format})")
    return PagePayload(format=page.format, data=np.frombuffer(page.data, dtype=wire).reshape(shape))


def _decode_quantized(page: message.Message, role: str, spec: LayerSpec, length: int, where: str) -> PagePayload:
    row = _row_bytes(page.format, spec.head_size, where, role)
    expected = spec.kv_heads * length * row
    if len(page.data) != expected:
        raise _fail(where, f"{role} page holds {len(page.data)} code bytes, expected {expected} = kv_heads "
                           f"{spec.kv_heads} * length {length} * {row} bytes per token ({page.format})")
    if len(page.scale_dims) != 2:
        raise _fail(where, f"{role} page has {len(page.scale_dims)} scale_dims, expected 2 [kv_heads, 1 or "
                           "head_size]")
    dims = list(page.scale_dims)
    if dims[0] != spec.kv_heads or dims[1] not in (1, spec.head_size):
        raise _fail(where, f"{role} page scale_dims {dims} must be [kv_heads {spec.kv_heads}, 1 or head_size "
                           f"{spec.head_size}]")
    n = dims[0] * dims[1]
    for name in ("scale", "zero_point"):
        if len(getattr(page, name)) != 4 * n:
            raise _fail(where, f"{role} page {name} holds {len(getattr(page, name))} bytes, expected {4 * n} "
                               f"(float32 per {dims})")
    scale = np.frombuffer(page.scale, "<f4")
    zero = np.frombuffer(page.zero_point, "<f4")
    _check_params(page.format, scale, zero, spec.kv_heads, spec.head_size, where, role)
    data = np.frombuffer(page.data, np.uint8).reshape(spec.kv_heads, length, row)
    return PagePayload(format=page.format, data=data, scale=scale, zero_point=zero)


def _check_size(size: int, max_bytes: int | None, api: str) -> None:
    """Refuse an input of ``size`` bytes above ``max_bytes`` (None: no limit) before it is parsed."""
    if max_bytes is not None and size > max_bytes:
        raise InputError(f"{api}: the input holds {size} bytes, more than max_bytes={max_bytes} "
                         "(nothing was parsed)")


def _decode(data: bytes, api: str, max_bytes: int | None, expected: Expectation | None) -> CacheSnapshot:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _fail(api, f"expected bytes, got {type(data).__name__}")
    _check_size(memoryview(data).nbytes, max_bytes, api)
    proto = _parse(memoryview(data if isinstance(data, bytes) else bytes(data)), api)
    if expected is not None:
        _check_counts(expected, proto.model_signature, proto.block_size, len(proto.layers), len(proto.sequences), api)
    layers = [LayerSpec(key_name=p.key_name, value_name=p.value_name, kv_heads=p.kv_heads, head_size=p.head_size,
                        dtype=p.dtype) for p in proto.layers]
    if expected is not None:
        _check_layer_specs(expected, layers, api)
    block_size = _check_int(proto.block_size, api, "block_size", 1)
    _check_layers(layers, api)
    sequences = []
    for i, seq in enumerate(proto.sequences):
        blocks = []
        for j, block in enumerate(seq.blocks):
            where = f"{api}: sequence {i} block {j}"
            _check_block_position(block.layer, block.start, block.length, len(layers), block_size, where)
            spec = layers[block.layer]
            blocks.append(BlockRecord(layer=block.layer, start=block.start, length=block.length,
                                      key=_decode_page(block, "key", spec, where),
                                      value=_decode_page(block, "value", spec, where)))
        sequences.append(SequenceRecord(length=seq.length, blocks=blocks, first_position=seq.first_position))
    snapshot = CacheSnapshot(block_size=block_size, layers=layers, sequences=sequences,
                             model_signature=proto.model_signature)
    _validate(snapshot, api)
    return snapshot


def decode(data: bytes, max_bytes: int | None = None, expected: Expectation | None = None) -> CacheSnapshot:
    """Parse file bytes into a valid :class:`CacheSnapshot`, or raise :class:`SerializationError`.

    Checked in order: size (more than ``max_bytes`` raises
    :class:`~onnxkv.errors.InputError` before anything is parsed), header
    (magic, version, body length against the bytes present, CRC-32),
    protobuf parse, no unknown fields, ``expected`` (:class:`Expectation`;
    InputError), then every rule of :func:`validate`.  Page arrays are
    read-only little-endian views (float32, float16, or uint16 for bfloat16)
    of bytes objects owned by the snapshot; copy them to write.
    """
    return _decode(data, "decode", max_bytes, expected)


def load(path: str | os.PathLike[str], max_bytes: int | None = None,
         expected: Expectation | None = None) -> CacheSnapshot:
    """Read and :func:`decode` the file at ``path`` (OSError if it cannot be read; messages name the path).

    A file that is not a regular file, or of more than ``max_bytes`` bytes,
    raises :class:`~onnxkv.errors.InputError` after its status is read from
    the open file and before its contents are (the read stops at
    ``max_bytes + 1`` bytes should the file grow meanwhile).
    """
    api = f"load({os.fspath(path)!r})"
    # O_NONBLOCK: opening a FIFO must not wait for a writer (its status is refused below)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise InputError(f"{api}: not a regular file (a cache file is read whole, from a known size)")
        _check_size(status.st_size, max_bytes, api)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    return _decode(data, api, max_bytes, expected)
