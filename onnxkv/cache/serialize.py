"""Serialisation of a KV cache to bytes and files: the ``PagedCacheProto`` format.

The format is independent of any cache's internals.  A cache is first turned
into a :class:`~onnxkv.cache.snapshot_model.CacheSnapshot` (a neutral data
model: layers, sequences and the blocks of every layer of every sequence;
:mod:`onnxkv.cache.snapshot` converts), which this module writes and reads;
its data model and rules (:mod:`onnxkv.cache.serialize_rules`) are
importable from here too.
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
the bytes present before the protobuf parser runs, :func:`load` can refuse
a file by its size before reading it, and sequences beyond
:data:`FREE_SEQUENCES` must each come with :data:`SEQUENCE_BYTES` of input.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import tempfile
import zlib

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from onnxkv.cache.serialize_rules import (
    FORMATS,
    QUANTIZED,
    check_block_position,
    check_counts,
    check_expectation,
    check_int,
    check_layer_specs,
    check_layers,
    check_params,
    check_snapshot,
    fail,
    format_dtype,
    row_bytes,
    validate,
)
from onnxkv.cache.snapshot_model import (
    BlockRecord,
    CacheSnapshot,
    Expectation,
    LayerSpec,
    OwedConversion,
    PagePayload,
    SequenceRecord,
)
from onnxkv.errors import InputError

__all__ = [
    "PagePayload",
    "BlockRecord",
    "LayerSpec",
    "SequenceRecord",
    "OwedConversion",
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

# --------------------------------------------------------------------------- protobuf schema

_PACKAGE = "onnxkv.cache"
# (message, ((field name, number, type, repeated), ...)); a type that is not a
# scalar type name is a message of this package.  paged_cache.proto documents
# the same schema (checked by the tests).
_SCHEMA: tuple[tuple[str, tuple[tuple[str, int, str, bool], ...]], ...] = (
    (
        "PagedCacheProto",
        (
            ("version", 1, "int64", False),
            ("block_size", 2, "int64", False),
            ("layers", 3, "LayerProto", True),
            ("sequences", 4, "SequenceProto", True),
            ("model_signature", 5, "string", False),
            ("owed_conversions", 6, "OwedConversionProto", True),
            ("owed_residual_tokens", 7, "int64", False),
        ),
    ),
    (
        "OwedConversionProto",
        (
            ("layer", 1, "int64", False),
            ("role", 2, "string", False),
            ("format", 3, "string", False),
        ),
    ),
    (
        "LayerProto",
        (
            ("key_name", 1, "string", False),
            ("value_name", 2, "string", False),
            ("kv_heads", 3, "int64", False),
            ("head_size", 4, "int64", False),
            ("dtype", 5, "string", False),
        ),
    ),
    (
        "SequenceProto",
        (
            ("length", 1, "int64", False),
            ("blocks", 2, "BlockProto", True),
            ("first_position", 3, "int64", False),
        ),
    ),
    (
        "BlockProto",
        (
            ("layer", 1, "int64", False),
            ("start", 2, "int64", False),
            ("length", 3, "int64", False),
            ("key", 4, "PageProto", False),
            ("value", 5, "PageProto", False),
        ),
    ),
    (
        "PageProto",
        (
            ("format", 1, "string", False),
            ("data", 2, "bytes", False),
            ("scale", 3, "bytes", False),
            ("zero_point", 4, "bytes", False),
            ("scale_dims", 5, "int64", True),
        ),
    ),
)


def _build_message_class() -> type[message.Message]:
    """Build ``PagedCacheProto`` from :data:`_SCHEMA` in a private descriptor pool."""
    fdp = descriptor_pb2.FileDescriptorProto(name="onnxkv/cache/paged_cache.proto", package=_PACKAGE, syntax="proto3")
    scalar = {
        "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
        "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    }
    for message_name, fields in _SCHEMA:
        proto = fdp.message_type.add(name=message_name)
        for name, number, type_name, repeated in fields:
            f = proto.field.add(
                name=name,
                number=number,
                json_name=name,
                label=(
                    descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
                    if repeated
                    else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
                ),
            )
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


# --------------------------------------------------------------------------- encoding


def _encode_page(page: PagePayload, proto: message.Message) -> None:
    proto.format = page.format
    if page.format in QUANTIZED:
        proto.data = np.ascontiguousarray(page.data, dtype=np.uint8).tobytes()
        proto.scale = page.scale.astype("<f4", copy=False).tobytes()
        proto.zero_point = page.zero_point.astype("<f4", copy=False).tobytes()
        proto.scale_dims.extend([page.data.shape[0], page.scale.size // page.data.shape[0]])
        return
    proto.data = page.data.astype(FORMATS[page.format], copy=False).tobytes()


def encode(snapshot: CacheSnapshot) -> bytes:
    """The file bytes of ``snapshot`` (header + ``PagedCacheProto``); validates first (nothing is built if invalid)."""
    check_snapshot(snapshot, "encode")
    proto = PagedCacheProto(
        version=VERSION, block_size=int(snapshot.block_size), model_signature=snapshot.model_signature
    )
    for spec in snapshot.layers:
        proto.layers.add(
            key_name=spec.key_name,
            value_name=spec.value_name,
            kv_heads=int(spec.kv_heads),
            head_size=int(spec.head_size),
            dtype=spec.dtype,
        )
    for seq in snapshot.sequences:
        seq_proto = proto.sequences.add(length=int(seq.length), first_position=int(seq.first_position))
        for block in seq.blocks:
            block_proto = seq_proto.blocks.add(layer=int(block.layer), start=int(block.start), length=int(block.length))
            _encode_page(block.key, block_proto.key)
            _encode_page(block.value, block_proto.value)
    for owed in snapshot.owed:
        proto.owed_conversions.add(layer=int(owed.layer), role=owed.role, format=owed.format)
    proto.owed_residual_tokens = int(snapshot.owed_residual_tokens)
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
    path = _os_path(path)
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
        raise fail(api, f"truncated input: {len(data)} bytes, the header alone needs {_HEADER.size}")
    magic, version, crc, body_length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise fail(api, f"not an onnxkv paged cache: bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise fail(api, f"unsupported file format version {version}, this reader supports {VERSION}")
    actual = len(data) - _HEADER.size
    if actual < body_length:
        raise fail(api, f"truncated input: the header announces a {body_length}-byte body, only {actual} bytes follow")
    if actual > body_length:
        raise fail(api, f"{actual - body_length} trailing bytes after the {body_length}-byte body")
    body = data[_HEADER.size :]
    body_crc = zlib.crc32(body)
    if body_crc != crc:
        raise fail(
            api, f"checksum mismatch: body CRC-32 is {body_crc:#010x}, the header says {crc:#010x} (corrupted data)"
        )
    proto = PagedCacheProto()
    try:
        proto.ParseFromString(body)
    # upb reports invalid UTF-8 in string fields as DecodeError, the pure-Python parser as UnicodeDecodeError.
    except (message.DecodeError, UnicodeDecodeError) as exc:
        raise fail(api, f"the body is not a valid PagedCacheProto message: {exc}") from exc
    proto.DiscardUnknownFields()
    if proto.ByteSize() != body_length:
        raise fail(
            api,
            f"the body holds {body_length} bytes, but only {proto.ByteSize()} belong "
            "to PagedCacheProto fields (unknown fields, repeated singular fields or a "
            "non-canonical encoding)",
        )
    if proto.version != VERSION:
        raise fail(api, f"PagedCacheProto.version is {proto.version}, expected {VERSION} (the header's version)")
    return proto


def _decode_page(block: message.Message, role: str, spec: LayerSpec, where: str) -> PagePayload:
    """The ``role`` ("key"/"value") page of a block whose layer index and length were checked."""
    if not block.HasField(role):
        raise fail(where, f"missing {role} page")
    page = getattr(block, role)
    wire = format_dtype(page.format, where, role)
    if page.format in QUANTIZED:
        return _decode_quantized(page, role, spec, block.length, where)
    if page.scale or page.zero_point or len(page.scale_dims):
        raise fail(
            where,
            f"{role} page of format {page.format!r} carries quantization parameters "
            "(scale, zero_point or scale_dims); float formats take none",
        )
    shape = (spec.kv_heads, block.length, spec.head_size)
    expected = spec.kv_heads * block.length * spec.head_size * wire.itemsize
    if len(page.data) != expected:
        raise fail(
            where,
            f"{role} page holds {len(page.data)} data bytes, expected {expected} = kv_heads "
            f"{shape[0]} * length {shape[1]} * head_size {shape[2]} * {wire.itemsize} bytes "
            f"({page.format})",
        )
    return PagePayload(format=page.format, data=np.frombuffer(page.data, dtype=wire).reshape(shape))


def _decode_quantized(page: message.Message, role: str, spec: LayerSpec, length: int, where: str) -> PagePayload:
    row = row_bytes(page.format, spec.head_size, where, role)
    expected = spec.kv_heads * length * row
    if len(page.data) != expected:
        raise fail(
            where,
            f"{role} page holds {len(page.data)} code bytes, expected {expected} = kv_heads "
            f"{spec.kv_heads} * length {length} * {row} bytes per token ({page.format})",
        )
    if len(page.scale_dims) != 2:
        raise fail(where, f"{role} page has {len(page.scale_dims)} scale_dims, expected 2 [kv_heads, 1 or head_size]")
    dims = list(page.scale_dims)
    if dims[0] != spec.kv_heads or dims[1] not in (1, spec.head_size):
        raise fail(
            where, f"{role} page scale_dims {dims} must be [kv_heads {spec.kv_heads}, 1 or head_size {spec.head_size}]"
        )
    n = dims[0] * dims[1]
    for name in ("scale", "zero_point"):
        if len(getattr(page, name)) != 4 * n:
            raise fail(
                where,
                f"{role} page {name} holds {len(getattr(page, name))} bytes, expected {4 * n} (float32 per {dims})",
            )
    scale = np.frombuffer(page.scale, "<f4")
    zero = np.frombuffer(page.zero_point, "<f4")
    check_params(page.format, scale, zero, spec.kv_heads, spec.head_size, where, role)
    data = np.frombuffer(page.data, np.uint8).reshape(spec.kv_heads, length, row)
    return PagePayload(format=page.format, data=data, scale=scale, zero_point=zero)


def _check_size(size: int, max_bytes: int | None, api: str) -> None:
    """Refuse an input of ``size`` bytes above ``max_bytes`` (None: no limit) before it is parsed."""
    if max_bytes is not None and size > max_bytes:
        raise InputError(f"{api}: the input holds {size} bytes, more than max_bytes={max_bytes} (nothing was parsed)")


#: Sequences any input may hold; beyond them, each must come with :data:`SEQUENCE_BYTES` of input.  An
#: empty sequence is 2 bytes of protobuf, but its record and the row of the state it is loaded into cost
#: a few hundred: without this bound a 2 MB file of empty rows would cost hundreds of MB to load.
FREE_SEQUENCES = 1024
#: Input bytes per sequence beyond :data:`FREE_SEQUENCES` (a row of one token of the smallest model
#: carries more).
SEQUENCE_BYTES = 64


def _decode(data: bytes, api: str, max_bytes: int | None, expected: Expectation | None) -> CacheSnapshot:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise fail(api, f"expected bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    _check_size(size, max_bytes, api)
    proto = _parse(memoryview(data if isinstance(data, bytes) else bytes(data)), api)
    if expected is not None:
        check_counts(expected, proto.model_signature, proto.block_size, len(proto.layers), len(proto.sequences), api)
    if len(proto.sequences) > max(FREE_SEQUENCES, size // SEQUENCE_BYTES):
        raise fail(
            api,
            f"{len(proto.sequences)} sequences in {size} bytes: at most {FREE_SEQUENCES}, or one per "
            f"{SEQUENCE_BYTES} bytes of input, are read (rows must not cost far more memory than the input holds)",
        )
    layers = [
        LayerSpec(
            key_name=p.key_name, value_name=p.value_name, kv_heads=p.kv_heads, head_size=p.head_size, dtype=p.dtype
        )
        for p in proto.layers
    ]
    if expected is not None:
        check_layer_specs(expected, layers, api)
    block_size = check_int(proto.block_size, api, "block_size", 1)
    check_layers(layers, api)
    sequences = []
    for i, seq in enumerate(proto.sequences):
        blocks = []
        for j, block in enumerate(seq.blocks):
            where = f"{api}: sequence {i} block {j}"
            check_block_position(block.layer, block.start, block.length, len(layers), block_size, where)
            spec = layers[block.layer]
            blocks.append(
                BlockRecord(
                    layer=block.layer,
                    start=block.start,
                    length=block.length,
                    key=_decode_page(block, "key", spec, where),
                    value=_decode_page(block, "value", spec, where),
                )
            )
        sequences.append(SequenceRecord(length=seq.length, blocks=blocks, first_position=seq.first_position))
    if len(proto.owed_conversions) > 2 * len(layers):
        raise fail(
            api,
            f"{len(proto.owed_conversions)} owed conversions: at most one per layer and role "
            f"({2 * len(layers)}) can be owed",
        )
    snapshot = CacheSnapshot(
        block_size=block_size,
        layers=layers,
        sequences=sequences,
        model_signature=proto.model_signature,
        owed=[OwedConversion(c.layer, c.role, c.format) for c in proto.owed_conversions],
        owed_residual_tokens=proto.owed_residual_tokens,
    )
    check_snapshot(snapshot, api)
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


def _os_path(path: str | os.PathLike[str]) -> str | bytes:
    """``os.fspath(path)``; OSError (EINVAL) for a path the OS cannot name (a NUL byte: Python's os calls raise
    ValueError for it, not the OSError every other bad path gives)."""
    path = os.fspath(path)
    if ("\0" if isinstance(path, str) else b"\0") in path:
        raise OSError(errno.EINVAL, "a path cannot hold a NUL byte", path)
    return path


def load(
    path: str | os.PathLike[str], max_bytes: int | None = None, expected: Expectation | None = None
) -> CacheSnapshot:
    """Read and :func:`decode` the file at ``path`` (OSError if it cannot be read; messages name the path).

    A file that is not a regular file, or of more than ``max_bytes`` bytes,
    raises :class:`~onnxkv.errors.InputError` after its status is read from
    the open file and before its contents are (the read stops at
    ``max_bytes + 1`` bytes should the file grow meanwhile).
    """
    api = f"load({os.fspath(path)!r})"
    path = _os_path(path)
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
