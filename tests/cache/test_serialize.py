"""PagedCacheProto serialisation: round trips, files, the schema file, and a corpus of broken inputs.

Broken inputs are generated here from valid encodings: every truncation,
single-byte flips at every offset (of the file, and of the body re-framed with
a correct header so the protobuf parser and the semantic checks see them),
and hand-made semantic corruptions, each of which must raise
SerializationError with a message naming its problem.
"""

from __future__ import annotations

import errno
import importlib.resources
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import tracemalloc
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxkv.cache import serialize
from onnxkv.cache.serialize import (
    MAGIC,
    VERSION,
    BlockRecord,
    CacheSnapshot,
    LayerSpec,
    OwedConversion,
    PagedCacheProto,
    PagePayload,
    SequenceRecord,
    decode,
    encode,
    load,
    save,
    validate,
)
from onnxkv.errors import InputError, SerializationError

FORMATS = ("float32", "float16", "bfloat16")
HEADER = 24  # magic, uint32 version, uint32 CRC-32, uint64 body length (paged_cache.proto)


# --------------------------------------------------------------------------- helpers


def _page(rng: np.random.Generator, fmt: str, shape: tuple[int, int, int]) -> PagePayload:
    """Random elements of ``fmt``; float32 pages carry some NaN and Inf (they are data)."""
    if fmt == "bfloat16":
        return PagePayload(fmt, rng.integers(0, 2**16, size=shape, dtype=np.uint16))
    data = rng.standard_normal(shape).astype(fmt)
    if fmt == "float32" and data.size >= 3:
        data.flat[rng.choice(data.size, 2, replace=False)] = [np.nan, -np.inf]
    return PagePayload(fmt, data)


def _snapshot(
    rng: np.random.Generator,
    block_size: int,
    heads: list[tuple[int, int]],
    sequences: list[tuple[int, int]],
    omit_evicted: bool = False,
    model_dtype: str = "float32",
    formats: tuple[str, ...] = FORMATS,
) -> CacheSnapshot:
    """A valid snapshot: layers of (kv_heads, head_size), sequences of (length, first_position), shuffled blocks."""
    layers = [
        LayerSpec(f"past_key_values.{i}.key", f"past_key_values.{i}.value", h, d, model_dtype)
        for i, (h, d) in enumerate(heads)
    ]
    records = []
    for length, first in sequences:
        blocks = []
        for li, spec in enumerate(layers):
            lowest = first // block_size * block_size if omit_evicted else 0
            for start in range(lowest, length, block_size):
                n = min(block_size, length - start)
                shape = (spec.kv_heads, n, spec.head_size)
                blocks.append(
                    BlockRecord(
                        li, start, n, _page(rng, rng.choice(formats), shape), _page(rng, rng.choice(formats), shape)
                    )
                )
        records.append(SequenceRecord(length, [blocks[k] for k in rng.permutation(len(blocks))], first))
    return CacheSnapshot(block_size, layers, records, model_signature=f"model-{rng.integers(1 << 30)}")


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _assert_same(got: CacheSnapshot, want: CacheSnapshot) -> None:
    """Field by field and array by array (bitwise), independent of PagePayload.__eq__."""
    assert (got.block_size, got.model_signature, got.layers) == (want.block_size, want.model_signature, want.layers)
    assert len(got.sequences) == len(want.sequences)
    for gs, ws in zip(got.sequences, want.sequences):
        assert (gs.length, gs.first_position, len(gs.blocks)) == (ws.length, ws.first_position, len(ws.blocks))
        for gb, wb in zip(gs.blocks, ws.blocks):
            assert (gb.layer, gb.start, gb.length) == (wb.layer, wb.start, wb.length)
            for gp, wp in ((gb.key, wb.key), (gb.value, wb.value)):
                assert gp.format == wp.format and gp.scale is None and gp.zero_point is None
                assert gp.data.dtype == wp.data.dtype and gp.data.shape == wp.data.shape
                np.testing.assert_array_equal(_bits(gp.data), _bits(wp.data))


def _frame(body: bytes, version: int = VERSION) -> bytes:
    """The documented header, written independently of the module, around ``body``."""
    return struct.pack("<8sIIQ", MAGIC, version, zlib.crc32(body), len(body)) + body


def _decode_or_none(blob: bytes) -> CacheSnapshot | None:
    """The corpus rule: a valid snapshot that survives a round trip, or SerializationError (None)."""
    try:
        snapshot = decode(blob)
    except SerializationError:
        return None
    validate(snapshot)
    assert decode(encode(snapshot)) == snapshot
    return snapshot


def _small(seed: int = 5) -> CacheSnapshot:
    """A tiny valid snapshot whose file is short enough to corrupt at every byte."""
    return _snapshot(np.random.default_rng(seed), 2, [(1, 2)], [(3, 0)])


def _base() -> CacheSnapshot:
    """Block size 4, two layers of 2 heads x 3; sequence 0 has 10 positions (blocks 0, 4, 8 per layer, in that
    order, layer 0 first), sequence 1 has 7 positions with first_position 5 (one block per layer at 4)."""
    rng = np.random.default_rng(77)
    layers = [LayerSpec(f"past_key_values.{i}.key", f"past_key_values.{i}.value", 2, 3, "float16") for i in (0, 1)]

    def blocks(length: int, lowest: int) -> list[BlockRecord]:
        return [
            BlockRecord(
                li,
                s,
                min(4, length - s),
                _page(rng, FORMATS[(li + s) % 3], (2, min(4, length - s), 3)),
                _page(rng, "float16", (2, min(4, length - s), 3)),
            )
            for li in (0, 1)
            for s in range(lowest, length, 4)
        ]

    return CacheSnapshot(4, layers, [SequenceRecord(10, blocks(10, 0)), SequenceRecord(7, blocks(7, 4), 5)], "sig")


def _base_proto() -> PagedCacheProto:
    proto = PagedCacheProto()
    proto.ParseFromString(encode(_base())[HEADER:])
    return proto


# --------------------------------------------------------------------------- round trips


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.integers(1, 6),
    heads=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 5)), min_size=1, max_size=3),
    sequences=st.lists(st.tuples(st.integers(0, 17), st.floats(0, 1)), min_size=1, max_size=3),
    omit_evicted=st.booleans(),
    model_dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_random_snapshots(block_size, heads, sequences, omit_evicted, model_dtype, seed):
    seqs = [(length, int(fraction * length)) for length, fraction in sequences]
    snapshot = _snapshot(np.random.default_rng(seed), block_size, heads, seqs, omit_evicted, model_dtype)
    validate(snapshot)
    got = decode(encode(snapshot))
    _assert_same(got, snapshot)
    assert got == snapshot


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_single_format_bits_and_arrays(fmt):
    snapshot = _snapshot(np.random.default_rng(3), 3, [(2, 4), (1, 8)], [(8, 0), (5, 0)], formats=(fmt,))
    blob = encode(snapshot)
    assert blob[:8] == MAGIC and blob == _frame(blob[HEADER:])
    got = decode(blob)
    _assert_same(got, snapshot)
    page = got.sequences[0].blocks[0].key
    assert page.data.dtype == {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[fmt]
    assert not page.data.flags.writeable
    # payloads are little-endian C-order element bytes
    first = snapshot.sequences[0].blocks[0].key.data
    assert first.astype(first.dtype.newbyteorder("<")).tobytes() in blob


def test_big_endian_and_strided_inputs_encode_like_native():
    snapshot = _small()
    page = snapshot.sequences[0].blocks[0].key
    swapped = PagePayload(page.format, page.data.astype(page.data.dtype.newbyteorder(">")))
    wide = np.empty(page.data.shape[:2] + (2 * page.data.shape[2],), page.data.dtype)
    wide[..., ::2] = page.data
    strided = PagePayload(page.format, wide[..., ::2])
    blob = encode(snapshot)
    for variant in (swapped, strided):
        snapshot.sequences[0].blocks[0].key = variant
        assert encode(snapshot) == blob
    assert decode(blob).sequences[0].blocks[0].key == page


def test_payload_equality_is_bitwise():
    data = np.random.default_rng(4).standard_normal((2, 3, 4)).astype(np.float32)
    data[0, 0, 0], data[0, 0, 1] = np.nan, 0.0
    page = PagePayload("float32", data)
    assert page == PagePayload("float32", data.copy())  # the same NaN bits
    negative_nan, negative_zero = data.copy(), data.copy()
    negative_nan[0, 0, 0] = -np.float32(np.nan)
    negative_zero[0, 0, 1] = -0.0
    assert page != PagePayload("float32", negative_nan) and page != PagePayload("float32", negative_zero)
    assert page != PagePayload("float16", data.astype(np.float16))
    assert page != PagePayload("float32", data, scale=np.ones(2, np.float32))


def test_bytes_like_inputs_and_wrong_type():
    blob = encode(_small())
    assert decode(bytearray(blob)) == decode(memoryview(blob)) == decode(blob)
    with pytest.raises(SerializationError, match="decode: expected bytes, got str"):
        decode(blob.decode("latin-1"))


def test_save_and_load(tmp_path):
    snapshot = _snapshot(np.random.default_rng(11), 4, [(2, 3)], [(9, 0), (6, 2)], omit_evicted=True)
    path = tmp_path / "cache.okv"
    save(snapshot, path)
    assert path.read_bytes() == encode(snapshot)
    _assert_same(load(path), snapshot)
    _assert_same(load(str(path)), snapshot)
    assert [p.name for p in tmp_path.iterdir()] == ["cache.okv"]  # no temporary left behind


def test_save_invalid_snapshot_writes_nothing(tmp_path):
    path = tmp_path / "cache.okv"
    save(_small(1), path)
    before = path.read_bytes()
    bad = _small(2)
    bad.block_size = 0
    with pytest.raises(SerializationError, match=r"encode: block_size must be in \[1, "):
        save(bad, path)
    with pytest.raises(SerializationError):
        save(bad, tmp_path / "other.okv")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.okv"]


def test_load_names_the_file(tmp_path):
    path = tmp_path / "broken.okv"
    path.write_bytes(encode(_small())[:-1])
    with pytest.raises(SerializationError, match=r"load\('.*broken\.okv'\): truncated input"):
        load(path)
    assert issubclass(SerializationError, InputError)


@pytest.mark.parametrize("path", ["cache\x00.okv", b"cache\x00.okv"])
def test_a_path_with_a_nul_byte_is_an_os_error(tmp_path, path):
    """Python's os calls raise ValueError for a NUL byte in a path, where every other bad path gives the
    OSError that State.save_cache / load_cache name as InputError (found by a fuzzing helper)."""
    full = os.path.join(os.fsencode(tmp_path) if isinstance(path, bytes) else str(tmp_path), path)
    for call in (lambda: save(_small(1), full), lambda: load(full)):
        with pytest.raises(OSError, match="a path cannot hold a NUL byte") as e:
            call()
        assert e.value.errno == errno.EINVAL
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- the .proto file


def _parse_proto_text(text: str) -> tuple[str, dict[str, set[tuple[str, int, str, bool]]]]:
    package = re.search(r"^package\s+([\w.]+);", text, re.M).group(1)
    text = re.sub(r"//[^\n]*", "", text)
    messages = {}
    for name, body in re.findall(r"message\s+(\w+)\s*\{(.*?)\}", text, re.S):
        messages[name] = {
            (field, int(number), type_name, bool(repeated))
            for repeated, type_name, field, number in re.findall(r"(repeated\s+)?(\w+)\s+(\w+)\s*=\s*(\d+)\s*;", body)
        }
    return package, messages


def _descriptor_fields() -> tuple[str, dict[str, set[tuple[str, int, str, bool]]]]:
    """The schema of the file descriptor the module built, read back as a FileDescriptorProto."""
    fdp = descriptor_pb2.FileDescriptorProto()
    PagedCacheProto.DESCRIPTOR.file.CopyToProto(fdp)
    F = descriptor_pb2.FieldDescriptorProto
    scalar = {F.TYPE_INT64: "int64", F.TYPE_STRING: "string", F.TYPE_BYTES: "bytes"}
    messages = {
        m.name: {
            (
                f.name,
                f.number,
                f.type_name.rsplit(".", 1)[-1] if f.type == F.TYPE_MESSAGE else scalar[f.type],
                f.label == F.LABEL_REPEATED,
            )
            for f in m.field
        }
        for m in fdp.message_type
    }
    assert fdp.syntax == "proto3"
    return fdp.package, messages


def test_proto_file_matches_module_descriptor():
    text = (importlib.resources.files("onnxkv.cache") / "paged_cache.proto").read_text()
    assert 'syntax = "proto3";' in text
    package, messages = _parse_proto_text(text)
    assert set(messages) == {
        "PagedCacheProto",
        "LayerProto",
        "SequenceProto",
        "BlockProto",
        "PageProto",
        "OwedConversionProto",
    }
    assert (package, messages) == _descriptor_fields()
    assert f'"{MAGIC.decode()}"' in text and f"(currently {VERSION})" in text


# --------------------------------------------------------------------------- corpus of broken inputs


def test_every_truncation_is_rejected():
    blob = encode(_small())
    assert len(blob) < 400
    for n in range(len(blob)):
        with pytest.raises(SerializationError, match="truncated input"):
            decode(blob[:n])
    with pytest.raises(SerializationError, match="1 trailing bytes"):
        decode(blob + b"\0")


def test_every_single_byte_flip_of_the_file_is_rejected():
    """The header checks and the CRC-32 catch every single-byte change of a file."""
    blob = encode(_small())
    for offset in range(len(blob)):
        for mask in (0x01, 0x80, 0xFF):
            corrupt = bytearray(blob)
            corrupt[offset] ^= mask
            with pytest.raises(SerializationError, match="magic|version|truncated|trailing|checksum"):
                decode(bytes(corrupt))


def _body_corpus(seed: int) -> list[bytes]:
    """Every truncation and three single-byte flips at every offset of a small body, and random bodies, re-framed."""
    snapshot = _snapshot(np.random.default_rng(seed), 2, [(1, 2), (2, 1)], [(3, 1), (2, 0)], omit_evicted=True)
    body = encode(snapshot)[HEADER:]
    corpus = [_frame(body[:n]) for n in range(len(body))]
    for offset in range(len(body)):
        for mask in (0x01, 0x10, 0xFF):
            corrupt = bytearray(body)
            corrupt[offset] ^= mask
            corpus.append(_frame(bytes(corrupt)))
    rng = np.random.default_rng(seed)
    return corpus + [_frame(rng.bytes(int(n))) for n in rng.integers(0, 64, 200)]


def _outcomes(corpus: list[bytes]) -> list[int | None]:
    """Per input: None if rejected, else the CRC-32 of its decoded snapshot re-encoded."""
    snapshots = [_decode_or_none(blob) for blob in corpus]
    return [None if snapshot is None else zlib.crc32(encode(snapshot)) for snapshot in snapshots]


@pytest.mark.parametrize("seed", [5, 6])
def test_body_flips_and_truncations_never_escape(seed):
    """Re-framed with a correct header, every corrupt body decodes to a valid snapshot or raises SerializationError."""
    outcomes = _outcomes(_body_corpus(seed))
    decoded = sum(o is not None for o in outcomes)
    # flips inside float payloads decode (they are data); structural ones are rejected
    assert 0 < decoded < len(outcomes) // 2


_CHILD = """
import json, pickle, sys, zlib
from google.protobuf.internal import api_implementation
from onnxkv.cache.serialize import decode, encode
from onnxkv.errors import SerializationError

assert api_implementation.Type() == "python", api_implementation.Type()
outcomes = []
for blob in pickle.load(open(sys.argv[1], "rb")):
    try:
        outcomes.append(zlib.crc32(encode(decode(blob))))
    except SerializationError:
        outcomes.append(None)
print(json.dumps(outcomes))
"""


def test_pure_python_protobuf_agrees_on_the_corpus(tmp_path):
    """The pure-Python protobuf parser (another exception vocabulary) accepts and rejects exactly the same inputs."""
    corpus = _body_corpus(5)[::2]
    (tmp_path / "corpus.pkl").write_bytes(pickle.dumps(corpus))
    env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    # cwd: the installed package, not a source tree beside the tests
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "corpus.pkl")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == _outcomes(corpus)


def _mutate(edit: Callable[[PagedCacheProto], None]) -> bytes:
    proto = _base_proto()
    edit(proto)
    return _frame(proto.SerializeToString())


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return bytes([number << 3 | wire_type]) + payload


def _at(proto: PagedCacheProto, path: str):
    """The sub-message at dotted ``path`` (integers index repeated fields)."""
    for part in path.split("."):
        proto = proto[int(part)] if part.isdigit() else getattr(proto, part)
    return proto


def _set(path: str, value) -> Callable[[PagedCacheProto], None]:
    """An edit setting the field at dotted ``path``."""
    parent, _, name = path.rpartition(".")
    return lambda proto: setattr(_at(proto, parent) if parent else proto, name, value)


def _clear(path: str, name: str) -> Callable[[PagedCacheProto], None]:
    """An edit clearing field ``name`` of the sub-message at ``path``."""
    return lambda proto: _at(proto, path).ClearField(name)


def _delete_block(seq: int, index: int) -> Callable[[PagedCacheProto], None]:
    def edit(proto):
        del proto.sequences[seq].blocks[index]

    return edit


def _duplicate_block(proto):
    proto.sequences[0].blocks.add().CopyFrom(proto.sequences[0].blocks[1])


def _drop_layer_blocks(proto):
    blocks = [b for b in proto.sequences[0].blocks if b.layer == 0]
    del proto.sequences[0].blocks[:]
    proto.sequences[0].blocks.extend(blocks)


def _valid_body() -> bytes:
    return encode(_base())[HEADER:]


# Each entry: (id, corrupt file bytes, regex the message must match).  Sequence 0 block 1 is layer 0 at start 4.
SEMANTIC = [
    ("bad magic", lambda: b"ONNXKVXX" + encode(_base())[8:], r"decode: not an onnxkv paged cache: bad magic"),
    ("header version", lambda: _frame(_valid_body(), version=2), r"unsupported file format version 2"),
    ("checksum", lambda: encode(_base())[:12] + b"\0\0\0\0" + encode(_base())[16:], r"checksum mismatch"),
    ("protobuf garbage", lambda: _frame(b"\x0a\xff\xff\xff\xff\x0f"), r"not a valid PagedCacheProto message"),
    ("unknown field", lambda: _frame(_valid_body() + _field(15, 0, b"\x01")), r"unknown fields"),
    ("repeated singular field", lambda: _frame(_valid_body() + _field(2, 0, b"\x04")), r"repeated singular"),
    ("message version", lambda: _mutate(_set("version", 7)), r"PagedCacheProto\.version is 7, expected 1"),
    (
        "unknown format",
        lambda: _mutate(_set("sequences.0.blocks.1.key.format", "int3")),
        r"sequence 0 block 1: key page has unknown format 'int3'",
    ),
    ("block_size 0", lambda: _mutate(_set("block_size", 0)), r"decode: block_size must be in \[1, \d+\], got 0"),
    ("negative block_size", lambda: _mutate(_set("block_size", -4)), r"block_size must be in \[1, \d+\], got -4"),
    (
        "layer out of range",
        lambda: _mutate(_set("sequences.0.blocks.1.layer", 2)),
        r"sequence 0 block 1: layer index 2 is out of range: the snapshot has 2 layers",
    ),
    ("negative layer", lambda: _mutate(_set("sequences.1.blocks.0.layer", -1)), r"layer index -1 is out of range"),
    (
        "unaligned start",
        lambda: _mutate(_set("sequences.0.blocks.1.start", 5)),
        r"block 1: start 5 is not a multiple of block_size 4",
    ),
    ("negative start", lambda: _mutate(_set("sequences.0.blocks.1.start", -4)), r"start must be in \[0, \d+\], got -4"),
    (
        "zero block length",
        lambda: _mutate(_set("sequences.0.blocks.1.length", 0)),
        r"length must be in \[1, 4\], got 0",
    ),
    (
        "block longer than block_size",
        lambda: _mutate(_set("sequences.0.blocks.1.length", 5)),
        r"length must be in \[1, 4\], got 5",
    ),
    (
        "payload too short",
        lambda: _mutate(_set("sequences.0.blocks.1.value.data", b"\0" * 47)),
        r"value page holds 47 data bytes, expected 48 = kv_heads 2 \* length 4 \* head_size 3 \* 2 bytes \(float16\)",
    ),
    (
        "payload vs block length",
        lambda: _mutate(_set("sequences.0.blocks.2.length", 1)),
        r"key page holds \d+ data bytes",
    ),
    ("missing key", lambda: _mutate(_clear("sequences.0.blocks.1", "key")), r"sequence 0 block 1: missing key page"),
    ("missing value", lambda: _mutate(_clear("sequences.1.blocks.0", "value")), r"sequence 1 block 0: missing value"),
    (
        "scale on float page",
        lambda: _mutate(_set("sequences.0.blocks.1.key.scale", b"\0\0\x80?")),
        r"key page of format '\w+' carries quantization parameters",
    ),
    (
        "zero_point on float page",
        lambda: _mutate(_set("sequences.0.blocks.0.value.zero_point", b"\x01")),
        r"value page .* carries quantization parameters",
    ),
    (
        "scale_dims on float page",
        lambda: _mutate(lambda p: p.sequences[0].blocks[0].key.scale_dims.append(2)),
        r"key page .* carries quantization parameters",
    ),
    ("gap", lambda: _mutate(_delete_block(0, 1)), r"sequence 0: layer 0: positions \[4, 8\) are not covered"),
    ("duplicate block", lambda: _mutate(_duplicate_block), r"layer 0: blocks 1 and 6 both start at 4 \(duplicate"),
    (
        "length beyond blocks",
        lambda: _mutate(_set("sequences.0.length", 12)),
        r"sequence 0: layer 0: positions \[10, 12\) are not covered",
    ),
    (
        "block beyond length",
        lambda: _mutate(_set("sequences.0.length", 9)),
        r"layer 0: block 2 covers \[8, 10\), past the sequence length 9",
    ),
    (
        "negative sequence length",
        lambda: _mutate(_set("sequences.1.length", -7)),
        r"sequence 1: length must be in \[0, \d+\], got -7",
    ),
    (
        "first_position past length",
        lambda: _mutate(_set("sequences.0.first_position", 11)),
        r"sequence 0: first_position must be in \[0, 10\], got 11",
    ),
    ("negative first_position", lambda: _mutate(_set("sequences.1.first_position", -1)), r"first_position .* got -1"),
    (
        "evicted too much",
        lambda: _mutate(_set("sequences.1.first_position", 3)),
        r"sequence 1: layer 0: positions \[3, 4\) are not covered \(its first block starts at 4\)",
    ),
    (
        "layer without blocks",
        lambda: _mutate(_drop_layer_blocks),
        r"layer 1 has no blocks: positions \[0, 10\) are not covered",
    ),
    ("no layers", lambda: _mutate(lambda p: p.ClearField("layers")), r"layers must be a non-empty list"),
    ("no sequences", lambda: _mutate(lambda p: p.ClearField("sequences")), r"sequences must be a non-empty list"),
    ("zero kv_heads", lambda: _mutate(_set("layers.1.kv_heads", 0)), r"layer 1: kv_heads must be in \[1, \d+\], got 0"),
    ("negative head_size", lambda: _mutate(_set("layers.0.head_size", -3)), r"layer 0: head_size .* got -3"),
    ("layer dtype", lambda: _mutate(_set("layers.0.dtype", "int8")), r"layer 0: dtype must be one of .*got 'int8'"),
    (
        "duplicate input name",
        lambda: _mutate(_set("layers.1.value_name", "past_key_values.0.key")),
        r"layer 1: value_name 'past_key_values\.0\.key' is already the key_name of layer 0",
    ),
    ("empty input name", lambda: _mutate(_set("layers.0.key_name", "")), r"layer 0: key_name must not be empty"),
    (
        "owed layer out of range",
        lambda: _mutate(lambda p: p.owed_conversions.add(layer=2, role="key", format="int8")),
        r"owed conversion 0: layer must be in \[0, 1\], got 2",
    ),
    (
        "owed negative layer",
        lambda: _mutate(lambda p: p.owed_conversions.add(layer=-1, role="key", format="int8")),
        r"owed conversion 0: layer must be in \[0, 1\], got -1",
    ),
    (
        "owed role",
        lambda: _mutate(lambda p: p.owed_conversions.add(layer=0, role="query", format="int8")),
        r"owed conversion 0: role must be 'key' or 'value', got 'query'",
    ),
    (
        "owed format",
        lambda: _mutate(lambda p: p.owed_conversions.add(layer=0, role="key", format="int3")),
        r"owed conversion 0: unknown page format 'int3'",
    ),
    (
        "owed twice",
        lambda: _mutate(_owe_twice),
        r"owed conversion 1: a second conversion of layer 1's value pages",
    ),
    (
        "owed more than layers and roles",
        lambda: _mutate(lambda p: [p.owed_conversions.add(layer=0, role="key", format="int8") for _ in range(5)]),
        r"5 owed conversions: at most one per layer and role \(4\)",
    ),
    (
        "owed negative residual",
        lambda: _mutate(_set("owed_residual_tokens", -1)),
        r"owed_residual_tokens must be in \[0, \d+\], got -1",
    ),
]


def _owe_twice(proto):
    proto.owed_conversions.add(layer=1, role="value", format="int4")
    proto.owed_conversions.add(layer=1, role="value", format="int8")


@pytest.mark.parametrize("make, pattern", [case[1:] for case in SEMANTIC], ids=[case[0] for case in SEMANTIC])
def test_semantic_corruption_is_named(make, pattern):
    assert decode(encode(_base())) == _base()  # the base is valid: the corruption is what fails
    with pytest.raises(SerializationError, match=pattern):
        decode(make())


def test_owed_conversions_round_trip_and_leave_other_files_unchanged():
    plain = encode(_base())
    owing = _base()
    owing.owed = [OwedConversion(1, "key", "int4"), OwedConversion(0, "value", "uint8")]
    owing.owed_residual_tokens = 8
    blob = encode(owing)
    back = decode(blob)
    assert back.owed == owing.owed and back.owed_residual_tokens == 8
    assert decode(plain).owed == [] and decode(plain).owed_residual_tokens == 0
    # a snapshot that owes nothing writes no byte of the two fields: older readers read its files
    assert plain == encode(decode(plain)) and len(blob) > len(plain)


# --------------------------------------------------------------------------- snapshot rules (encode refuses)


def _breaks(edit: Callable[[CacheSnapshot], None]) -> CacheSnapshot:
    snapshot = _base()
    edit(snapshot)
    return snapshot


def _shorten_first_block(s: CacheSnapshot) -> None:
    block = s.sequences[0].blocks[0]
    block.length = 3
    block.key = PagePayload(block.key.format, block.key.data[:, :3])
    block.value = PagePayload(block.value.format, block.value.data[:, :3])


def _page_of(s: CacheSnapshot) -> PagePayload:
    return s.sequences[0].blocks[1].key


INVALID = [
    (
        "not full before last",
        _shorten_first_block,
        r"encode: sequence 0: layer 0: block 0 at start 0 holds 3 positions but is not the layer's last block",
    ),
    (
        "dtype mismatch",
        lambda s: setattr(_page_of(s), "data", _page_of(s).data.view(np.int16)),
        r"block 1: key page of format '\w+' must hold \w+ elements, got int16 \(dtype mismatch\)",
    ),
    (
        "float16 data as float32",
        lambda s: setattr(
            s.sequences[0].blocks[1], "value", PagePayload("float32", s.sequences[0].blocks[1].value.data)
        ),
        r"value page of format 'float32' must hold float32 elements, got float16",
    ),
    (
        "shape",
        lambda s: setattr(_page_of(s), "data", _page_of(s).data[:1]),
        r"key page data has shape \(1, 4, 3\), expected \(2, 4, 3\)",
    ),
    ("not an array", lambda s: setattr(_page_of(s), "data", [1.0]), r"key page data must be a numpy array, got list"),
    (
        "scale on float page",
        lambda s: setattr(_page_of(s), "scale", np.ones(2, np.float32)),
        r"key page of float format '\w+' must not have a scale",
    ),
    ("missing value", lambda s: setattr(s.sequences[1].blocks[0], "value", None), r"sequence 1 block 0: missing value"),
    (
        "bool layer index",
        lambda s: setattr(s.sequences[0].blocks[0], "layer", True),
        r"layer index must be an integer, got bool",
    ),
    (
        "start too large for int64",
        lambda s: setattr(s.sequences[0].blocks[0], "start", 2**64),
        r"start must be in \[0, 9223372036854775807\]",
    ),
    ("signature not UTF-8", lambda s: setattr(s, "model_signature", "bad\udc80"), r"model_signature .* not encodable"),
    ("sequence type", lambda s: s.sequences.append((3, [])), r"sequence 2: expected a SequenceRecord, got tuple"),
    ("layers not a list", lambda s: setattr(s, "layers", tuple(s.layers)), r"layers must be a non-empty list"),
    ("owed not a list", lambda s: setattr(s, "owed", (OwedConversion(0, "key", "int8"),)), r"owed must be a list"),
    (
        "owed entry type",
        lambda s: setattr(s, "owed", [(0, "key", "int8")]),
        r"encode: owed conversion 0: expected an OwedConversion, got tuple",
    ),
    (
        "owed bool layer",
        lambda s: setattr(s, "owed", [OwedConversion(True, "key", "int8")]),
        r"owed conversion 0: layer must be an integer, got bool",
    ),
]


@pytest.mark.parametrize("edit, pattern", [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_snapshot_is_not_encoded(edit, pattern):
    snapshot = _breaks(edit)
    with pytest.raises(SerializationError, match=pattern.replace("encode:", "validate:")):
        validate(snapshot)
    with pytest.raises(SerializationError, match=pattern):
        encode(snapshot)


def test_numpy_integers_and_evicted_blocks_are_accepted():
    snapshot = _base()
    snapshot.block_size = np.int64(4)
    snapshot.sequences[0].blocks[0].start = np.int32(0)
    # sequence 1 may also keep the block wholly below first_position 5
    full = _snapshot(np.random.default_rng(9), 4, [(2, 3), (2, 3)], [(7, 5)])
    snapshot.sequences[1] = full.sequences[0]
    validate(snapshot)
    got = decode(encode(snapshot))
    assert got == snapshot and isinstance(got.block_size, int) and len(got.sequences[1].blocks) == 4


@pytest.mark.parametrize("fmt", ["int8", "uint4"])
def test_zero_points_beyond_the_code_range_only_per_channel(fmt):
    """Per-channel parameters may carry a channel-zp header's integer zero points beyond the code range
    (|zp - z0| <= 128 * 2^16) and round trip; per-head ones must stay in the code range."""
    rng = np.random.default_rng(17)
    heads, n, d = 2, 4, 8
    z0 = 0 if fmt == "int8" else 8
    codes = rng.integers(0, 256, (heads, n, d * (8 if fmt == "int8" else 4) // 8), dtype=np.uint8)
    layers = [LayerSpec("k", "v", heads, d, "float32")]
    value = PagePayload("float32", rng.standard_normal((heads, n, d)).astype(np.float32))

    def snapshot(zero_point):
        scale = rng.uniform(0.01, 1, zero_point.size).astype(np.float32)
        key = PagePayload(fmt, codes, scale, zero_point.astype(np.float32))
        return CacheSnapshot(4, layers, [SequenceRecord(n, [BlockRecord(0, 0, n, key, value)])], "sig")

    wide = z0 + rng.integers(-128, 128, heads * d) * 2 ** rng.integers(0, 17)
    wide[0] = z0 + 127 * 2**16
    snap = snapshot(wide)
    assert decode(encode(snap)).sequences[0].blocks[0].key == snap.sequences[0].blocks[0].key  # bitwise
    reach = z0 + 128 * 2**16
    with pytest.raises(
        SerializationError,
        match=rf"key page zero points must be integers in "
        rf"\[{z0 - 128 * 2**16}, {reach}\] \({fmt}\)",
    ):
        encode(snapshot(np.where(np.arange(heads * d) == 3, reach + 1, wide)))
    with pytest.raises(SerializationError, match=rf"key page zero points must be integers in \[-?\d+, \d+\] \({fmt}\)"):
        encode(snapshot(np.full(heads, z0 + 200)))  # per head: the code range
    snap = snapshot(np.full(heads, z0 + 1))
    assert decode(encode(snap)).sequences[0].blocks[0].key == snap.sequences[0].blocks[0].key


# --------------------------------------------------------------------------- quantized pages and limits


def _quantized_proto() -> PagedCacheProto:
    """One layer (2 heads x 8), one 4-position block: int8 keys with a scale per head, uint4 values per channel."""
    rng = np.random.default_rng(23)
    key = PagePayload(
        "int8",
        rng.integers(0, 256, (2, 4, 8), dtype=np.uint8),
        np.array([0.5, 0.25], np.float32),
        np.array([0, -3], np.float32),
    )
    value = PagePayload(
        "uint4",
        rng.integers(0, 256, (2, 4, 4), dtype=np.uint8),
        rng.uniform(0.1, 1, 16).astype(np.float32),
        np.full(16, 8, np.float32),
    )
    snapshot = CacheSnapshot(
        4, [LayerSpec("k", "v", 2, 8, "float32")], [SequenceRecord(4, [BlockRecord(0, 0, 4, key, value)])], "sig"
    )
    proto = PagedCacheProto()
    proto.ParseFromString(encode(snapshot)[HEADER:])
    return proto


def _quantized_mutation(edit: Callable[[PagedCacheProto], None]) -> bytes:
    proto = _quantized_proto()
    edit(proto)
    return _frame(proto.SerializeToString())


def _floats(*values: float) -> bytes:
    return np.array(values, "<f4").tobytes()


QUANTIZED = [
    (
        "huge scale_dims count",
        lambda p: p.sequences[0].blocks[0].key.scale_dims.extend([2] * 100_000),
        r"key page has 100002 scale_dims, expected 2 \[kv_heads, 1 or head_size\]",
    ),
    (
        "scale_dims",
        lambda p: p.sequences[0].blocks[0].key.scale_dims.__setitem__(1, 3),
        r"key page scale_dims \[2, 3\] must be \[kv_heads 2, 1 or head_size 8\]",
    ),
    (
        "scale_dims of 2^63 - 1",
        lambda p: p.sequences[0].blocks[0].value.scale_dims.__setitem__(0, 2**63 - 1),
        r"value page scale_dims \[9223372036854775807, 8\] must be",
    ),
    (
        "short scale",
        _set("sequences.0.blocks.0.key.scale", _floats(0.5)),
        r"key page scale holds 4 bytes, expected 8 \(float32 per \[2, 1\]\)",
    ),
    (
        "long zero_point",
        _set("sequences.0.blocks.0.value.zero_point", _floats(*[8] * 17)),
        r"value page zero_point holds 68 bytes, expected 64",
    ),
    (
        "NaN scale",
        _set("sequences.0.blocks.0.key.scale", _floats(0.5, float("nan"))),
        r"key page scales must be finite and > 0",
    ),
    (
        "infinite scale",
        _set("sequences.0.blocks.0.key.scale", _floats(float("inf"), 0.5)),
        r"key page scales must be finite and > 0",
    ),
    ("zero scale", _set("sequences.0.blocks.0.key.scale", _floats(0.0, 0.5)), r"scales must be finite and > 0"),
    ("negative scale", _set("sequences.0.blocks.0.key.scale", _floats(-1.0, 0.5)), r"scales must be finite and > 0"),
    (
        "NaN zero point",
        _set("sequences.0.blocks.0.key.zero_point", _floats(float("nan"), 0)),
        r"key page zero points must be integers in \[-128, 127\] \(int8\)",
    ),
    (
        "fractional zero point",
        _set("sequences.0.blocks.0.key.zero_point", _floats(0.5, 0)),
        r"zero points must be integers",
    ),
    (
        "zero point out of range",
        _set("sequences.0.blocks.0.key.zero_point", _floats(128, 0)),
        r"key page zero points must be integers in \[-128, 127\] \(int8\)",
    ),
    (
        "codes too short",
        _set("sequences.0.blocks.0.key.data", b"\0" * 63),
        r"key page holds 63 code bytes, expected 64 = kv_heads 2 \* length 4 \* 8 bytes per token \(int8\)",
    ),
    (
        "format of other bits",
        _set("sequences.0.blocks.0.key.format", "int4"),
        r"key page holds 64 code bytes, "
        r"expected 32",
    ),
    (
        "quantized format as float",
        _set("sequences.0.blocks.0.key.format", "float16"),
        r"key page of format 'float16' carries quantization parameters",
    ),
    (
        "head_size not byte aligned",
        lambda p: (p.layers[0].__setattr__("head_size", 3), p.sequences[0].blocks[0].key.__setattr__("format", "int2")),
        r"key page of format 'int2' needs head_size \* 2 bits to fill whole bytes, head_size is 3",
    ),
]


@pytest.mark.parametrize("edit, pattern", [case[1:] for case in QUANTIZED], ids=[case[0] for case in QUANTIZED])
def test_quantized_page_corruption_is_named(edit, pattern):
    """A NaN or infinite scale in a file is rejected (page data NaN is kept); repeated counts are checked
    before the repeated field is read."""
    assert decode(_quantized_mutation(lambda p: None)).sequences[0].blocks[0].key.format == "int8"
    with pytest.raises(SerializationError, match=pattern):
        decode(_quantized_mutation(edit))


def test_inputs_above_max_bytes_are_refused_before_they_are_read(tmp_path):
    blob = encode(_small())
    assert decode(blob, max_bytes=len(blob)) == decode(blob)
    with pytest.raises(
        InputError,
        match=rf"decode: the input holds {len(blob)} bytes, more than "
        rf"max_bytes={len(blob) - 1} \(nothing was parsed\)",
    ) as err:
        decode(blob, max_bytes=len(blob) - 1)
    assert not isinstance(err.value, SerializationError)
    path = tmp_path / "huge.okv"
    with open(path, "wb") as f:
        f.write(blob)
        f.truncate(1 << 40)  # sparse: reading it whole would need a TiB
    with pytest.raises(
        InputError,
        match=rf"load\('.*huge\.okv'\): the input holds {1 << 40} bytes, more than "
        r"max_bytes=1000000",
    ):
        load(path, max_bytes=10**6)


def test_save_returns_the_bytes_it_wrote(tmp_path):
    snapshot = _small()
    path = tmp_path / "cache.okv"
    assert save(snapshot, path) == path.read_bytes() == encode(snapshot)


def _many(field: str, n: int) -> bytes:
    """A valid file's body with ``n`` more empty entries of the repeated ``field`` (2 bytes each)."""
    proto = _base_proto()
    for _ in range(n):
        getattr(proto, field).add()
    return _frame(proto.SerializeToString())


def _expected(**changes) -> serialize.Expectation:
    base = _base()
    fields = dict(block_size=4, layers=tuple(base.layers), max_sequences=None, model_signature="sig")
    return serialize.Expectation(**{**fields, **changes})


@pytest.mark.parametrize(
    "field, pattern",
    [
        ("sequences", r"decode: the saved cache has 100002 sequences, the state can hold at most 8 rows"),
        ("layers", r"decode: the saved cache has 100002 layers, the model has 2"),
    ],
)
def test_repeated_entries_a_reader_refuses_cost_no_python_objects(field, pattern):
    """2-byte entries used to become Python objects (~100x the file) before any check."""
    blob = _many(field, 100_000)
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=pattern):
            decode(blob, expected=_expected(max_sequences=8))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(blob)  # a copy of the body for the parser; 100002 entries as objects need ~100x


@pytest.mark.parametrize("expected", [None, _expected()], ids=["inspect", "unbounded-state"])
def test_empty_sequences_beyond_the_free_ones_must_come_with_bytes(expected):
    """Empty sequences (2 bytes each) used to become records and state rows of a few hundred bytes each
    with no bound when the reader has none (a state without max_pages): about 220x the file's size."""
    blob = _many("sequences", 100_000)
    tracemalloc.start()
    try:
        with pytest.raises(SerializationError, match=r"decode: 100002 sequences in \d+ bytes: at most 1024"):
            decode(blob, expected=expected)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(blob)
    few = _many("sequences", serialize.FREE_SEQUENCES - 2)  # the free ones: read
    assert len(decode(few).sequences) == serialize.FREE_SEQUENCES
    with pytest.raises(SerializationError, match="1025 sequences"):
        decode(_many("sequences", serialize.FREE_SEQUENCES - 1))


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"model_signature": "other"}, r"decode: the saved cache belongs to another model \(signature mismatch\)"),
        (
            {"block_size": 8},
            r"decode: the saved cache has block_size=4, the state uses 8; create the state with "
            r"block_size=4",
        ),
        ({"layers": tuple(_base().layers[:1])}, r"the saved cache has 2 layers, the model has 1"),
        (
            {
                "layers": (
                    _base().layers[0],
                    LayerSpec("past_key_values.1.key", "past_key_values.1.value", 2, 3, "float32"),
                )
            },
            r"saved layer 1 \(names, kv_heads, head_size, dtype\) \('past_key_values\.1\.key', 'past_key_values\.1\.value', "
            r"2, 3, 'float16'\) does not match the model's \(.*, 2, 3, 'float32'\)",
        ),
        ({"max_sequences": 1}, r"the saved cache has 2 sequences, the state can hold at most 1 rows"),
    ],
)
def test_a_file_that_does_not_fit_the_expectation_is_named(changes, pattern):
    blob = encode(_base())
    assert decode(blob, expected=_expected()) == _base()
    with pytest.raises(InputError, match=pattern) as err:
        decode(blob, expected=_expected(**changes))
    assert not isinstance(err.value, SerializationError)
    with pytest.raises(InputError, match=pattern.replace("decode", "check_expectation")):
        serialize.check_expectation(_base(), _expected(**changes))


_FIFO_CHILD = """
import os, sys
from onnxkv.cache.serialize import load
from onnxkv.errors import InputError
path = os.path.join(sys.argv[1], "fifo")
os.mkfifo(path)
for target in (path, sys.argv[1]):
    try:
        load(target)
    except InputError as exc:
        print(exc)
"""


def test_load_refuses_what_is_not_a_regular_file_without_waiting(tmp_path):
    """A FIFO used to block the reader until a writer came (then to read it to its end, unbounded)."""
    child = subprocess.run(
        [sys.executable, "-c", _FIFO_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert len(lines) == 2 and all("not a regular file" in line for line in lines), lines
