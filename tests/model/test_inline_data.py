"""Large inline tensors of a model file stay in the file (onnxkv.model.inline_data): memory-mapped as external
data of the file itself, the same values and the same session results as the parsed model, misaligned maps
copied aligned for the kernels, and files the scan cannot walk read by onnx.load as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from ort_loop import step_feeds

import onnxkv
from onnxkv import ModelError
from onnxkv.model import inline_data
from onnxkv.zoo.builders import MICRO, build_model

FAMILIES = ["gqa", "attention", "concat", "tensorscatter"]
LIMIT = 1024  # MIN_BYTES in these tests, so that MICRO's weights qualify


@pytest.fixture(autouse=True)
def small_limit(monkeypatch):
    monkeypatch.setattr(inline_data, "MIN_BYTES", LIMIT)


def _saved(tmp_path, family="gqa", name="model.onnx"):
    proto = build_model(family, MICRO, seed=3)
    path = tmp_path / name
    onnx.save(proto, str(path))
    return proto, path


@pytest.mark.parametrize("family", FAMILIES)
def test_large_inline_tensors_are_mapped_from_the_model_file(tmp_path, family):
    proto, path = _saved(tmp_path, family)
    model = onnxkv.load(path)
    large = {t.name for t in proto.graph.initializer if len(t.raw_data) >= LIMIT}
    assert large and set(model.external) == large
    for t in proto.graph.initializer:
        got = model.external.get(t.name)
        if t.name in large:
            assert isinstance(got, np.memmap) and Path(got.filename) == path.resolve() and not got.flags.writeable
            np.testing.assert_array_equal(got, numpy_helper.to_array(t))
        kept = next(k for k in model.proto.graph.initializer if k.name == t.name)
        assert kept.data_location == (onnx.TensorProto.EXTERNAL if t.name in large else onnx.TensorProto.DEFAULT)
        assert kept.dims == t.dims and kept.data_type == t.data_type
        assert len(kept.raw_data) == (0 if t.name in large else len(t.raw_data))
    # the proto holds what onnx.load gives for the same model saved with external data in its own file
    assert model.proto.graph.node == proto.graph.node and model.proto.opset_import == proto.opset_import


@pytest.mark.parametrize("family", FAMILIES)
def test_sessions_give_the_parsed_models_results(tmp_path, family):
    proto, path = _saved(tmp_path, family)
    model = onnxkv.load(path)
    assert any(not a.flags.aligned for a in model.external.values())  # the kernels' aligned copies are used
    prompt = np.array([[3, 5, 7, 11, 13]])
    got = onnxkv.generate(onnxkv.Session(model, threads=1), prompt, max_new_tokens=6, eos_token_id=[], temperature=0)
    want = onnxkv.generate(onnxkv.Session(proto, threads=1), prompt, max_new_tokens=6, eos_token_id=[], temperature=0)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(
        _logits(onnxkv.Session(model, threads=1), prompt), _logits(onnxkv.Session(proto), prompt)
    )


def _logits(session, prompt):
    feeds, _ = step_feeds(session, prompt).first()
    return session.run(feeds, [session.model.io.logits])[session.model.io.logits]


def test_kernels_read_aligned_copies_and_release_the_maps_pages():
    from onnxkv.plan.constant_data import kernel_view

    raw = np.arange(1 << 19, dtype=np.float32)
    buf = np.frombuffer(b"\0" + raw.tobytes(), np.uint8)[1:].view(np.float32)  # one byte off: misaligned
    assert not buf.flags.aligned
    copy = kernel_view(buf)
    assert copy.flags.aligned and not copy.flags.writeable
    np.testing.assert_array_equal(copy, raw)
    assert kernel_view(raw) is raw and kernel_view(None) is None


def test_a_symlinked_model_file_maps_its_target(tmp_path):
    """The layout of a Hugging Face cache snapshot: the model file is a link to a blob elsewhere."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    proto, blob = _saved(blobs, name="0123abcd")
    (snapshot / "model.onnx").symlink_to(blob)
    model = onnxkv.load(snapshot / "model.onnx")
    assert model.external and all(Path(a.filename) == blob.resolve() for a in model.external.values())


def test_files_the_scan_cannot_walk_are_read_by_onnx_load(tmp_path):
    proto, path = _saved(tmp_path)
    data = path.read_bytes()
    # a second graph field (protobuf merges it into the first): left to onnx.load
    graph = onnx.GraphProto(name="g2")
    merged = tmp_path / "merged.onnx"
    merged.write_bytes(data + onnx.ModelProto(graph=graph).SerializeToString())
    assert inline_data.read_model(merged) is None
    assert onnxkv.load(merged).proto.graph.name == "g2" and not onnxkv.load(merged).external
    # truncated: the same error as before
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: len(data) // 2])
    assert inline_data.read_model(cut) is None
    with pytest.raises(ModelError, match="cannot read ONNX model"):
        onnxkv.load(cut)


def test_tensors_with_other_data_fields_stay_inline(tmp_path):
    """A tensor holding float_data beside raw_data, or two raw_data fields, is left for the checks that
    refuse or read it as onnx.load parses it."""
    proto, path = _saved(tmp_path)
    big = next(t for t in proto.graph.initializer if len(t.raw_data) >= LIMIT)
    big.float_data.append(1.0)
    odd = tmp_path / "odd.onnx"
    odd.write_bytes(proto.SerializeToString())
    model = onnxkv.load(odd)
    assert big.name not in model.external
    kept = next(t for t in model.proto.graph.initializer if t.name == big.name)
    assert kept.raw_data == big.raw_data and list(kept.float_data) == [1.0]


def test_damaged_files_load_or_raise_model_errors(tmp_path):
    """Bytes changed at random (a length, a tag, a payload): load returns a model whose mapped tensors lie
    inside the file, or raises an onnxkv error; never another exception."""
    _, path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(0)
    damaged = tmp_path / "damaged.onnx"
    for _ in range(150):
        copy = bytearray(data)
        for i in rng.integers(0, len(copy), int(rng.integers(1, 4))):
            copy[i] = int(rng.integers(0, 256))
        damaged.write_bytes(copy)
        try:
            model = onnxkv.load(damaged)
        except (ModelError, onnxkv.UnsupportedOperatorError):
            continue
        for a in model.external.values():
            assert a.offset + a.nbytes <= len(copy)


def test_aligned_copies_live_only_while_a_kernel_or_the_plans_values_hold_them(tmp_path):
    """A misaligned weight a kernel packs is copied for the packing only: no copy of it outlives the build."""
    _, path = _saved(tmp_path)
    session = onnxkv.Session(path, threads=1)
    plan, model = session.plan, session.model
    misaligned = {name for name, a in model.external.items() if not a.flags.aligned}
    absorbed = {n for n in misaligned if n in plan.slot_of and plan._template[plan.slot_of[n]] is None}
    kept = misaligned - absorbed
    assert absorbed and kept  # packed weights, and tables the kernels read as they are (rotary caches)
    assert set(plan.build_context._aligned.keys()) == kept
    for name in kept:
        value = plan._template[plan.slot_of[name]]
        assert value.flags.aligned and value is plan.build_context._aligned[name]


def test_what_the_walk_leaves_to_onnx_load_behaves_as_before(tmp_path):
    """Found by fuzzing: a duplicated initializer name, raw_data of another size than its dims give, a type
    onnxkv does not map, an over-long varint protobuf refuses, a text or JSON file name and a file reached
    by no name all give what onnx.load gives (the same values or the same refusal)."""
    proto = build_model("gqa", MICRO, seed=3)
    big = [t for t in proto.graph.initializer if len(t.raw_data) >= LIMIT]
    dup = onnx.TensorProto()
    dup.CopyFrom(big[0])
    dup.raw_data = (-numpy_helper.to_array(big[0])).tobytes()
    proto.graph.initializer.append(dup)  # the same name twice: the plan takes the last, as before
    big[1].dims[0] += 1  # dims needing more bytes than raw_data holds
    path = tmp_path / "model.onnx"
    onnx.save(proto, str(path))
    model = onnxkv.load(path)
    assert big[0].name not in model.external and big[1].name not in model.external and big[2].name in model.external
    with pytest.raises(ModelError, match=f"initializer '{big[1].name}' holds .* bytes of raw_data"):
        onnxkv.Session(model)
    # a raw_data length written as an over-long (6-byte) varint: protobuf refuses it, so load does
    data = (tmp_path / "model.onnx").read_bytes()
    tensor = big[2].SerializeToString()
    raw = len(big[2].raw_data)
    header = bytes([0x4A]) + _varint(raw)
    padded = bytes([0x4A]) + _varint(raw, pad=6)
    at = data.index(tensor) + tensor.index(header + big[2].raw_data[:16])
    bad = tmp_path / "overlong.onnx"
    bad.write_bytes(data[:at] + padded + data[at + len(header) :])
    with pytest.raises(ModelError, match="cannot read ONNX model"):
        onnxkv.load(bad)
    # a binary model named as text: onnx.load reads it as JSON and fails
    (tmp_path / "model.json").write_bytes(data)
    with pytest.raises(ModelError, match="cannot read ONNX model"):
        onnxkv.load(tmp_path / "model.json")
    # a file reached through a descriptor whose file has no name left: parsed whole
    with open(path, "rb") as f:
        path.unlink()
        assert not onnxkv.load(f"/proc/self/fd/{f.fileno()}").external


def _varint(value: int, pad: int = 0) -> bytes:
    """``value`` as a protobuf varint, made ``pad`` bytes long with continuation bytes when pad is given."""
    out = bytearray()
    while True:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
        if not value and len(out) >= max(pad, 1):
            break
    out[-1] &= 0x7F
    return bytes(out)


def test_an_initializer_defined_twice_is_a_model_error(tmp_path):
    """Found by fuzzing: with one copy mapped from external data and one inline, the plan read the first
    for both, where the parsed model takes the last. A value has one producer: refused, whatever the storage."""
    proto = build_model("gqa", MICRO, seed=3)
    dup = onnx.TensorProto()
    dup.CopyFrom(proto.graph.initializer[0])
    proto.graph.initializer.append(dup)
    with pytest.raises(ModelError, match=f"initializer '{dup.name}' is defined twice"):
        onnxkv.Session(proto)
    onnx.save(proto, str(tmp_path / "model.onnx"))
    with pytest.raises(ModelError, match="is defined twice"):
        onnxkv.Session(tmp_path / "model.onnx")
