"""Protocol-buffer wire format: just enough to carry onnxkv's own fields.

onnxkv stores its contract as fields the ONNX schema does not know (numbers
≥ 1000, see :mod:`onnxkv.model.contract`).  Protobuf keeps unknown fields
through parse and serialise, so these helpers only need to encode our
fields, decode their payloads, and drop them again from a serialised message.

Wire types handled: 0 varint, 1 fixed 64-bit, 2 length-delimited, 5 fixed
32-bit, and 3/4 (deprecated groups), which are skipped correctly but never
written.  A field's value is an ``int`` for varints and the raw ``bytes``
otherwise (for a group: the bytes between its start and end tags).

Every decoding error (truncated data, bad tag, unknown wire type) raises
``ValueError``; callers turn it into an error naming the message it came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

__all__ = [
    "VARINT",
    "I64",
    "LEN",
    "I32",
    "Field",
    "encode_varint",
    "decode_varint",
    "encode_fields",
    "decode_fields",
    "strip_fields",
]

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5
_FIXED_SIZE = {I64: 8, I32: 4}
_MAX_FIELD = (1 << 29) - 1
_MAX_VARINT = (1 << 64) - 1


class Field(NamedTuple):
    """One top-level field: its number, wire type and value (int or bytes)."""

    number: int
    wire_type: int
    value: int | bytes


def encode_varint(value: int) -> bytes:
    """Encode ``0 <= value < 2**64`` as a base-128 varint."""
    if not 0 <= value <= _MAX_VARINT:
        raise ValueError(f"varint out of range: {value}")
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """Decode the varint starting at ``data[pos]``; return ``(value, next position)``."""
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")
    if value > _MAX_VARINT:
        raise ValueError("varint exceeds 64 bits")
    return value, pos


def encode_fields(fields: Iterable[Field]) -> bytes:
    """Serialise fields of wire type VARINT, I64, LEN or I32 in the given order."""
    out = bytearray()
    for number, wire_type, value in fields:
        if not 1 <= number <= _MAX_FIELD:
            raise ValueError(f"field number out of range: {number}")
        out += encode_varint(number << 3 | wire_type)
        if wire_type == VARINT:
            out += encode_varint(value)
        elif wire_type == LEN:
            out += encode_varint(len(value)) + value
        elif wire_type in _FIXED_SIZE:
            if len(value) != _FIXED_SIZE[wire_type]:
                raise ValueError(f"field {number}: fixed-size value must be {_FIXED_SIZE[wire_type]} bytes")
            out += value
        else:
            raise ValueError(f"field {number}: cannot encode wire type {wire_type}")
    return bytes(out)


def _scan(data: bytes | memoryview) -> Iterator[tuple[Field, int, int]]:
    """Yield each top-level field with the byte span ``[start, end)`` it occupies.

    Non-varint values are ``memoryview`` slices of ``data`` (no copy).
    """
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        start = pos
        number, wire_type, value, pos = _read_field(view, pos)
        if wire_type == EGROUP:
            raise ValueError(f"unmatched end-group tag for field {number}")
        yield Field(number, wire_type, value), start, pos


def _read_field(view: memoryview, pos: int) -> tuple[int, int, int | memoryview, int]:
    tag, pos = decode_varint(view, pos)
    number, wire_type = tag >> 3, tag & 7
    if number == 0:
        raise ValueError("field number 0")
    if wire_type == VARINT:
        value, pos = decode_varint(view, pos)
        return number, wire_type, value, pos
    if wire_type == LEN:
        size, pos = decode_varint(view, pos)
        return number, wire_type, _take(view, pos, size), pos + size
    if wire_type in _FIXED_SIZE:
        size = _FIXED_SIZE[wire_type]
        return number, wire_type, _take(view, pos, size), pos + size
    if wire_type == SGROUP:
        body, open_groups = pos, [number]
        while True:
            if pos >= len(view):
                raise ValueError(f"unterminated group {number}")
            end = pos
            tag, pos = decode_varint(view, pos)
            inner, inner_type = tag >> 3, tag & 7
            if inner_type == SGROUP:
                open_groups.append(inner)
            elif inner_type == EGROUP:
                if inner != open_groups.pop():
                    raise ValueError(f"group closed by end-group tag {inner}")
                if not open_groups:
                    return number, wire_type, view[body:end], pos
            else:
                pos = _read_field(view, end)[3]
    if wire_type == EGROUP:
        return number, wire_type, view[pos:pos], pos
    raise ValueError(f"unknown wire type {wire_type} for field {number}")


def _take(view: memoryview, pos: int, size: int) -> memoryview:
    if pos + size > len(view):
        raise ValueError("truncated field")
    return view[pos : pos + size]


def decode_fields(data: bytes | memoryview) -> list[Field]:
    """Decode every top-level field of a serialised message, in order."""
    return [
        Field(f.number, f.wire_type, f.value if f.wire_type == VARINT else bytes(f.value)) for f, _, _ in _scan(data)
    ]


def strip_fields(data: bytes | memoryview, numbers: frozenset[int]) -> bytes:
    """Return ``data`` without the top-level fields whose number is in ``numbers``.

    Other fields are copied byte for byte (nested messages are never parsed).
    """
    view = memoryview(data)
    kept = [view[start:end] for field, start, end in _scan(view) if field.number not in numbers]
    return b"".join(kept)
