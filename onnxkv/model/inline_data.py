"""Large inline tensors of a model file read where they lie, as external data of the file itself.

``onnx.load`` parses every byte of a model: the weights a single-file export
stores inline (``raw_data``, as Optimum and Transformers.js files below 2 GB
do) then sit in protobuf's memory for as long as the model lives, and the
kernels' packed copies come on top of them (a 407 MiB file held about
1.2 GiB once a session was built).  :func:`read_model` scans the file's
protocol-buffer wire format instead (memory-mapped, payloads never copied)
and parses a copy of the ``ModelProto`` in which the ``raw_data`` of each
main-graph initializer of at least :data:`MIN_BYTES` is replaced by an
external-data reference to the same bytes of the model file (``location``:
the file's own name, ``offset``, ``length``).  :func:`onnxkv.model.load`
then memory-maps them with the checks every external tensor passes, so the
weights are read from the page cache, and a kernel that packs one releases
its pages.  What ``Model.proto`` holds is therefore what
``onnx.load(file, load_external_data=False)`` gives for a model saved with
external data in its own file: ``Model.external`` maps those tensors.

The scan is conservative: any message it cannot walk (truncated data,
groups, a repeated ``graph`` field) makes it return None, and the caller
reads the file with ``onnx.load``, whose errors name what is wrong; a tensor
with another data field besides ``raw_data``, two ``raw_data`` fields, a
``data_location``, ``external_data`` or ``segment`` is left as it is.
"""

from __future__ import annotations

import math
import mmap
from collections import Counter
from pathlib import Path

import onnx
from onnx import serialization

from onnxkv.model import _wire

__all__ = ["read_model", "MIN_BYTES"]

#: raw_data of at least this many bytes stays in the file (smaller tensors are parsed inline).
MIN_BYTES = 64 << 10

_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
# TensorProto fields: dims, data_type, name, raw_data, the other data fields, external_data, data_location,
# segment.
_DIMS, _DATA_TYPE, _NAME, _RAW_DATA, _EXTERNAL_DATA, _DATA_LOCATION, _SEGMENT = 1, 2, 8, 9, 13, 14, 3
_OTHER_DATA = frozenset({4, 5, 6, 7, 10, 11})
#: Bytes per element of the types load maps (float, float16, bfloat16, the ints, bool, double).
_ITEMSIZE = {
    onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.DOUBLE: 8, onnx.TensorProto.BOOL: 1, onnx.TensorProto.INT8: 1, onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.INT16: 2, onnx.TensorProto.UINT16: 2, onnx.TensorProto.INT32: 4, onnx.TensorProto.UINT32: 4,
    onnx.TensorProto.INT64: 8, onnx.TensorProto.UINT64: 8,
}  # fmt: skip


def _fields(view: memoryview, start: int, end: int):
    """(number, wire type, field start, payload start, field end) of each field in ``view[start:end]``.

    ValueError for anything protobuf's parser would refuse in the headers this module re-encodes or drops
    (a tag or length varint above 5 bytes or 32 bits), for groups, and for a field past ``end``."""
    pos = start
    while pos < end:
        tag, payload = _wire.decode_varint(view, pos)
        if payload - pos > 5 or tag >> 32 or tag >> 3 == 0:
            raise ValueError(f"a field tag at byte {pos} that protobuf refuses")
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _wire.VARINT:
            field_end = _wire.decode_varint(view, payload)[1]
        elif wire_type == _wire.LEN:
            size, body = _wire.decode_varint(view, payload)
            if body - payload > 5 or size >> 31:
                raise ValueError(f"field {number}: a length at byte {payload} that protobuf refuses")
            payload, field_end = body, body + size
        elif wire_type in (_wire.I64, _wire.I32):
            field_end = payload + (8 if wire_type == _wire.I64 else 4)
        else:
            raise ValueError(f"field {number}: wire type {wire_type}")
        if field_end > end:
            raise ValueError(f"field {number} does not fit its message")
        yield number, wire_type, pos, payload, field_end
        pos = field_end


def _entry(key: str, value: str) -> bytes:
    """A StringStringEntryProto (key, value) as a TensorProto.external_data field."""
    body = _wire.encode_fields([_wire.Field(1, _wire.LEN, key.encode()), _wire.Field(2, _wire.LEN, value.encode())])
    return _wire.encode_fields([_wire.Field(_EXTERNAL_DATA, _wire.LEN, body)])


def _packed_varints(view: memoryview, start: int, end: int) -> list[int]:
    values, pos = [], start
    while pos < end:
        value, pos = _wire.decode_varint(view, pos)
        values.append(value)
    if pos != end:
        raise ValueError("packed varints overrun their field")
    return values


def _mappable_bytes(view: memoryview, fields: list) -> int | None:
    """The byte count a tensor's dims and data_type give (the last data_type, as protobuf keeps), when its
    type is one onnxkv maps (fixed-width numbers and bool) and no dim is negative; else None."""
    dims: list[int] = []
    data_type = 0
    for number, wire_type, _, payload, end in fields:
        if number == _DIMS:
            if wire_type == _wire.LEN:
                dims += _packed_varints(view, payload, end)
            elif wire_type == _wire.VARINT:
                dims.append(_wire.decode_varint(view, payload)[0])
        elif number == _DATA_TYPE and wire_type == _wire.VARINT:
            data_type = _wire.decode_varint(view, payload)[0]
    size = _ITEMSIZE.get(data_type)
    if size is None or any(d >> 63 for d in dims):  # a negative int64 dim as its unsigned varint
        return None
    return math.prod(dims) * size


def _tensor(view: memoryview, start: int, end: int, location: str) -> list | None:
    """The parts of one initializer with its raw_data replaced by a reference to the file, or None to keep it
    as it is: another data field or a data location, a type onnxkv does not map, or raw_data of another size
    than its dims and type give (left for the checks that refuse it, as onnx.load gives it)."""
    fields = list(_fields(view, start, end))
    numbers = [f[0] for f in fields]
    if numbers.count(_RAW_DATA) != 1 or {_EXTERNAL_DATA, _DATA_LOCATION, _SEGMENT} & set(numbers):
        return None
    if _OTHER_DATA & set(numbers):
        return None
    (raw,) = [f for f in fields if f[0] == _RAW_DATA]
    length = raw[4] - raw[3]
    if raw[1] != _wire.LEN or length < MIN_BYTES or _mappable_bytes(view, fields) != length:
        return None
    parts: list = [view[f[2] : f[4]] for f in fields if f[0] != _RAW_DATA]
    parts.append(_wire.encode_fields([_wire.Field(_DATA_LOCATION, _wire.VARINT, onnx.TensorProto.EXTERNAL)]))
    parts += [_entry("location", location), _entry("offset", str(raw[3])), _entry("length", str(length))]
    return parts


def _name(view: memoryview, start: int, end: int) -> bytes | None:
    """An initializer's name (the last name field, as protobuf keeps), or None when it has none."""
    names = [bytes(view[payload:e]) for number, wire_type, _, payload, e in _fields(view, start, end)
             if number == _NAME and wire_type == _wire.LEN]  # fmt: skip
    return names[-1] if names else None


def _message(number: int, parts: list) -> bytes:
    """Field ``number`` holding the message made of ``parts`` (bytes or memoryviews)."""
    body = b"".join(parts)
    return _wire.encode_varint(number << 3 | _wire.LEN) + _wire.encode_varint(len(body)) + body


def _stripped(view: memoryview, location: str) -> bytes | None:
    """The serialised ModelProto of ``view`` with its large initializers referring to the file, or None when
    no initializer qualifies."""
    top = list(_fields(view, 0, len(view)))
    graphs = [f for f in top if f[0] == _MODEL_GRAPH]
    if len(graphs) != 1 or graphs[0][1] != _wire.LEN:
        return None  # several graph fields merge when parsed: leave such a file to onnx.load
    graph = graphs[0]
    fields = list(_fields(view, graph[3], graph[4]))
    names = Counter(_name(view, f[3], f[4]) for f in fields if f[0] == _GRAPH_INITIALIZER and f[1] == _wire.LEN)
    graph_parts: list = []
    changed = 0
    for number, wire_type, start, payload, end in fields:
        tensor = None
        if number == _GRAPH_INITIALIZER and wire_type == _wire.LEN and names[_name(view, payload, end)] == 1:
            tensor = _tensor(view, payload, end, location)
        if tensor is None:
            graph_parts.append(view[start:end])
        else:
            graph_parts.append(_message(_GRAPH_INITIALIZER, tensor))
            changed += 1
    if not changed:
        return None
    parts = [view[f[2] : f[4]] if f is not graph else _message(_MODEL_GRAPH, graph_parts) for f in top]
    return b"".join(parts)


def read_model(file: Path) -> onnx.ModelProto | None:
    """The ModelProto of the model file ``file`` with the raw_data of its large main-graph initializers left
    in the file (see the module docstring), or None when the scan finds none or cannot walk the file (the
    caller then reads it with ``onnx.load``).  OSError from opening or mapping the file propagates."""
    if serialization.registry.get_format_from_file_extension(file.suffix) not in (None, "protobuf"):
        return None  # onnx.load reads such a file as text or JSON
    try:  # the file must be reachable by its name (not a deleted file or a memfd), as its mappings are
        if not file.resolve(strict=True).is_file():
            return None
    except (OSError, RuntimeError):
        return None
    with open(file, "rb") as f:
        size = f.seek(0, 2)
        if size < MIN_BYTES:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                data = _stripped(view, file.name)
            except ValueError:
                data = None
            finally:
                view.release()
    if data is None:
        return None
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception:  # protobuf's DecodeError: the whole file goes to onnx.load, which names the problem
        return None
    return proto
