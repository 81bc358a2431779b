"""The rules of a :class:`~onnxkv.cache.snapshot.CacheSnapshot`: what :mod:`onnxkv.cache.serialize` writes and reads.

:func:`validate` states every rule of the data model and
:func:`check_expectation` whether a snapshot fits a reader
(:class:`~onnxkv.cache.snapshot_model.Expectation`).  The checks of single
fields are public here because the decoder applies them to a parsed body
before it builds the snapshot's objects.  Every broken rule raises
:class:`~onnxkv.errors.SerializationError` naming it (a snapshot that does
not fit the reader: :class:`~onnxkv.errors.InputError`).
"""

from __future__ import annotations

import numpy as np

from onnxkv.cache.formats import CHANNEL_ZP_MAX_UNIT_LOG2
from onnxkv.cache.snapshot_model import (
    BlockRecord,
    CacheSnapshot,
    Expectation,
    LayerSpec,
    OwedConversion,
    PagePayload,
    SequenceRecord,
)
from onnxkv.errors import InputError, SerializationError

__all__ = [
    "validate",
    "check_expectation",
    "check_snapshot",
    "check_counts",
    "check_layer_specs",
    "check_layers",
    "check_block_position",
    "check_int",
    "check_params",
    "format_dtype",
    "row_bytes",
    "fail",
    "FORMATS",
    "QUANTIZED",
]

_INT64_MAX = 2**63 - 1

#: Page formats: name -> element type on the wire (and of ``PagePayload.data`` up to byte order).
FORMATS: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # bit patterns: the upper half of a float32
}
#: Quantized page formats: name -> (bits per code, smallest code, largest code); data is packed codes (uint8).
QUANTIZED: dict[str, tuple[int, int, int]] = {
    "int8": (8, -128, 127),
    "uint8": (8, 0, 255),
    "int4": (4, -8, 7),
    "uint4": (4, 0, 15),
    "int2": (2, -2, 1),
    "uint2": (2, 0, 3),
}
#: Element types a model's cache inputs may have (``LayerSpec.dtype``).
_MODEL_DTYPES = ("float32", "float16", "bfloat16")


def fail(where: str, problem: str) -> SerializationError:
    return SerializationError(f"{where}: {problem}")


def _describe(value: object) -> str:
    return "an empty list" if isinstance(value, list) and not value else type(value).__name__


def check_int(value: object, where: str, what: str, low: int, high: int = _INT64_MAX) -> int:
    """``value`` as an int in ``[low, high]`` (numpy integers accepted, bool not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(where, f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise fail(where, f"{what} must be in [{low}, {high}], got {value}")
    return int(value)


def _check_text(value: object, where: str, what: str, allow_empty: bool = False) -> None:
    """``value`` is a str protobuf can store (UTF-8 encodable)."""
    if not isinstance(value, str):
        raise fail(where, f"{what} must be a str, got {type(value).__name__} {value!r}")
    if not value and not allow_empty:
        raise fail(where, f"{what} must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise fail(where, f"{what} {value!r} is not encodable as UTF-8 ({exc.reason})") from None


def check_layers(layers: object, where: str) -> None:
    if not isinstance(layers, list) or not layers:
        raise fail(where, f"layers must be a non-empty list of LayerSpec, got {_describe(layers)}")
    seen: dict[str, str] = {}
    for i, layer in enumerate(layers):
        at = f"{where}: layer {i}"
        if not isinstance(layer, LayerSpec):
            raise fail(at, f"expected a LayerSpec, got {type(layer).__name__}")
        for attr in ("key_name", "value_name"):
            name = getattr(layer, attr)
            _check_text(name, at, attr)
            if name in seen:
                raise fail(at, f"{attr} {name!r} is already the {seen[name]}")
            seen[name] = f"{attr} of layer {i}"
        check_int(layer.kv_heads, at, "kv_heads", 1)
        check_int(layer.head_size, at, "head_size", 1)
        if layer.dtype not in _MODEL_DTYPES:
            raise fail(at, f"dtype must be one of {', '.join(_MODEL_DTYPES)}, got {layer.dtype!r}")


def check_block_position(
    layer: object, start: object, length: object, n_layers: int, block_size: int, where: str
) -> None:
    """A block's layer index, start and length (no payloads)."""
    check_int(layer, where, "layer index", -_INT64_MAX - 1)
    if not 0 <= layer < n_layers:
        raise fail(where, f"layer index {layer} is out of range: the snapshot has {n_layers} layers")
    start = check_int(start, where, "start", 0)
    if start % block_size:
        raise fail(where, f"start {start} is not a multiple of block_size {block_size}")
    check_int(length, where, "length", 1, block_size)


def format_dtype(page_format: object, where: str, role: str) -> np.dtype:
    if not isinstance(page_format, str) or (page_format not in FORMATS and page_format not in QUANTIZED):
        raise fail(
            where, f"{role} page has unknown format {page_format!r} (supported: {', '.join([*FORMATS, *QUANTIZED])})"
        )
    return FORMATS.get(page_format, np.dtype(np.uint8))


def row_bytes(page_format: str, head_size: int, where: str, role: str) -> int:
    """Bytes of one token's packed codes; a float format's element bytes are handled by the caller."""
    bits = QUANTIZED[page_format][0]
    if head_size * bits % 8:
        raise fail(
            where,
            f"{role} page of format {page_format!r} needs head_size * {bits} bits to fill whole "
            f"bytes, head_size is {head_size}",
        )
    return head_size * bits // 8


def check_params(page_format: str, scale, zero_point, heads: int, head_size: int, where: str, role: str) -> None:
    """Quantization parameters: float32 [heads * G] each, G in {1, head_size}; scale > 0; zero points
    integral and in the format's code range (per channel: within a channel-zp header's reach)."""
    bits, lo, hi = QUANTIZED[page_format]
    for name, a in (("scale", scale), ("zero_point", zero_point)):
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.newbyteorder("<") != np.dtype("<f4"):
            raise fail(
                where,
                f"{role} page of format {page_format!r} needs a 1-D float32 {name}, got "
                f"{None if a is None else getattr(a, 'shape', type(a).__name__)}",
            )
    if scale.shape != zero_point.shape or scale.size not in (heads, heads * head_size):
        raise fail(
            where,
            f"{role} page scale/zero_point have {scale.size}/{zero_point.size} entries, expected "
            f"{heads} (one per head) or {heads * head_size} (one per head and channel)",
        )
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise fail(where, f"{role} page scales must be finite and > 0")
    if scale.size == heads * head_size and head_size > 1:  # a channel-zp header's zero points: z0 + w * o
        z0 = 0 if lo < 0 else 1 << (bits - 1)
        lo, hi = z0 - (128 << CHANNEL_ZP_MAX_UNIT_LOG2), z0 + (128 << CHANNEL_ZP_MAX_UNIT_LOG2)
    if not (
        np.isfinite(zero_point).all()
        and (zero_point == np.rint(zero_point)).all()
        and zero_point.min() >= lo
        and zero_point.max() <= hi
    ):
        raise fail(where, f"{role} page zero points must be integers in [{lo}, {hi}] ({page_format})")


def _check_page(page: object, role: str, shape: tuple[int, int, int], where: str) -> None:
    """One payload against its block's expected element shape ``[kv_heads, length, head_size]``."""
    if page is None:
        raise fail(where, f"missing {role} page")
    if not isinstance(page, PagePayload):
        raise fail(where, f"{role} page must be a PagePayload, got {type(page).__name__}")
    wire = format_dtype(page.format, where, role)
    data = page.data
    if not isinstance(data, np.ndarray):
        raise fail(where, f"{role} page data must be a numpy array, got {type(data).__name__}")
    if data.dtype.newbyteorder("<") != wire:
        raise fail(
            where,
            f"{role} page of format {page.format!r} must hold {wire.newbyteorder('=').name} "
            f"elements, got {data.dtype.name} (dtype mismatch)",
        )
    if page.format in QUANTIZED:
        packed = (shape[0], shape[1], row_bytes(page.format, shape[2], where, role))
        if data.shape != packed:
            raise fail(
                where,
                f"{role} page data has shape {data.shape}, expected {packed} "
                f"(kv_heads, length, packed code bytes per token)",
            )
        check_params(page.format, page.scale, page.zero_point, shape[0], shape[2], where, role)
        return
    if data.shape != shape:
        raise fail(where, f"{role} page data has shape {data.shape}, expected {shape} (kv_heads, length, head_size)")
    for attr in ("scale", "zero_point"):
        if getattr(page, attr) is not None:
            raise fail(where, f"{role} page of float format {page.format!r} must not have a {attr}")


def _check_coverage(
    blocks: list[tuple[int, int, int]], layer: int, length: int, first_position: int, block_size: int, where: str
) -> None:
    """One layer's blocks ``(start, length, index)`` sorted by start tile ``[s, length)``, ``s <= first_position``."""
    if not blocks:
        if first_position < length:
            raise fail(where, f"layer {layer} has no blocks: positions [{first_position}, {length}) are not covered")
        return
    first_start = blocks[0][0]
    if first_start > first_position:
        raise fail(
            where,
            f"layer {layer}: positions [{first_position}, {first_start}) are not covered "
            f"(its first block starts at {first_start})",
        )
    end = first_start
    for k, (start, block_length, index) in enumerate(blocks):
        if k and start == blocks[k - 1][0]:
            raise fail(
                where, f"layer {layer}: blocks {blocks[k - 1][2]} and {index} both start at {start} (duplicate block)"
            )
        if start > end:
            raise fail(where, f"layer {layer}: positions [{end}, {start}) are not covered (gap before block {index})")
        end = start + block_length
        if end > length:
            raise fail(
                where, f"layer {layer}: block {index} covers [{start}, {end}), past the sequence length {length}"
            )
        if k < len(blocks) - 1 and block_length != block_size:
            raise fail(
                where,
                f"layer {layer}: block {index} at start {start} holds {block_length} positions but "
                f"is not the layer's last block; every block before the last must hold "
                f"block_size {block_size}",
            )
    if end < length:
        raise fail(
            where,
            f"layer {layer}: positions [{end}, {length}) are not covered (blocks end at {end}, "
            f"sequence length is {length})",
        )


def check_snapshot(snapshot: object, api: str) -> None:
    if not isinstance(snapshot, CacheSnapshot):
        raise fail(api, f"expected a CacheSnapshot, got {type(snapshot).__name__}")
    block_size = check_int(snapshot.block_size, api, "block_size", 1)
    _check_text(snapshot.model_signature, api, "model_signature", allow_empty=True)
    layers = snapshot.layers
    check_layers(layers, api)
    if not isinstance(snapshot.sequences, list) or not snapshot.sequences:
        raise fail(api, f"sequences must be a non-empty list of SequenceRecord, got {_describe(snapshot.sequences)}")
    for i, seq in enumerate(snapshot.sequences):
        at = f"{api}: sequence {i}"
        if not isinstance(seq, SequenceRecord):
            raise fail(at, f"expected a SequenceRecord, got {type(seq).__name__}")
        length = check_int(seq.length, at, "length", 0)
        first_position = check_int(seq.first_position, at, "first_position", 0, length)
        if not isinstance(seq.blocks, list):
            raise fail(at, f"blocks must be a list of BlockRecord, got {type(seq.blocks).__name__}")
        by_layer: list[list[tuple[int, int, int]]] = [[] for _ in layers]
        for j, block in enumerate(seq.blocks):
            where = f"{at} block {j}"
            if not isinstance(block, BlockRecord):
                raise fail(where, f"expected a BlockRecord, got {type(block).__name__}")
            check_block_position(block.layer, block.start, block.length, len(layers), block_size, where)
            spec = layers[block.layer]
            shape = (spec.kv_heads, int(block.length), spec.head_size)
            _check_page(block.key, "key", shape, where)
            _check_page(block.value, "value", shape, where)
            by_layer[block.layer].append((int(block.start), int(block.length), j))
        for layer, blocks in enumerate(by_layer):
            _check_coverage(sorted(blocks), layer, length, first_position, block_size, at)
    _check_owed(snapshot, api)


def _check_owed(snapshot: CacheSnapshot, api: str) -> None:
    """The owed conversions: a list of :class:`OwedConversion`, each naming an existing layer, the role
    "key" or "value" and a page format, at most one per layer and role; ``owed_residual_tokens`` >= 0."""
    check_int(snapshot.owed_residual_tokens, api, "owed_residual_tokens", 0)
    if not isinstance(snapshot.owed, list):
        raise fail(api, f"owed must be a list of OwedConversion, got {_describe(snapshot.owed)}")
    seen = set()
    for i, owed in enumerate(snapshot.owed):
        at = f"{api}: owed conversion {i}"
        if not isinstance(owed, OwedConversion):
            raise fail(at, f"expected an OwedConversion, got {type(owed).__name__}")
        layer = check_int(owed.layer, at, "layer", 0, len(snapshot.layers) - 1)
        if owed.role not in ("key", "value"):
            raise fail(at, f"role must be 'key' or 'value', got {owed.role!r:.60}")
        if owed.format not in FORMATS and owed.format not in QUANTIZED:
            raise fail(
                at, f"unknown page format {owed.format!r:.60} (expected one of {', '.join([*FORMATS, *QUANTIZED])})"
            )
        if (layer, owed.role) in seen:
            raise fail(at, f"a second conversion of layer {layer}'s {owed.role} pages (one per layer and role)")
        seen.add((layer, owed.role))


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
    overlap); every owed conversion names an existing layer, the role
    ``key`` or ``value`` and a page format, at most one per layer and role,
    and ``owed_residual_tokens >= 0``; all integers fit in int64; strings are
    UTF-8 encodable.

    The rules concern the snapshot alone: whether it fits a model or a
    state (names, geometry, capacity, pages) is checked by the loader
    (:func:`onnxkv.cache.snapshot.paged_from_snapshot`).
    """
    check_snapshot(snapshot, "validate")


def check_counts(expected: Expectation, signature: str, block_size: int, layers: int, sequences: int, api: str) -> None:
    if expected.model_signature is not None and signature != expected.model_signature:
        raise InputError(f"{api}: the saved cache belongs to another model (signature mismatch)")
    if block_size != expected.block_size:
        raise InputError(
            f"{api}: the saved cache has block_size={block_size}, the state uses {expected.block_size}; "
            f"create the state with block_size={block_size}"
        )
    if layers != len(expected.layers):
        raise InputError(f"{api}: the saved cache has {layers} layers, the model has {len(expected.layers)}")
    if expected.max_sequences is not None and sequences > expected.max_sequences:
        raise InputError(
            f"{api}: the saved cache has {sequences} sequences, the state can hold at most "
            f"{expected.max_sequences} rows (each needs a page of its own to run)"
        )


def check_layer_specs(expected: Expectation, layers: list[LayerSpec], api: str) -> None:
    for i, (got, want) in enumerate(zip(layers, expected.layers)):
        if got != want:
            saved = (got.key_name, got.value_name, got.kv_heads, got.head_size, got.dtype)
            model = (want.key_name, want.value_name, want.kv_heads, want.head_size, want.dtype)
            raise InputError(
                f"{api}: saved layer {i} (names, kv_heads, head_size, dtype) {saved} does not match the model's {model}"
            )


def check_expectation(snapshot: CacheSnapshot, expected: Expectation, api: str = "check_expectation") -> None:
    """Raise :class:`~onnxkv.errors.InputError` (messages start with ``api``) unless ``snapshot`` has
    ``expected``'s signature (if given), block size and layers and at most its ``max_sequences`` sequences."""
    check_counts(
        expected, snapshot.model_signature, snapshot.block_size, len(snapshot.layers), len(snapshot.sequences), api
    )
    check_layer_specs(expected, snapshot.layers, api)
