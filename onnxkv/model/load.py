"""Loading a decoder model: an ``.onnx`` file or an ONNX Runtime GenAI folder.

:func:`load` returns a :class:`Model`: the ``ModelProto`` (external data
loaded), where it came from, its recognised cache convention, the names of
its conventional inputs/outputs, and the generation settings of a
``genai_config.json`` when one is present.  Operators in unknown domains are
rejected here, naming the nodes.  A sliding window that ``genai_config.json``
states (``model.decoder.sliding_window``) is written into the graph's
GroupQueryAttention nodes, or the model is refused when onnxkv cannot apply
it (:mod:`onnxkv.model.windows`).

A model folder is hostile input: every file name read from it (external-data
locations, ``model.decoder.filename``) must stay inside it, every
external-data entry must fit its file, every key of ``genai_config.json``
onnxkv reads must have the type and range it needs, and every attribute and
stored tensor must be well formed (:mod:`onnxkv.model.tensors`), or
:func:`load` raises :class:`~onnxkv.errors.ModelError` naming the tensor,
key or node and the offending value, before anything is read from a data file.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnxkv.errors import ModelError, UnsupportedOperatorError
from onnxkv.model.config_files import BYTES_LIMIT, config_int, read_object
from onnxkv.model.convention import CacheConvention, recognize_cache
from onnxkv.model.hf_config import read_hf_settings
from onnxkv.model.inline_data import read_model
from onnxkv.model.tensors import check_attributes, data_nbytes, element_count
from onnxkv.model.well_formed import check_arity, check_text
from onnxkv.model.windows import apply_config_window

__all__ = ["Model", "ModelIO", "load", "KNOWN_DOMAINS"]

#: Operator domains onnxkv knows; anything else is an error at load time.
KNOWN_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft", "ai.onnxkv", "ai.rt"})


@dataclass
class ModelIO:
    """Names of the conventional decoder inputs/outputs (None when absent)."""

    input_ids: str | None = None
    attention_mask: str | None = None
    position_ids: str | None = None
    logits: str | None = None
    other_inputs: list[str] = field(default_factory=list)


@dataclass
class Model:
    """A loaded decoder model.

    Attributes:
        proto: the ONNX model (do not mutate).  Initializers stored as
            external data are *not* copied into it: they are memory-mapped
            read-only from their files and held in ``external``.
        path: the file it was read from (None for an in-memory model).
        convention: how the graph threads its KV cache.
        io: names of input_ids / attention_mask / position_ids / logits.
        genai_config: the parsed ``genai_config.json`` or None.
        max_length, vocab_size, bos_token_id, eos_token_id, pad_token_id:
            generation settings from genai_config, else from the Hugging Face
            ``config.json`` / ``generation_config.json`` next to the file or
            its folder (:mod:`onnxkv.model.hf_config`; None when unknown);
            ``eos_token_id`` is a list.
        external: initializer name -> read-only array mapped from its
            external data file (zero-copy: the weights are in memory once).
    """

    proto: onnx.ModelProto
    path: Path | None
    convention: CacheConvention
    io: ModelIO
    genai_config: dict | None = None
    max_length: int | None = None
    vocab_size: int | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    external: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def inputs(self) -> list[onnx.ValueInfoProto]:
        return list(self.proto.graph.input)

    @property
    def outputs(self) -> list[onnx.ValueInfoProto]:
        return list(self.proto.graph.output)

    @property
    def token_limit(self) -> int | None:
        """Exclusive upper bound of the token ids ``input_ids`` may hold (None when unknown).

        The smallest of :attr:`vocab_size` and, when ``input_ids`` is the
        indices of a ``Gather`` over an initializer (the embedding table),
        that table's rows.  O(nodes): callers keep the value.
        """
        limits = [] if self.vocab_size is None else [self.vocab_size]
        fed = {i.name for i in self.proto.graph.input}  # an initializer that is also an input may be replaced
        dims = {t.name: t.dims for t in self.proto.graph.initializer if t.name not in fed}
        for n in self.proto.graph.node:
            if (
                n.op_type == "Gather"
                and n.domain in ("", "ai.onnx")
                and len(n.input) == 2
                and n.input[1] == self.io.input_ids
                and len(dims.get(n.input[0], ())) >= 1
                and all(a.name != "axis" or a.i == 0 for a in n.attribute)
            ):
                limits.append(int(dims[n.input[0]][0]))
        return min(limits) if limits else None

    @property
    def position_tables(self) -> dict[str, int]:
        """The tables the graph indexes by absolute position, each with its rows: an exclusive upper bound
        of the positions of a sequence (empty when none does; :attr:`max_length` is another bound).

        Such tables: the ``cos_cache`` initializer of a GroupQueryAttention
        with ``do_rotary=1`` or of a RotaryEmbedding given position ids
        (com.microsoft and ONNX), and an initializer gathered (axis 0) by the
        ``position_ids`` input (rotary tables of torch exports, learned
        absolute positions).  Keys name the table and the first node reading
        it: ``"cos_cache 'name' of GroupQueryAttention 'node'"``.  A prompt
        plus new tokens longer than a bound has positions the model cannot
        take.  Angles computed in the graph bound nothing.  O(nodes): callers
        keep the value.
        """
        limits: dict[str, int] = {}
        seen: set[str] = set()
        fed = {i.name for i in self.proto.graph.input}  # an initializer that is also an input may be replaced
        dims = {t.name: t.dims for t in self.proto.graph.initializer if t.name not in fed}
        for n in self.proto.graph.node:
            ins = list(n.input)
            attrs = {a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT}
            table, kind = None, "cos_cache"
            if n.domain == "com.microsoft" and n.op_type == "GroupQueryAttention" and attrs.get("do_rotary", 0):
                table = ins[7] if len(ins) > 7 else None
            elif n.domain == "com.microsoft" and n.op_type == "RotaryEmbedding":
                table = ins[2] if len(ins) > 2 else None
            elif n.domain in ("", "ai.onnx") and n.op_type == "RotaryEmbedding" and len(ins) > 3 and ins[3]:
                table = ins[1]
            elif (
                n.domain in ("", "ai.onnx")
                and n.op_type == "Gather"
                and len(ins) == 2
                and self.io.position_ids is not None
                and ins[1] == self.io.position_ids
                and attrs.get("axis", 0) == 0
            ):
                table, kind = ins[0], "table"
            if table and table not in seen and len(dims.get(table, ())) >= 1:
                seen.add(table)
                limits[f"{kind} '{table}' of {n.op_type} '{n.name}'"] = int(dims[table][0])
        return limits


#: Keys an external-data entry may hold (ONNX's list).
_EXTERNAL_KEYS = frozenset({"location", "offset", "length", "checksum", "basepath"})
#: An external-data offset or length: decimal digits only, at most 19 (below 2^63).
_EXTENT = re.compile(r"[0-9]{1,19}")


def _resolve_inside(folder: Path, name, anchor: Path, what: str, missing: type[Exception] = ModelError) -> Path:
    """The regular file ``name`` (a path read from a model or its config) names relative to ``folder``, resolved.

    The rule ONNX Runtime applies to external data: ``name`` is relative and
    has no ``..`` component, and the file it resolves to (symlinks followed)
    lies inside ``folder`` (resolved) or inside the folder of ``anchor``'s
    target, ``anchor`` being the file that holds the name (so a symlinked
    model in a Hugging Face cache snapshot still finds its data files among
    the cache's blobs).  ``what`` names the tensor or config key in errors;
    a file that does not exist raises ``missing``.

    Raises:
        ModelError: ``name`` is empty, absolute, has ``..``, resolves outside
            those folders, or is not a regular file.
    """
    where = f"load: {what} names the file {name!r}"
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ModelError(f"{where}; expected a non-empty relative path inside the model's folder {folder}")
    rel = Path(name)
    if rel.is_absolute():
        raise ModelError(
            f"{where}: absolute paths are not allowed (the file must be inside the model's folder {folder})"
        )
    if ".." in rel.parts:
        raise ModelError(
            f"{where}: '..' components are not allowed (the file must be inside the model's folder {folder})"
        )
    try:
        exists = (folder / rel).exists()
        resolved = (folder / rel).resolve(strict=True) if exists else None
        roots = (folder.resolve(strict=True), anchor.resolve(strict=True).parent)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop; OSError: e.g. a name too long
        raise ModelError(f"{where}, which cannot be resolved: {e}") from None
    if resolved is None:
        raise missing(f"{where}, which does not exist in {folder}")
    if not any(resolved.is_relative_to(r) for r in roots):
        raise ModelError(f"{where}, which resolves to {resolved}, outside the model's folder {roots[0]}")
    _regular_file(resolved, where)
    return resolved


def _regular_file(path: Path, where: str) -> int:
    """The size of ``path``, a regular file (never a device, FIFO or folder that could block or never end)."""
    try:
        st = path.stat()
    except OSError as e:
        raise ModelError(f"{where}: cannot stat {path}: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{where}, which resolves to {path}: not a regular file")
    return st.st_size


def _external_info(init: onnx.TensorProto) -> dict[str, str]:
    info: dict[str, str] = {}
    for e in init.external_data:
        if e.key in info:
            raise ModelError(f"load: the external data of initializer '{init.name}' gives '{e.key}' twice")
        if e.key not in _EXTERNAL_KEYS:
            raise ModelError(
                f"load: the external data of initializer '{init.name}' has the unknown key {e.key!r}; "
                f"known keys are {sorted(_EXTERNAL_KEYS)}"
            )
        info[e.key] = e.value
    return info


def _extent(info: dict[str, str], key: str, default: int, init: onnx.TensorProto) -> int:
    """The external-data ``offset`` or ``length`` of ``init`` as a Python int (``default`` when absent)."""
    value = info.get(key)
    if value is None:
        return default
    if not _EXTENT.fullmatch(value):
        raise ModelError(
            f"load: the external data of initializer '{init.name}' has {key} {value[:40]!r}; "
            "expected a non-negative decimal integer below 10^19"
        )
    return int(value)


def _map_external_data(proto: onnx.ModelProto, file: Path) -> dict[str, np.ndarray]:
    """Memory-map every external initializer of a numeric type; load the rest into the proto.

    Each initializer's location must pass :func:`_resolve_inside` (relative
    to ``file``'s folder); its dims, element type, ``offset`` and ``length``
    must describe bytes that lie within that file.  Nothing is read before
    every check of that initializer passed.
    """
    folder = file.parent
    mapped: dict[str, np.ndarray] = {}
    for init in proto.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        what = f"initializer '{init.name}'"
        info = _external_info(init)
        location = _resolve_inside(folder, info.get("location", ""), file, f"the external data of {what}")
        count = element_count(init, f"load: {what}")
        nbytes = data_nbytes(init.data_type, count, f"load: {what}")
        offset = _extent(info, "offset", 0, init)
        length = _extent(info, "length", nbytes, init)
        size = _regular_file(location, f"load: the external data of {what}")
        if length != nbytes:
            raise ModelError(
                f"load: the external data of {what} declares length {length}, but its dims "
                f"{list(init.dims)} need {nbytes} bytes"
            )
        if offset > size or length > size - offset:
            raise ModelError(
                f"load: the external data of {what} ({length} bytes at offset {offset}) does not fit "
                f"in {location} ({size} bytes)"
            )
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
        try:
            if dtype.kind in "fiub" and dtype.isnative:
                shape = tuple(int(d) for d in init.dims)
                mapped[init.name] = (
                    np.memmap(location, dtype=dtype, mode="r", offset=offset, shape=shape)
                    if count
                    else np.zeros(shape, dtype)
                )
                continue
            with open(location, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except OSError as e:
            raise ModelError(f"load: cannot read the external data of {what} from {location}: {e}") from None
        if len(data) != length:
            raise ModelError(
                f"load: the external data of {what} in {location} ended after {len(data)} of {length} bytes"
            )
        init.raw_data = data
        del init.external_data[:]
        init.data_location = onnx.TensorProto.DEFAULT
    return mapped


def _no_broken_link(path: Path) -> None:
    """ModelError when ``path`` is a symbolic link that leads nowhere (dangling, or a loop): such a file is
    not absent (a config loaded without would drop what it states, a sliding window), nor a missing model."""
    if path.is_symlink() and not path.exists():
        raise ModelError(f"load: {path} is a symbolic link that resolves to no file (dangling or a loop)")


def _check_domains(model: onnx.ModelProto) -> None:
    for o in model.opset_import:  # the schema lookups take an int32 version
        if not 1 <= o.version < 2**31:
            raise ModelError(f"load: the model imports opset {o.version} of domain '{o.domain or 'ai.onnx'}'")
    bad = [n for n in model.graph.node if n.domain not in KNOWN_DOMAINS]
    if bad:
        listed = ", ".join(f"'{n.name or n.output[0]}' ({n.domain}::{n.op_type})" for n in bad[:10])
        raise UnsupportedOperatorError(
            f"load: {len(bad)} node(s) use operator domains onnxkv does not know: {listed}; "
            f"known domains are {sorted(d or 'ai.onnx' for d in KNOWN_DOMAINS)}"
        )


def _find_io(model: onnx.ModelProto, conv: CacheConvention, cfg: dict | None) -> ModelIO:
    names = [i.name for i in model.graph.input]
    outs = [o.name for o in model.graph.output]
    dec_in = _config_section(cfg or {}, ("model", "decoder", "inputs"))
    dec_out = _config_section(cfg or {}, ("model", "decoder", "outputs"))

    def pick(key: str, default: str) -> str | None:
        name = dec_in.get(key, default)
        return name if name in names else None

    logits = dec_out.get("logits", "logits")
    if logits in conv.present_outputs:
        raise ModelError(
            f"load: genai_config.json: model.decoder.outputs.logits {logits!r} is a KV-cache output of the graph, "
            "not its logits"
        )
    if logits not in outs:
        if "logits" in dec_out:  # named, and not there: no other output is taken in its place
            raise ModelError(
                f"load: genai_config.json: model.decoder.outputs.logits {logits!r} is not an output of the graph "
                f"(outputs: {', '.join(o for o in outs if o not in conv.present_outputs) or 'none but the caches'})"
            )
        rest = [o for o in outs if o not in conv.present_outputs]
        logits = rest[0] if rest else None
    io = ModelIO(
        pick("input_ids", "input_ids"),
        pick("attention_mask", "attention_mask"),
        pick("position_ids", "position_ids"),
        logits,
    )
    used = {io.input_ids, io.attention_mask, io.position_ids, *conv.past_inputs}
    io.other_inputs = [n for n in names if n not in used]
    return io


#: Largest size, length or head count a genai_config.json may declare.
_CONFIG_INT_LIMIT = 1 << 31


def _config_section(cfg: dict, keys: tuple[str, ...], path: Path = Path("genai_config.json")) -> dict:
    """The object at ``cfg[keys[0]][keys[1]]...`` ({} when absent or null); ModelError when something else is there."""
    section = cfg
    for i, key in enumerate(keys):
        section = section.get(key)
        if section is None:
            return {}
        if not isinstance(section, dict):
            raise ModelError(f"load: {path}: {'.'.join(keys[: i + 1])} must be a JSON object, got {section!r:.60}")
    return section


def _read_genai_config(path: Path) -> dict:
    """Parse and check ``genai_config.json``: every key onnxkv reads has the JSON type and range it needs.

    Raises:
        ModelError: unreadable, not JSON, or a key of another type or out of
            range (the message names the key and the value).
    """
    if _regular_file(path, f"load: {path}") > BYTES_LIMIT:
        raise ModelError(f"load: {path} is larger than {BYTES_LIMIT} bytes")
    cfg = read_object(path)
    model = _config_section(cfg, ("model",), path)
    search = _config_section(cfg, ("search",), path)
    decoder = _config_section(cfg, ("model", "decoder"), path)
    for key in ("inputs", "outputs"):
        names = _config_section(cfg, ("model", "decoder", key), path)
        for k, v in names.items():
            if not isinstance(v, str):
                raise ModelError(f"load: {path}: model.decoder.{key}.{k} must be a string, got {v!r:.60}")
    filename = decoder.get("filename")
    if filename is not None and not isinstance(filename, str):
        raise ModelError(f"load: {path}: model.decoder.filename must be a string, got {filename!r:.60}")
    for key in ("head_size", "num_key_value_heads", "num_attention_heads"):
        config_int(decoder, key, path, 1, _CONFIG_INT_LIMIT, "model.decoder")
    config_int(search, "max_length", path, 1, _CONFIG_INT_LIMIT, "search")
    config_int(model, "context_length", path, 1, _CONFIG_INT_LIMIT, "model")
    vocab = config_int(model, "vocab_size", path, 1, _CONFIG_INT_LIMIT, "model")
    top = vocab if vocab is not None else _CONFIG_INT_LIMIT
    for key in ("bos_token_id", "pad_token_id"):
        config_int(model, key, path, 0, top, "model")
    eos = model.get("eos_token_id")
    if isinstance(eos, list):
        for i, e in enumerate(eos):
            config_int({f"eos_token_id[{i}]": e}, f"eos_token_id[{i}]", path, 0, top, "model")
    else:
        config_int(model, "eos_token_id", path, 0, top, "model")
    return cfg


def _apply_genai_config(m: Model, cfg: dict) -> None:
    """Copy the settings of a genai_config.json checked by :func:`_read_genai_config` into ``m``."""
    mc = _config_section(cfg, ("model",))
    search = _config_section(cfg, ("search",))
    m.max_length = search.get("max_length") or mc.get("context_length")
    m.vocab_size = mc.get("vocab_size")
    m.bos_token_id = mc.get("bos_token_id")
    eos = mc.get("eos_token_id")
    m.eos_token_id = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    m.pad_token_id = mc.get("pad_token_id")
    dec = _config_section(cfg, ("model", "decoder"))
    conv = m.convention
    if conv.head_size is None and dec.get("head_size"):
        conv.head_size = dec["head_size"]
    if conv.kv_heads is None and dec.get("num_key_value_heads"):
        conv.kv_heads = dec["num_key_value_heads"]
    if conv.num_heads is None and dec.get("num_attention_heads"):
        conv.num_heads = dec["num_attention_heads"]


def load(path: str | os.PathLike | onnx.ModelProto) -> Model:
    """Load an ``.onnx`` file, a GenAI model folder, or wrap an in-memory ModelProto.

    File names read from the model (external-data locations) and from
    ``genai_config.json`` (``model.decoder.filename``) must stay inside the
    model's folder (see :func:`_resolve_inside`); every external-data entry
    must fit its file.

    Raises:
        FileNotFoundError: the path does not exist, the folder has no model,
            or the model file genai_config.json names does not exist.
        ModelError: the file is not a valid ONNX model, a file name escapes
            the model's folder, external data does not fit its file, stored
            data does not match its dims, genai_config.json is malformed
            (the message names the initializer or config key and the value),
            or it states a sliding window onnxkv cannot apply.
        UnsupportedOperatorError: nodes use operator domains onnxkv does not know.
    """
    cfg = None
    file: Path | None = None
    external: dict[str, np.ndarray] = {}
    if isinstance(path, onnx.ModelProto):
        proto = path
        check_text(proto)
    else:
        p = Path(path)
        _no_broken_link(p)
        if not p.exists():
            raise FileNotFoundError(f"load: no such model file or folder: {p}")
        if p.is_dir():
            cfg_path = p / "genai_config.json"
            _no_broken_link(cfg_path)
            if cfg_path.exists():
                cfg = _read_genai_config(cfg_path)
                fname = _config_section(cfg, ("model", "decoder")).get("filename")
                fname = "model.onnx" if fname is None else fname
                _resolve_inside(p, fname, cfg_path, f"model.decoder.filename of {cfg_path}", missing=FileNotFoundError)
                file = p / fname
            else:
                candidates = sorted(p.glob("*.onnx"))
                for c in candidates:
                    _no_broken_link(c)
                if len(candidates) != 1:
                    # a Hugging Face export keeps its files (float, quantized, fp16...) in onnx/
                    listed = candidates
                    if not listed and (p / "onnx").is_dir():
                        listed = sorted((p / "onnx").glob("*.onnx"))
                    names = ", ".join(str(c.relative_to(p)) for c in listed[:12])
                    raise FileNotFoundError(
                        f"load: folder {p} has no genai_config.json and {len(candidates)} .onnx files (need exactly "
                        f"one)" + (f"; give the path of one of: {names}" if listed else "")
                    )
                file = candidates[0]
                _regular_file(file, f"load: the model file {file.name} of {p}")
        else:
            file = p
            _regular_file(p, f"load: {p}")  # a FIFO or device could block or never end
            _no_broken_link(p.parent / "genai_config.json")
            if (p.parent / "genai_config.json").exists():
                cfg = _read_genai_config(p.parent / "genai_config.json")
        try:
            proto = read_model(file) or onnx.load(str(file), load_external_data=False)
        except Exception as e:
            raise ModelError(f"load: cannot read ONNX model {file}: {e}") from e
        check_text(proto)
        external = _map_external_data(proto, file)
    if not proto.graph.node:
        raise ModelError("load: the model's graph has no nodes")
    _check_domains(proto)
    opsets = {o.domain if o.domain != "ai.onnx" else "": o.version for o in proto.opset_import}
    check_attributes(proto.graph, opsets)
    check_arity(proto.graph, opsets)
    try:
        conv = recognize_cache(proto)
        if cfg is not None and apply_config_window(proto, conv, cfg, file.parent / "genai_config.json"):
            conv = recognize_cache(proto)
    except onnx.checker.ValidationError as e:
        raise ModelError(f"load: {e}") from e
    m = Model(proto, file, conv, _find_io(proto, conv, cfg), cfg, external=external)
    if cfg is not None:
        _apply_genai_config(m, cfg)
    width = None  # the logits' static last dim
    for o in proto.graph.output:
        if m.io.logits and o.name == m.io.logits and o.type.tensor_type.HasField("shape"):
            d = o.type.tensor_type.shape.dim
            if d and d[-1].HasField("dim_value") and d[-1].dim_value > 0:
                width = int(d[-1].dim_value)
    if cfg is None and file is not None:
        hf = read_hf_settings(file)
        if hf is not None:
            if hf["vocab_size"] is not None and width is not None and hf["vocab_size"] < width:
                raise ModelError(
                    f"load: {hf['path']}: vocab_size {hf['vocab_size']} is below the {width} logits the model "
                    f"computes per position (its token ids would be refused)"
                )
            m.vocab_size, m.max_length = hf["vocab_size"], hf["max_length"]
            m.bos_token_id, m.eos_token_id, m.pad_token_id = hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]
    if m.vocab_size is None:
        m.vocab_size = width
    return m
