"""Loading files and folders, recognising cache conventions, rejecting bad models."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxkv
from onnxkv import ModelError, UnsupportedOperatorError
from onnxkv.zoo.builders import MICRO, build_model, save_genai_folder


@pytest.mark.parametrize(
    "family,kind",
    [
        ("gqa", "group_query_attention"),
        ("attention", "attention"),
        ("concat", "concat"),
        ("tensorscatter", "tensor_scatter"),
    ],
)
def test_conventions_are_recognised(family, kind):
    m = onnxkv.load(build_model(family, MICRO))
    c = m.convention
    assert c.kind == kind
    assert [layer.index for layer in c.layers] == list(range(MICRO.num_layers))
    assert c.layers[0].past_key == "past_key_values.0.key" and c.layers[1].present_value == "present.1.value"
    assert c.kv_heads == MICRO.num_kv_heads and c.head_size == MICRO.head_size
    assert m.io.input_ids == "input_ids" and m.io.logits == "logits"
    if kind == "tensor_scatter":
        assert c.capacity == MICRO.max_length
    assert kind in c.describe()


def test_gqa_attributes_are_reported():
    c = onnxkv.load(build_model("gqa", MICRO)).convention
    assert c.attributes["do_rotary"] == 1 and c.attributes["local_window_size"] == -1
    assert c.num_heads == MICRO.num_heads


def test_genai_folder_reads_config(tmp_path):
    save_genai_folder(build_model("gqa", MICRO), MICRO, tmp_path)
    m = onnxkv.load(tmp_path)
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    assert m.genai_config == cfg
    assert m.max_length == cfg["search"]["max_length"]
    assert m.vocab_size == MICRO.vocab_size
    assert m.eos_token_id == [MICRO.eos_token_id]


def test_external_data_is_loaded(tmp_path):
    proto = build_model("concat", MICRO)
    path = tmp_path / "m.onnx"
    saved = onnx.ModelProto()
    saved.CopyFrom(proto)
    onnx.save(
        saved,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="m.onnx.data",
        size_threshold=0,
    )
    assert (tmp_path / "m.onnx.data").exists()
    loaded = onnxkv.load(path)
    # weights are memory-mapped from the data file, not copied into the proto
    assert set(loaded.external) == {i.name for i in proto.graph.initializer}
    w = next(iter(loaded.external.values()))
    assert isinstance(w, np.memmap) and not w.flags.writeable
    assert all(not i.raw_data for i in loaded.proto.graph.initializer)
    a = onnxkv.Session(loaded, threads=1)
    b = onnxkv.Session(proto, threads=1)
    feeds = {
        "input_ids": np.array([[1, 2]]),
        "attention_mask": np.ones((1, 2), np.int64),
        "position_ids": np.array([[0, 1]]),
    }
    for i in range(MICRO.num_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, MICRO.num_kv_heads, 0, MICRO.head_size), np.float32)
    np.testing.assert_array_equal(a.run(feeds)["logits"], b.run(feeds)["logits"])


def test_unknown_domain_is_rejected_at_load_naming_nodes():
    node = helper.make_node("Foo", ["x"], ["y"], domain="com.example", name="strange_node")
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedOperatorError, match="strange_node.*com.example::Foo"):
        onnxkv.load(m)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        onnxkv.load(tmp_path / "nope.onnx")
    with pytest.raises(FileNotFoundError):
        onnxkv.load(tmp_path)  # empty folder
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelError):
        onnxkv.load(bad)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "genai_config.json").write_text("{broken")
    with pytest.raises(ModelError, match="not valid JSON"):
        onnxkv.load(d)


def test_model_without_cache_is_none():
    node = helper.make_node("Neg", ["x"], ["y"])
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    assert onnxkv.load(helper.make_model(g)).convention.kind == "none"


# -- hostile model folders ---------------------------------------------------------------------------------
def _external_model(folder, location, offset=None, length=None, dims=(4,), data_type=TensorProto.FLOAT, extra=()):
    """model.onnx in ``folder``: y = x + w, w stored as external data at ``location`` (entries as given)."""
    w = onnx.TensorProto(name="w", data_type=data_type, dims=list(dims), data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", offset), ("length", length), *extra):
        if value is not None:
            w.external_data.add(key=key, value=value)
    elem = TensorProto.FLOAT if data_type == TensorProto.FLOAT else data_type
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", elem, list(dims))],
        [helper.make_tensor_value_info("y", elem, list(dims))],
        [w],
    )
    path = folder / "model.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


def _secret(tmp_path):
    """A file outside the model folder ``tmp_path / 'model'`` (16 bytes: four float32)."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    return secret, folder


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "symlink_dir", "passwd"])
def test_external_data_outside_the_model_folder_is_rejected(tmp_path, kind):
    secret, folder = _secret(tmp_path)
    if kind == "dotdot":
        location = "../secret.bin"
    elif kind == "absolute":
        location = str(secret)
    elif kind == "symlink":
        (folder / "w.bin").symlink_to(secret)
        location = "w.bin"
    elif kind == "symlink_dir":
        (folder / "data").symlink_to(tmp_path)
        location = "data/secret.bin"
    else:
        (folder / "w.bin").symlink_to("/etc/passwd")
        location = "w.bin"
    path = _external_model(folder, location, length=None if kind == "passwd" else "16")
    with pytest.raises(ModelError, match=r"initializer 'w'.*" + re.escape(repr(location))):
        onnxkv.load(path)


@pytest.mark.parametrize("location", ["sub/../w.bin", "", "w.bin\x00x", "x" * 5000])
def test_external_locations_with_dotdot_empty_or_nul_are_rejected(tmp_path, location):
    (tmp_path / "w.bin").write_bytes(bytes(16))
    (tmp_path / "sub").mkdir()
    with pytest.raises(ModelError, match="initializer 'w'"):
        onnxkv.load(_external_model(tmp_path, location))


def test_symlinked_model_folder_and_cache_snapshot_layouts_load(tmp_path):
    # The folder itself a symlink: files resolve inside the resolved folder.
    real = tmp_path / "real"
    real.mkdir()
    (real / "w.bin").write_bytes(np.full(4, 2, np.float32).tobytes())
    _external_model(real, "w.bin")
    (tmp_path / "alias").symlink_to(real)
    x = np.ones(4, np.float32)
    assert onnxkv.Session(tmp_path / "alias", threads=1).run({"x": x})["y"].tolist() == [3.0] * 4
    # A Hugging Face cache snapshot: model and data are symlinks into a blobs folder.
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    (blobs / "data-sha").write_bytes(np.full(4, 5, np.float32).tobytes())
    _external_model(blobs, "w.bin")
    (blobs / "model.onnx").rename(blobs / "model-sha")
    (snap / "model.onnx").symlink_to(blobs / "model-sha")
    (snap / "w.bin").symlink_to(blobs / "data-sha")
    assert onnxkv.Session(snap / "model.onnx", threads=1).run({"x": x})["y"].tolist() == [6.0] * 4


def test_external_data_location_must_be_a_regular_file(tmp_path):
    (tmp_path / "w.bin").mkdir()
    with pytest.raises(ModelError, match=r"initializer 'w'.*not a regular file"):
        onnxkv.load(_external_model(tmp_path, "w.bin"))
    with pytest.raises(ModelError, match=r"initializer 'w'.*'missing.bin'.*does not exist"):
        onnxkv.load(_external_model(tmp_path, "missing.bin"))


@pytest.mark.parametrize(
    "offset,length,match",
    [
        ("abc", None, r"offset 'abc'"),
        ("-4", None, r"offset '-4'"),
        ("1e3", None, r"offset '1e3'"),
        ("9" * 40, None, r"offset '9999"),
        (None, "ten", r"length 'ten'"),
        (None, "-16", r"length '-16'"),
        (None, "12", r"declares length 12.*need 16 bytes"),
        (None, "18446744073709551600", r"length .18446744073709551600.; expected a non-negative decimal"),
        (None, "9223372036854775808", r"declares length 9223372036854775808"),
        ("8", None, r"16 bytes at offset 8\) does not fit.*\(16 bytes\)"),
        ("9223372036854775807", "16", r"does not fit"),
    ],
)
def test_external_offset_and_length_are_checked_before_reading(tmp_path, offset, length, match):
    (tmp_path / "w.bin").write_bytes(bytes(16))
    with pytest.raises(ModelError, match=r"initializer 'w'.*" + match):
        onnxkv.load(_external_model(tmp_path, "w.bin", offset, length))


def test_external_tensor_larger_than_its_file_is_rejected_without_allocating(tmp_path):
    (tmp_path / "w.bin").write_bytes(bytes(16))
    with pytest.raises(ModelError, match=r"initializer 'w'.*\(4398046511104 bytes at offset 0\) does not fit"):
        onnxkv.load(_external_model(tmp_path, "w.bin", dims=(1 << 40,)))
    with pytest.raises(ModelError, match=r"initializer 'w'.*dims \[-4\]"):
        onnxkv.load(_external_model(tmp_path, "w.bin", dims=(-4,)))


def test_external_entries_with_unknown_or_repeated_keys_are_rejected(tmp_path):
    (tmp_path / "w.bin").write_bytes(bytes(16))
    with pytest.raises(ModelError, match=r"initializer 'w'.*'location' twice"):
        onnxkv.load(_external_model(tmp_path, "w.bin", extra=[("location", "../secret.bin")]))
    with pytest.raises(ModelError, match=r"initializer 'w'.*unknown key 'owner'"):
        onnxkv.load(_external_model(tmp_path, "w.bin", extra=[("owner", "x")]))


def test_external_data_of_a_type_that_is_not_mapped_is_read_and_checked(tmp_path):
    secret, folder = _secret(tmp_path)
    with pytest.raises(ModelError, match=r"initializer 'w'.*'\.\.' components"):
        onnxkv.load(_external_model(folder, "../secret.bin", data_type=TensorProto.BFLOAT16))
    (folder / "w.bin").write_bytes(np.array([0x3F80] * 4, np.uint16).tobytes())  # bfloat16 1.0
    m = onnxkv.load(_external_model(folder, "w.bin", data_type=TensorProto.BFLOAT16))
    w = m.proto.graph.initializer[0]
    assert w.data_location == TensorProto.DEFAULT and len(w.raw_data) == 8 and "w" not in m.external


def _genai_folder(tmp_path, **changes):
    folder = tmp_path / "genai"
    save_genai_folder(build_model("gqa", MICRO), MICRO, folder)
    cfg = json.loads((folder / "genai_config.json").read_text())
    for key, value in changes.items():
        section = cfg
        *parents, last = key.split(".")
        for p in parents:
            section = section[p]
        section[last] = value
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    "filename,match",
    [
        ("../model.onnx", "'..' components"),
        ("/etc/passwd", "absolute paths"),
        ("link.onnx", "outside the model's folder"),
        (7, "must be a string"),
    ],
)
def test_genai_decoder_filename_must_stay_inside_the_folder(tmp_path, filename, match):
    folder = _genai_folder(tmp_path, **{"model.decoder.filename": filename})
    (tmp_path / "model.onnx").write_bytes((folder / "model.onnx").read_bytes())
    (folder / "link.onnx").symlink_to(tmp_path / "model.onnx")
    with pytest.raises(ModelError, match=r"model\.decoder\.filename.*" + match):
        onnxkv.load(folder)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("model.vocab_size", "97", r"model\.vocab_size must be an int in \[1, 2147483648\), got '97'"),
        ("model.vocab_size", 97.0, r"model\.vocab_size .* got 97\.0"),
        ("model.vocab_size", -3, r"model\.vocab_size .* got -3"),
        ("model.eos_token_id", [1, "a"], r"model\.eos_token_id\[1\] must be an int in \[0, 97\), got 'a'"),
        ("model.eos_token_id", [1, True], r"model\.eos_token_id\[1\] .* got True"),
        ("model.eos_token_id", 500, r"model\.eos_token_id must be an int in \[0, 97\), got 500"),
        ("model.pad_token_id", -1, r"model\.pad_token_id .* got -1"),
        ("model.bos_token_id", "0", r"model\.bos_token_id .* got '0'"),
        ("model.context_length", 0, r"model\.context_length .* got 0"),
        ("search.max_length", [256], r"search\.max_length .* got \[256\]"),
        ("model.decoder.head_size", -16, r"model\.decoder\.head_size .* got -16"),
        ("model.decoder.num_key_value_heads", "2", r"model\.decoder\.num_key_value_heads .* got '2'"),
        ("model.decoder.inputs", ["input_ids"], r"model\.decoder\.inputs must be a JSON object"),
        ("model.decoder.outputs", {"logits": 3}, r"model\.decoder\.outputs\.logits must be a string, got 3"),
        (
            "model.decoder.outputs",
            {"logits": "present.0.key"},
            r"model\.decoder\.outputs\.logits 'present\.0\.key' is a KV-cache output of the graph",
        ),
        (
            "model.decoder.outputs",
            {"logits": "scores"},
            r"model\.decoder\.outputs\.logits 'scores' is not an output of the graph \(outputs: logits\)",
        ),
        ("model.decoder", "model.onnx", r"model\.decoder must be a JSON object"),
        ("search", 3, r"search must be a JSON object"),
    ],
)
def test_genai_config_values_of_the_wrong_type_name_the_key(tmp_path, key, value, match):
    folder = _genai_folder(tmp_path, **{key: value})
    with pytest.raises(ModelError, match=match):
        onnxkv.load(folder)


def test_malformed_genai_config_is_a_model_error_for_files_and_folders(tmp_path):
    folder = _genai_folder(tmp_path)
    for text in ("{broken", "[1, 2]", "\xff\xfe", "[" * 100_000):
        (folder / "genai_config.json").write_bytes(text.encode("latin-1"))
        for target in (folder, folder / "model.onnx"):
            with pytest.raises(ModelError, match="genai_config.json"):
                onnxkv.load(target)


def test_null_config_sections_count_as_absent(tmp_path):
    folder = _genai_folder(tmp_path, **{"model.decoder.inputs": None, "model.decoder.filename": None, "search": None})
    m = onnxkv.load(folder)
    assert m.io.input_ids == "input_ids" and m.path.name == "model.onnx" and m.max_length == MICRO.max_length


def test_files_that_never_end_are_not_read(tmp_path):
    folder = _genai_folder(tmp_path)
    (folder / "genai_config.json").unlink()
    (folder / "genai_config.json").symlink_to("/dev/zero")
    with pytest.raises(ModelError, match="genai_config.json.*not a regular file"):
        onnxkv.load(folder)
    (folder / "genai_config.json").unlink()
    (folder / "model.onnx").unlink()
    os.mkfifo(folder / "model.onnx")
    with pytest.raises(ModelError, match="model.onnx.*not a regular file"):
        onnxkv.load(folder)


def test_oversized_genai_config_is_rejected(tmp_path):
    folder = _genai_folder(tmp_path)
    with open(folder / "genai_config.json", "r+b") as f:
        f.truncate(17 << 20)  # sparse: no 17 MB written
    with pytest.raises(ModelError, match="genai_config.json is larger than 16777216 bytes"):
        onnxkv.load(folder)


def test_missing_decoder_file_is_file_not_found(tmp_path):
    folder = _genai_folder(tmp_path, **{"model.decoder.filename": "other.onnx"})
    with pytest.raises(FileNotFoundError, match=r"model\.decoder\.filename.*'other.onnx', which does not exist"):
        onnxkv.load(folder)


@pytest.mark.parametrize(
    "family, kind, op",
    [
        ("gqa", "cos_cache", "GroupQueryAttention"),
        ("attention", "cos_cache", "RotaryEmbedding"),
        ("concat", "table", "Gather"),
    ],
)
def test_position_tables_name_the_tables_that_bound_positions(family, kind, op):
    """Each table the graph indexes by position once, named with the first node that reads it."""
    model = onnxkv.load(build_model(family, dataclasses.replace(MICRO, max_length=40), seed=0))
    assert model.max_length is None  # no genai_config.json: the tables are the only bound
    tables = model.position_tables
    assert tables and set(tables.values()) == {40}
    assert all(re.fullmatch(rf"{kind} '\w+' of {op} '[^']+'", k) for k in tables)
    assert len(tables) == (2 if family == "concat" else 1)  # cos and sin gathered apart; one cos_cache


def test_position_tables_leave_out_a_table_a_feed_may_replace():
    proto = build_model("gqa", MICRO, seed=0)
    cos = next(t for t in proto.graph.initializer if t.name == "cos_cache")
    assert onnxkv.load(proto).position_tables
    proto.graph.input.append(helper.make_tensor_value_info("cos_cache", TensorProto.FLOAT, list(cos.dims)))
    assert onnxkv.load(proto).position_tables == {}


# -- hostile folders a fuzzing helper found wanting (each raised a raw exception, or dropped the config) ------
def test_an_external_tensor_whose_dims_no_array_has_is_refused(tmp_path):
    """dims [3, 0, 2**63 - 1]: zero bytes pass the offset and length checks, then NumPy refused the shape."""
    save_genai_folder(build_model("gqa", MICRO, seed=1), MICRO, tmp_path)
    model = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    t = next(t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL)
    del t.dims[:]
    t.dims.extend([3, 0, 2**63 - 1])
    for e in t.external_data:
        if e.key == "length":
            e.value = "0"
    onnx.save(model, str(tmp_path / "model.onnx"))
    with pytest.raises(ModelError, match=r"has dims \[3, 0, 9223372036854775807\]: no array has that shape"):
        onnxkv.load(tmp_path)


@pytest.mark.parametrize("version", [0, 2**31, 2**62])
def test_an_opset_version_outside_int32_is_refused(version):
    model = build_model("gqa", MICRO, seed=1)
    model.opset_import[0].version = version
    with pytest.raises(ModelError, match=f"the model imports opset {version} of domain 'ai.onnx'"):
        onnxkv.load(model)


@pytest.mark.parametrize("elem", [30, 99])
def test_a_graph_input_of_an_unknown_element_type_is_refused(elem):
    model = build_model("gqa", MICRO, seed=1)
    model.graph.input[0].type.tensor_type.elem_type = elem
    with pytest.raises(ModelError, match=f"graph input '{model.graph.input[0].name}' has element type {elem}"):
        onnxkv.Session(model, threads=1)


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_a_genai_config_link_that_leads_nowhere_is_refused(tmp_path, kind):
    """It was taken for an absent config: the folder loaded without what it states (a sliding window)."""
    save_genai_folder(build_model("gqa", MICRO, seed=1), MICRO, tmp_path)
    (tmp_path / "genai_config.json").unlink()
    (tmp_path / "genai_config.json").symlink_to("genai_config.json" if kind == "loop" else tmp_path / "nowhere.json")
    for path in (tmp_path, tmp_path / "model.onnx"):
        with pytest.raises(ModelError, match="genai_config.json is a symbolic link that resolves to no file"):
            onnxkv.load(path)


def test_a_model_file_link_that_leads_nowhere_is_named(tmp_path):
    """A model.onnx symlink loop was reported as a missing file (FileNotFoundError "no such model file")."""
    (tmp_path / "model.onnx").symlink_to("model.onnx")
    for path in (tmp_path / "model.onnx", tmp_path):  # the file itself, and a folder without genai_config.json
        with pytest.raises(ModelError, match="model.onnx is a symbolic link that resolves to no file"):
            onnxkv.load(path)
