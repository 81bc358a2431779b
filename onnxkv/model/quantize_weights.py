"""Weight-only quantization: float32 MatMul weights rewritten as ``com.microsoft::MatMulNBits``.

:func:`quantize_weights` reads a model (an ``.onnx`` file with its external
data, a model folder, or a ``ModelProto``), replaces every eligible
``MatMul(A, W)`` by ``MatMulNBits(A, B, scales[, zero_points])`` in the form
ONNX Runtime's contrib operator defines and the ONNX Runtime GenAI model
builder writes (it runs ONNX Runtime's ``MatMulNBitsQuantizer``), and saves
the result with its weights in an external-data file.

Eligible: a main-graph ``MatMul`` whose input 1 is a 2-D float32 initializer
``W [K, N]`` with ``K >= block_size``, ``N >= 1`` and finite values, that is
not also a graph input and that nothing but ``MatMul`` input 1 reads
(MatMuls sharing a weight share its quantized form).  Every other MatMul
over an initializer is left as it is and reported with the reason.

Layout, with ``k_blocks = ceil(K / block_size)`` (ONNX Runtime's):

* ``B`` uint8 ``[N, k_blocks, block_size * bits / 8]``: column ``n`` of
  ``W`` block by block, 4-bit codes two per byte, low nibble first; the
  padding past ``K`` holds the zero point (it dequantizes to 0).
* ``scales`` float32 ``[N, k_blocks]`` (2-D, as the builder writes it and as
  ``GatherBlockQuantized`` over a tied embedding needs it).
* ``zero_points`` uint8 ``[N, ceil(k_blocks * bits / 8)]``, packed like ``B``
  (asymmetric only; symmetric leaves it out: MatMulNBits' default zero point
  ``2^(bits-1)`` applies).
* attributes ``K``, ``N``, ``bits``, ``block_size`` and ``accuracy_level``
  (left out when 0, as ONNX Runtime's quantizer does).
* names: ``<W>_Q<bits>``, ``<W>_scales``, ``<W>_zero_points`` and node
  ``<name>_Q<bits>`` (a numbered suffix if the name is taken).

Quantization, per column and block, in float32 -- ONNX Runtime's
``MlasQuantizeBlockwise`` bit for bit (the tests compare the bytes), with
``mid = 2^(bits-1)`` and ``qmax = 2^bits - 1``:

* symmetric: ``m`` is the block's maximum if ``|max| > |min|``, else its
  minimum; ``scale = -m / mid``, ``zp = mid``.  ``m`` gets code 0; codes
  reach ``mid - 1`` steps on the other side, so values of the other sign
  beyond ``(mid - 1/2) * |scale|`` are clipped (error up to ``|scale|``);
  every other value is within ``|scale| / 2``.
* asymmetric: ``lo = min(min, 0)``, ``hi = max(max, 0)``,
  ``scale = (hi - lo) / qmax``, ``zp = clip(roundf(-lo / scale), 0, qmax)``
  (0 when ``scale`` is 0); every value is within ``scale / 2``.
* codes ``q = clip(roundf(w * (1 / scale) + zp), 0, qmax)`` (``1 / scale``
  taken as 0 when ``scale`` is 0), ``roundf`` rounding halves away from
  zero; dequantized, ``(q - zp) * scale``.

Output: a folder input (GenAI: ``model.onnx`` + ``genai_config.json``)
gives a folder ``out`` holding every other top-level file of the input
folder copied and the new model under the same file name; a file or
``ModelProto`` input gives the file ``out``.  Every initializer of 1 KiB or
more is stored in ``<model file name>.data`` beside the model (so models of
any size save), each at a 64-byte aligned offset.  The source files are only
read (``out`` may not name them); the ``ModelProto`` given is not modified.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxkv.errors import InputError, ModelError
from onnxkv.model.checker import value_uses
from onnxkv.model.contract import describe_node
from onnxkv.model.load import Model, load
from onnxkv.model.tensors import data_nbytes, element_count, tensor_array

__all__ = ["QuantizeReport", "quantize_blockwise", "quantize_weights"]

#: Initializers of at least this many bytes go to the external-data file.
EXTERNAL_MIN_BYTES = 1024
#: Offset alignment of each tensor in the external-data file.
_ALIGN = 64
#: Elements of a weight quantized at a time (bounds the temporaries to a few times 64 MiB).
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_weights` did.

    Attributes:
        path: the model file written.
        bits, block_size: the format of the quantized weights.
        quantized: MatMul nodes rewritten as MatMulNBits.
        skipped: ``(node, reason)`` for each MatMul over an initializer left as it was.
        bytes_before, bytes_after: bytes of the model's initializers before and after.
    """

    path: Path
    bits: int
    block_size: int
    quantized: int
    skipped: tuple[tuple[str, str], ...]
    bytes_before: int
    bytes_after: int

    def __str__(self) -> str:
        mib = 1 / (1 << 20)
        return (
            f"{self.quantized} MatMuls quantized to int{self.bits} (block {self.block_size}), "
            f"{len(self.skipped)} left float; initializers {self.bytes_before * mib:.2f} MiB -> "
            f"{self.bytes_after * mib:.2f} MiB"
        )


def _roundf_clip(x: np.ndarray, qmax: int) -> np.ndarray:
    """``clip(roundf(x), 0, qmax)`` as uint8: halves round away from zero (exact for |x| < 2^23)."""
    r = np.floor(x)
    r += (x - r) >= 0.5
    return np.clip(r, 0, qmax).astype(np.uint8)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``codes`` [..., n] packed along the last axis (4 bits: two per byte, low first, n padded to even)."""
    if bits == 8:
        return codes
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_blockwise(
    w: np.ndarray, bits: int, block_size: int, symmetric: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Quantize ``w`` float32 ``[K, N]`` along K (see the module docstring for the formula).

    Returns ``(B, scales, zero_points)``: uint8 ``[N, k_blocks, block_size *
    bits / 8]``, float32 ``[N, k_blocks]`` and uint8 ``[N, ceil(k_blocks *
    bits / 8)]`` (None when ``symmetric``), new arrays owned by the caller.
    Columns are processed a chunk at a time, so temporaries stay bounded.
    """
    k, n = w.shape
    blocks = -(-k // block_size)
    mid, qmax = 1 << (bits - 1), (1 << bits) - 1
    packed = np.empty((n, blocks, block_size * bits // 8), np.uint8)
    scales = np.empty((n, blocks), np.float32)
    zero_points = None if symmetric else np.empty((n, -(-blocks * bits // 8)), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // (blocks * block_size))
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        x = np.zeros((c1 - c0, blocks * block_size), np.float32)  # zero padding past K changes no min or max
        x[:, :k] = w[:, c0:c1].T
        x = x.reshape(c1 - c0, blocks, block_size)
        lo, hi = x.min(axis=2), x.max(axis=2)
        if symmetric:
            scale = -np.where(np.abs(hi) > np.abs(lo), hi, lo) / np.float32(mid)
            zp = np.full(scale.shape, mid, np.float32)
        else:
            lo, hi = np.minimum(lo, np.float32(0)), np.maximum(hi, np.float32(0))
            scale = (hi - lo) / np.float32(qmax)
            zp = _roundf_clip(np.divide(-lo, scale, out=np.zeros_like(scale), where=scale != 0), qmax)
            zero_points[c0:c1] = _pack(zp, bits)
            zp = zp.astype(np.float32)
        recip = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
        x *= recip[:, :, None]
        x += zp[:, :, None]
        packed[c0:c1] = _pack(_roundf_clip(x, qmax), bits)
        scales[c0:c1] = scale
    return packed, scales, zero_points


def _check_arguments(bits, block_size, symmetric, accuracy_level) -> None:
    def bad(name: str, value, expected: str) -> InputError:
        return InputError(f"quantize_weights: {name} is {value!r}; expected {expected}")

    if isinstance(bits, bool) or bits not in (4, 8):
        raise bad("bits", bits, "4 or 8")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or not 16 <= block_size <= 256
        or block_size & (block_size - 1)
    ):
        raise bad("block_size", block_size, "a power of two from 16 to 256")
    if not isinstance(symmetric, bool):
        raise bad("symmetric", symmetric, "True or False")
    if isinstance(accuracy_level, bool) or not isinstance(accuracy_level, int) or not 0 <= accuracy_level <= 4:
        raise bad("accuracy_level", accuracy_level, "an int from 0 to 4 (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8)")


def _initializer_bytes(graph: onnx.GraphProto) -> int:
    return sum(
        data_nbytes(t.data_type, element_count(t, f"initializer '{t.name}'"), f"initializer '{t.name}'")
        for t in graph.initializer
        if t.data_type != TensorProto.STRING
    )


class _DataFile:
    """An external-data file being written: tensors are appended and their TensorProtos pointed at them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.offset = 0

    def put(self, tensor: TensorProto, view: memoryview) -> None:
        """Append the bytes ``view`` and make ``tensor`` refer to them."""
        pad = -self.offset % _ALIGN
        self.file.write(b"\0" * pad)
        self.offset += pad
        self.file.write(view)
        tensor.ClearField("raw_data")
        tensor.ClearField(helper.tensor_dtype_to_field(tensor.data_type))
        del tensor.external_data[:]
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(self.offset)), ("length", str(view.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.offset += view.nbytes

    def close(self) -> None:
        """Close the file; remove it if nothing was written to it."""
        self.file.close()
        if not self.offset:
            self.path.unlink()


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2``... the first not in ``taken`` (which it joins)."""
    candidate, i = name, 0
    while candidate in taken:
        i += 1
        candidate = f"{name}_{i}"
    taken.add(candidate)
    return candidate


def _matmul_weight(node: onnx.NodeProto) -> str | None:
    """Input 1 of a standard two-input MatMul, else None."""
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.input) == 2:
        return node.input[1]
    return None


def _skip_reason(
    model: Model, init: TensorProto, readers: list[str], uses: list[str], fed: set[str], block_size: int
) -> str | None:
    """Why the MatMuls ``readers`` (node labels) over ``init`` are not quantized, or None."""
    name, dims = init.name, list(init.dims)
    if name in fed:
        return f"its weight '{name}' is also a graph input (a feed may replace it)"
    if init.data_type != TensorProto.FLOAT:
        return f"its weight '{name}' is {TensorProto.DataType.Name(init.data_type)}, not FLOAT"
    if len(dims) != 2 or dims[1] < 1:
        return f"its weight '{name}' has shape {dims}, not [K, N] with N >= 1"
    if dims[0] < block_size:
        return f"its weight '{name}' has K = {dims[0]}, below block_size {block_size}"
    others = [u for u in uses if u not in {f"{r} input 1" for r in readers}]
    if others:
        return f"its weight '{name}' is also read by {', '.join(others[:3])}" + (" ..." if len(others) > 3 else "")
    if not np.isfinite(_weight(model, init)).all():
        return f"its weight '{name}' holds NaN or infinity"
    return None


def _weight(model: Model, init: TensorProto) -> np.ndarray:
    """``init``'s values: its memory-mapped external data, or the array it holds."""
    if init.name in model.external:
        return model.external[init.name]
    return tensor_array(init, f"initializer '{init.name}'")


def _targets(
    source: str | os.PathLike | onnx.ModelProto, model: Model, out: str | os.PathLike
) -> tuple[Path, Path | None]:
    """(model file to write, folder whose other files to copy or None); InputError if it would overwrite the source."""
    if not isinstance(out, (str, os.PathLike)):
        raise InputError(f"quantize_weights: out is {out!r}; expected a path (str or os.PathLike)")
    out = Path(out)
    folder = None if isinstance(source, onnx.ModelProto) else Path(source)
    if folder is not None and folder.is_dir():
        if out.exists() and out.resolve() == folder.resolve():
            raise InputError(f"quantize_weights: out {str(out)!r} is the source folder; give another folder")
        target = out / model.path.relative_to(folder)
    else:
        folder, target = None, out
    protected = _source_files(model)
    for path in (target, target.with_name(target.name + ".data")):
        if path.resolve() in protected:
            raise InputError(f"quantize_weights: out {str(out)!r} would overwrite the source file {path}")
    return target, folder


def quantize_weights(
    model_or_path: str | os.PathLike | onnx.ModelProto,
    out: str | os.PathLike,
    bits: int = 4,
    block_size: int = 32,
    symmetric: bool = True,
    accuracy_level: int = 4,
) -> QuantizeReport:
    """Rewrite the eligible float32 MatMuls of a model as MatMulNBits and save it (see the module docstring).

    Raises:
        InputError: an argument is out of its range (naming it and the value),
            or ``out`` would overwrite a source file.
        ModelError / FileNotFoundError: as :func:`onnxkv.load` for the source;
            a ``ModelProto`` whose initializers refer to external files (give
            its path instead).
    """
    _check_arguments(bits, block_size, symmetric, accuracy_level)
    model = load(model_or_path)
    target, copy_from = _targets(model_or_path, model, out)
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    graph = proto.graph
    for t in graph.initializer:
        if t.data_location == TensorProto.EXTERNAL and t.name not in model.external:
            raise ModelError(
                f"quantize_weights: initializer '{t.name}' keeps its data in an external file the "
                "ModelProto cannot reach; pass the model's path instead"
            )
    readers, skipped = _select(model, graph, block_size)
    target.parent.mkdir(parents=True, exist_ok=True)
    if copy_from is not None:
        _copy_other_files(copy_from, model, target.parent)
    data = _DataFile(target.with_name(target.name + ".data"))
    try:
        taken = (
            {t.name for t in graph.initializer}
            | {n.name for n in graph.node}
            | {x for n in graph.node for x in (*n.input, *n.output)}
        )
        inits = {t.name: t for t in graph.initializer}
        new_inits, nodes = [], {}
        for name in readers:
            quantized = _quantized_initializers(
                name, _weight(model, inits[name]), bits, block_size, symmetric, data, taken
            )
            new_inits += quantized
            k, n = inits[name].dims
            nodes[name] = (
                [t.name for t in quantized],
                {"K": k, "N": n, "bits": bits, "block_size": block_size}
                | ({"accuracy_level": accuracy_level} if accuracy_level else {}),
            )
        _rewrite_nodes(graph, nodes, taken)
        kept = [t for t in graph.initializer if t.name not in readers]
        del graph.initializer[:]
        graph.initializer.extend(kept)  # copies: the messages are placed below, in the graph
        for t in graph.initializer:
            _store(t, model, data)
        graph.initializer.extend(new_inits)
        kept_info = [v for v in graph.value_info if v.name not in readers]
        del graph.value_info[:]
        graph.value_info.extend(kept_info)
    finally:
        data.close()
    if readers and not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save_model(proto, target)
    return QuantizeReport(
        target,
        bits,
        block_size,
        sum(map(len, readers.values())),
        tuple(skipped),
        _initializer_bytes(model.proto.graph),
        _initializer_bytes(graph),
    )


def _select(model: Model, graph: onnx.GraphProto, block_size: int) -> tuple[dict[str, list[str]], list]:
    """(eligible weight -> labels of its MatMuls in graph order, [(MatMul label, reason)] of the others)."""
    inits = {t.name: t for t in graph.initializer}
    fed = {i.name for i in graph.input}
    uses = value_uses(graph)
    readers: dict[str, list[str]] = {}
    for index, node in enumerate(graph.node):
        if _matmul_weight(node) in inits:
            readers.setdefault(node.input[1], []).append(describe_node(node, index))
    eligible, skipped = {}, []
    for name, labels in readers.items():
        reason = _skip_reason(model, inits[name], labels, uses.get(name, []), fed, block_size)
        if reason is None:
            eligible[name] = labels
        else:
            skipped.extend((label, reason) for label in labels)
    return eligible, skipped


def _quantized_initializers(
    name: str, w: np.ndarray, bits: int, block_size: int, symmetric: bool, data: _DataFile, taken: set[str]
) -> list[TensorProto]:
    """The MatMulNBits inputs 1.. for weight ``name`` (``w`` [K, N]), their data placed (:func:`_place`)."""
    out = []
    arrays = quantize_blockwise(np.asarray(w, np.float32), bits, block_size, symmetric)
    for suffix, array in zip((f"_Q{bits}", "_scales", "_zero_points"), arrays):
        if array is not None:
            t = TensorProto()
            t.name = _fresh(name + suffix, taken)
            t.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
            t.dims.extend(array.shape)
            _place(t, array, data)
            out.append(t)
    return out


def _rewrite_nodes(graph: onnx.GraphProto, nodes: dict[str, tuple[list[str], dict]], taken: set[str]) -> None:
    """Replace each MatMul over a weight of ``nodes`` (weight -> (MatMulNBits inputs 1.., attributes)) in place."""
    rewritten = []
    for node in graph.node:
        weight = _matmul_weight(node)
        if weight in nodes:
            inputs, attrs = nodes[weight]
            name = _fresh(f"{node.name}_Q{attrs['bits']}", taken) if node.name else ""
            node = helper.make_node(
                "MatMulNBits", [node.input[0], *inputs], list(node.output), name=name, domain="com.microsoft", **attrs
            )
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)


def _source_files(model: Model) -> set[Path]:
    """The resolved files ``model`` was read from (model file and memory-mapped external data)."""
    files = {Path(a.filename).resolve() for a in model.external.values() if isinstance(a, np.memmap)}
    return files | ({model.path.resolve()} if model.path is not None else set())


def _copy_other_files(folder: Path, model: Model, dest: Path) -> None:
    """Copy the regular top-level files of ``folder`` except the model's own files into ``dest``."""
    skip = _source_files(model)
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.resolve() not in skip:
            shutil.copyfile(f, dest / f.name)


def _place(t: TensorProto, raw, data: _DataFile) -> None:
    """Store ``raw`` (bytes or an array) as ``t``'s data: in the data file from 1 KiB on, else inline."""
    view = memoryview(np.ascontiguousarray(raw).reshape(-1).view(np.uint8) if isinstance(raw, np.ndarray) else raw)
    if view.nbytes >= EXTERNAL_MIN_BYTES:
        data.put(t, view)
    else:
        del t.external_data[:]
        t.data_location = TensorProto.DEFAULT
        t.raw_data = view.tobytes()


def _store(t: TensorProto, model: Model, data: _DataFile) -> None:
    """Place initializer ``t`` kept from the source (:func:`_place`); strings stay inline."""
    if t.data_type == TensorProto.STRING:
        return
    if t.name in model.external:
        _place(t, model.external[t.name], data)
    elif t.HasField("raw_data"):
        _place(t, t.raw_data, data)
    else:
        _place(t, numpy_helper.from_array(tensor_array(t, f"initializer '{t.name}'")).raw_data, data)
