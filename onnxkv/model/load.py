"""Loading a decoder model: an ``.onnx`` file or an ONNX Runtime GenAI folder.

:func:`load` returns a :class:`Model`: the ``ModelProto`` (external data
loaded), where it came from, its recognised cache convention, the names of
its conventional inputs/outputs, and the generation settings of a
``genai_config.json`` when one is present.  Operators in unknown domains are
rejected here, naming the nodes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.external_data_helper

from onnxkv.errors import ModelError, UnsupportedOperatorError
from onnxkv.model.convention import CacheConvention, recognize_cache

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
            generation settings from genai_config (None when unknown);
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


def _map_external_data(proto: onnx.ModelProto, folder: Path) -> dict[str, np.ndarray]:
    """Memory-map every external initializer of a numeric type; load the rest into the proto."""
    mapped: dict[str, np.ndarray] = {}
    for init in proto.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
        except (KeyError, TypeError, ValueError):
            dtype = None
        location = folder / info.get("location", "")
        if dtype is None or dtype.kind not in "fiub" or not location.is_file() or not dtype.isnative:
            onnx.external_data_helper.load_external_data_for_tensor(init, str(folder))
            init.data_location = onnx.TensorProto.DEFAULT
            continue
        shape = tuple(int(d) for d in init.dims)
        offset = int(info.get("offset", 0))
        count = int(np.prod(shape, dtype=np.int64))
        length = int(info.get("length", count * dtype.itemsize))
        if length != count * dtype.itemsize or offset + length > location.stat().st_size:
            raise ModelError(f"load: external data of initializer '{init.name}' in {location} has "
                             f"{length} bytes at offset {offset}, expected {count * dtype.itemsize} within the file")
        mapped[init.name] = np.memmap(location, dtype=dtype, mode="r", offset=offset, shape=shape) if count else \
            np.zeros(shape, dtype)
    return mapped


def _check_domains(model: onnx.ModelProto) -> None:
    bad = [n for n in model.graph.node if n.domain not in KNOWN_DOMAINS]
    if bad:
        listed = ", ".join(f"'{n.name or n.output[0]}' ({n.domain}::{n.op_type})" for n in bad[:10])
        raise UnsupportedOperatorError(
            f"load: {len(bad)} node(s) use operator domains onnxkv does not know: {listed}; "
            f"known domains are {sorted(d or 'ai.onnx' for d in KNOWN_DOMAINS)}")


def _find_io(model: onnx.ModelProto, conv: CacheConvention, cfg: dict | None) -> ModelIO:
    names = [i.name for i in model.graph.input]
    outs = [o.name for o in model.graph.output]
    dec_in = ((cfg or {}).get("model", {}).get("decoder", {}) or {}).get("inputs", {})
    dec_out = ((cfg or {}).get("model", {}).get("decoder", {}) or {}).get("outputs", {})

    def pick(key: str, default: str) -> str | None:
        name = dec_in.get(key, default)
        return name if name in names else None

    logits = dec_out.get("logits", "logits")
    if logits not in outs:
        rest = [o for o in outs if o not in conv.present_outputs]
        logits = rest[0] if rest else None
    io = ModelIO(pick("input_ids", "input_ids"), pick("attention_mask", "attention_mask"),
                 pick("position_ids", "position_ids"), logits)
    used = {io.input_ids, io.attention_mask, io.position_ids, *conv.past_inputs}
    io.other_inputs = [n for n in names if n not in used]
    return io


def _apply_genai_config(m: Model, cfg: dict) -> None:
    mc = cfg.get("model", {})
    search = cfg.get("search", {})
    m.max_length = search.get("max_length") or mc.get("context_length")
    m.vocab_size = mc.get("vocab_size")
    m.bos_token_id = mc.get("bos_token_id")
    eos = mc.get("eos_token_id")
    m.eos_token_id = [] if eos is None else ([int(e) for e in eos] if isinstance(eos, list) else [int(eos)])
    m.pad_token_id = mc.get("pad_token_id")
    dec = mc.get("decoder", {})
    conv = m.convention
    if conv.head_size is None and dec.get("head_size"):
        conv.head_size = int(dec["head_size"])
    if conv.kv_heads is None and dec.get("num_key_value_heads"):
        conv.kv_heads = int(dec["num_key_value_heads"])
    if conv.num_heads is None and dec.get("num_attention_heads"):
        conv.num_heads = int(dec["num_attention_heads"])


def load(path: str | os.PathLike | onnx.ModelProto) -> Model:
    """Load an ``.onnx`` file, a GenAI model folder, or wrap an in-memory ModelProto.

    Raises:
        FileNotFoundError: the path does not exist or the folder has no model.
        ModelError: the file is not a valid ONNX model or genai_config.json is malformed.
        UnsupportedOperatorError: nodes use operator domains onnxkv does not know.
    """
    cfg = None
    file: Path | None = None
    external: dict[str, np.ndarray] = {}
    if isinstance(path, onnx.ModelProto):
        proto = path
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"load: no such model file or folder: {p}")
        if p.is_dir():
            cfg_path = p / "genai_config.json"
            if cfg_path.exists():
                try:
                    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
                except json.JSONDecodeError as e:
                    raise ModelError(f"load: {cfg_path} is not valid JSON: {e}") from e
                fname = cfg.get("model", {}).get("decoder", {}).get("filename", "model.onnx")
                file = p / fname
            else:
                candidates = sorted(p.glob("*.onnx"))
                if len(candidates) != 1:
                    raise FileNotFoundError(f"load: folder {p} has no genai_config.json and "
                                            f"{len(candidates)} .onnx files (need exactly one)")
                file = candidates[0]
            if not file.exists():
                raise FileNotFoundError(f"load: model file {file} named by genai_config.json does not exist")
        else:
            file = p
            if (p.parent / "genai_config.json").exists():
                cfg = json.loads((p.parent / "genai_config.json").read_text(encoding="utf-8"))
        try:
            proto = onnx.load(str(file), load_external_data=False)
            external = _map_external_data(proto, file.parent)
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"load: cannot read ONNX model {file}: {e}") from e
    if not proto.graph.node:
        raise ModelError("load: the model's graph has no nodes")
    _check_domains(proto)
    try:
        conv = recognize_cache(proto)
    except onnx.checker.ValidationError as e:
        raise ModelError(f"load: {e}") from e
    m = Model(proto, file, conv, _find_io(proto, conv, cfg), cfg, external=external)
    if cfg is not None:
        _apply_genai_config(m, cfg)
    if m.vocab_size is None and m.io.logits:
        for o in proto.graph.output:
            if o.name == m.io.logits and o.type.tensor_type.HasField("shape"):
                d = o.type.tensor_type.shape.dim
                if d and d[-1].HasField("dim_value"):
                    m.vocab_size = int(d[-1].dim_value)
    return m
