"""Cache files are hostile input: hand-made and fuzzed files against ``State.load_cache``.

Valid files come from real states (the embedded model: float32, float16 and
bfloat16 storage, the quantized policies, ``quantize_pages``, a batch after
``reorder``; a sliding-window model whose rows start past position 0).  They
are decoded to ``PagedCacheProto``, mutated field by field (boundary integers,
dropped, duplicated and reordered entries, truncated, extended and swapped
payloads, other format names and scales, huge repeated counts) or byte by
byte, and re-framed with a correct CRC-32 and length so that the mutations
reach the validator and the loader.  Each is loaded into a paged state whose
fork is live.  The property: the load succeeds and the state is consistent
(pool audit, lengths as declared, ``save_cache`` round trips, the next run
works or runs out of the pool's pages or the state's capacity and publishes
nothing), or it raises an onnxkv error and the state, its pool, its allocator
and its fork are exactly as they were.

Budgets come from ``tests/fuzzing.py`` (``ONNXKV_FUZZ_SCALE``); a failure
names the case, the seed and the iteration.
"""

from __future__ import annotations

import dataclasses
import secrets
import struct
import zlib
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from fuzzing import SCALE, examples

import onnxkv
from onnxkv import CacheConfig
from onnxkv.cache import serialize
from onnxkv.cache.serialize import MAGIC, VERSION, PagedCacheProto
from onnxkv.errors import CacheCapacityError, InputError, OutOfMemory, SerializationError
from onnxkv.zoo.builders import MICRO, build_model
from onnxkv.zoo.embedded import embedded_model_dir

HEADER = 24  # magic, uint32 version, uint32 CRC-32, uint64 body length (paged_cache.proto)
REJECTIONS = (SerializationError, InputError, OutOfMemory, CacheCapacityError)
#: Integers a mutation writes into int64 fields (and near the original value: see _near).
BOUNDARY = (-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**36, 2**62, 2**63 - 1, -(2**63))
FORMATS = ("float32", "float16", "bfloat16", "int8", "uint8", "int4", "uint4", "int2", "uint2")
#: 0 in CI (the failures reproduce); random when ONNXKV_FUZZ_SCALE > 1 (each run explores new files).
SEED = 0 if SCALE == 1 else secrets.randbits(32)

# mutated scales make float16 pages overflow to inf when they are copied: that is data, not an error
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


# --------------------------------------------------------------------------- models and states


@pytest.fixture(scope="module")
def embedded():
    return onnxkv.Session(str(embedded_model_dir()), threads=1)


@pytest.fixture(scope="module")
def windowed():
    """MICRO with GroupQueryAttention's local_window_size 6: paged states evict pages below their window."""
    model = build_model("gqa", MICRO, seed=9)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            for a in node.attribute:
                if a.name == "local_window_size":
                    a.i = 6
    return onnxkv.Session(onnxkv.load(model), threads=1)


def _prompt(state, rows: int, tokens: int, seed: int) -> None:
    ids = np.random.default_rng(seed).integers(0, 97, (rows, tokens))
    state.run({"input_ids": ids, "attention_mask": np.ones((rows, tokens), np.int64)})


def _step(state, seed: int) -> dict:
    """One token per row, each row continuing from its own length (right-padded mask)."""
    lengths = state.lengths
    mask = (np.arange(int(lengths.max()) + 1)[None, :] <= lengths[:, None]).astype(np.int64)
    ids = np.random.default_rng(seed).integers(0, 97, (len(lengths), 1))
    return state.run({"input_ids": ids, "attention_mask": mask})


def _quantize_pages(state) -> None:
    state.quantize_pages([0, 1], "int4", "uint8")
    state.quantize_pages([2], "bfloat16", "float16")


#: name -> (session fixture, CacheConfig fields (paged, block_size 4 unless given), rows, prompt tokens,
#: decode steps, edit after the steps)
CASES: dict[str, tuple[str, dict, int, int, int, Callable | None]] = {
    "float32": ("embedded", {}, 1, 9, 1, None),
    "float16": ("embedded", {"kv_format": "fp16"}, 1, 9, 1, None),
    "bfloat16": ("embedded", {"kv_format": "bf16"}, 1, 9, 1, None),
    "int8": ("embedded", {"kv_format": "int8"}, 1, 13, 1, None),
    "int4": ("embedded", {"kv_format": "int4"}, 1, 13, 1, None),
    "int8-kivi": ("embedded", {"kv_format": "int8-kivi"}, 1, 13, 1, None),
    "int8-head": ("embedded", {"kv_format": "int8-head"}, 1, 13, 1, None),
    "quantize_pages": ("embedded", {}, 1, 13, 0, _quantize_pages),
    "reorder": ("embedded", {"kv_format": "int8"}, 2, 9, 0, lambda st: st.reorder([1, 0, 1])),
    "window": ("windowed", {"block_size": 2}, 1, 10, 6, None),
}


class Case:
    """A saved file of a real state, and a loading state (pre-filled, with a fork that wrote past it)."""

    def __init__(self, name: str, session, options: dict, rows: int, tokens: int, steps: int, edit) -> None:
        self.name, self.session = name, session
        self.config = CacheConfig("paged", **{"block_size": 4, **options})
        src = session.new_state(cache=self.config)
        _prompt(src, rows, tokens, 1)
        for i in range(steps):
            _step(src, 10 + i)
        if edit is not None:
            edit(src)
        self.blob = src.save_cache()
        src.close()
        # a bounded pool for half the cases: loads can run out of pages and files can be too large
        bounded = name in ("float32", "int8", "int8-kivi", "quantize_pages", "window")
        self.target = session.new_state(cache=dataclasses.replace(self.config, max_pages=48 if bounded else None))
        _prompt(self.target, 1, 6, 2)
        (self.sibling,) = self.target.fork()
        _step(self.sibling, 3)
        self.home = self.target.save_cache()

    def close(self) -> None:
        self.sibling.close()
        self.target.close()


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    session_name, options, rows, tokens, steps, edit = CASES[request.param]
    c = Case(request.param, request.getfixturevalue(session_name), options, rows, tokens, steps, edit)
    yield c
    c.close()


# --------------------------------------------------------------------------- the property


def _bits(values: dict) -> dict:
    return {k: v.view(np.dtype(f"u{v.dtype.itemsize}")).copy() for k, v in values.items()}


def _facts(case: Case) -> dict:
    """Everything a refused load must leave as it was."""
    target, pool = case.target, case.target.pool
    return {
        "tables": target.page_tables,
        "lengths": target.lengths,
        "first": target.first_positions,
        "refs": pool.core.refs().copy(),
        "live_pages": pool.live_pages,
        "converted": list(pool.converted),
        "formats": np.concatenate(pool.formats).copy(),
        "committed": pool.committed_bytes,
        "allocator_live": case.target.allocator.stats().live,
        "target": _bits(case.target.values),
        "sibling": _bits(case.sibling.values),
        "sibling_lengths": case.sibling.lengths.copy(),
    }


def _assert_same_facts(before: dict, after: dict, where: str) -> None:
    assert before.keys() == after.keys()
    for key, want in before.items():
        got = after[key]
        if isinstance(want, dict):
            assert want.keys() == got.keys(), where
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{where}: {key} {name}")
        else:
            np.testing.assert_array_equal(got, want, err_msg=f"{where}: {key}")


def _frame(body: bytes) -> bytes:
    return struct.pack("<8sIIQ", MAGIC, VERSION, zlib.crc32(body), len(body)) + body


def _check_load(case: Case, blob: bytes, where: str) -> str:
    """Load ``blob`` into the case's state and check the property; returns the outcome's name."""
    before = _facts(case)
    try:
        case.target.load_cache(blob)
    except REJECTIONS as exc:
        case.target.pool.audit()
        _assert_same_facts(before, _facts(case), f"{where}: refused with {type(exc).__name__}: {exc}")
        return "loader" if type(exc) is not SerializationError else "decoder"
    except Exception as exc:
        raise AssertionError(f"{where}: load_cache raised {type(exc).__name__}: {exc}") from exc
    try:
        case.target.pool.audit()
        saved = serialize.decode(blob)
        assert case.target.lengths.tolist() == [s.length for s in saved.sequences], where
        assert case.target.first_positions.tolist() == [s.first_position for s in saved.sequences], where
        after = _facts(case)
        np.testing.assert_array_equal(after["sibling_lengths"], before["sibling_lengths"], err_msg=where)
        for name, bits in before["sibling"].items():
            np.testing.assert_array_equal(after["sibling"][name], bits, err_msg=f"{where}: sibling {name}")
        with case.session.new_state(cache=case.config) as again:
            again.load_cache(case.target.save_cache())
            assert _bits(again.values).keys() == after["target"].keys()
            for name, bits in _bits(again.values).items():
                np.testing.assert_array_equal(bits, after["target"][name], err_msg=f"{where}: round trip {name}")
        lengths = case.target.lengths.copy()
        try:
            _step(case.target, 5)
            lengths += 1
        except (OutOfMemory, CacheCapacityError):  # the pool's or the state's limits: nothing was published
            pass
        np.testing.assert_array_equal(case.target.lengths, lengths, err_msg=where)
        case.target.pool.audit()
    except Exception as exc:
        raise AssertionError(f"{where}: loaded, then {type(exc).__name__}: {exc}") from exc
    case.target.load_cache(case.home)
    return "loaded"


# --------------------------------------------------------------------------- structure-aware mutations


def _pages(proto) -> list:
    return [getattr(b, role) for s in proto.sequences for b in s.blocks for role in ("key", "value")]


def _int_fields(proto) -> list[tuple[object, str]]:
    out = [(proto, "version"), (proto, "block_size")]
    out += [(layer, f) for layer in proto.layers for f in ("kv_heads", "head_size")]
    for seq in proto.sequences:
        out += [(seq, "length"), (seq, "first_position")]
        out += [(b, f) for b in seq.blocks for f in ("layer", "start", "length")]
    return out


def _between(rng, lo: int, hi: int) -> int:
    """A random int in [lo, hi], any width (Python ints: rng.integers stops at int64)."""
    return min(hi, lo + int(rng.random() * (hi - lo + 1)))


def _near(rng, value: int, bs: int) -> int:
    return int(np.clip(value + int(rng.choice([-bs, -1, 1, bs, 2 * bs])), -(2**63), 2**63 - 1))


def _pick(rng, items: list):
    """A random element of ``items`` (None if empty: earlier mutations may have emptied the message)."""
    return items[rng.integers(len(items))] if len(items) else None


def m_integer(rng, proto) -> str:
    msg, field = _pick(rng, _int_fields(proto))
    value = int(rng.choice(BOUNDARY)) if rng.random() < 0.6 else _near(rng, getattr(msg, field), proto.block_size)
    setattr(msg, field, value)
    return f"{type(msg).__name__}.{field}={value}"


def m_scale_dims(rng, proto) -> str:
    page = _pick(rng, [p for p in _pages(proto) if len(p.scale_dims)])
    if page is None:
        return m_integer(rng, proto)
    i, value = int(rng.integers(len(page.scale_dims))), int(rng.choice(BOUNDARY))
    page.scale_dims[i] = value
    return f"scale_dims[{i}]={value}"


def _containers(proto) -> list[tuple[str, object]]:
    out = [("layers", proto.layers), ("sequences", proto.sequences)]
    out += [(f"sequences[{i}].blocks", s.blocks) for i, s in enumerate(proto.sequences)]
    out += [("scale_dims", p.scale_dims) for p in _pages(proto) if len(p.scale_dims)]
    return out


def m_repeated(rng, proto) -> str:
    name, field = _pick(rng, _containers(proto))
    items = list(field)
    if not items:
        return f"{name} empty"
    op = rng.choice(["drop", "duplicate", "reverse", "shuffle", "clear"])
    if op == "drop":
        del items[rng.integers(len(items))]
    elif op == "duplicate":
        items.insert(int(rng.integers(len(items) + 1)), items[rng.integers(len(items))])
    elif op == "reverse":
        items.reverse()
    elif op == "shuffle":
        items = [items[k] for k in rng.permutation(len(items))]
    else:
        items = []
    copies = [type(x)() for x in items] if items and hasattr(items[0], "CopyFrom") else list(items)
    if items and hasattr(items[0], "CopyFrom"):
        for dst, src in zip(copies, items):
            dst.CopyFrom(src)
    del field[:]
    field.extend(copies)
    return f"{op} {name}"


def m_payload(rng, proto) -> str:
    pages = _pages(proto)
    page = _pick(rng, pages)
    if page is None:
        return m_integer(rng, proto)
    attr = str(rng.choice(["data", "scale", "zero_point"]))
    raw = getattr(page, attr)
    op = rng.choice(["truncate", "extend", "random", "swap", "empty"])
    if op == "truncate" and raw:
        value = raw[: int(rng.integers(len(raw)))]
    elif op == "extend":
        value = raw + rng.bytes(int(rng.choice([1, 2, 4, 64])))
    elif op == "random":
        value = rng.bytes(len(raw))
    elif op == "swap":
        other = _pick(rng, pages)
        value = getattr(other, attr)
        setattr(other, attr, raw)
    else:
        value = b""
    setattr(page, attr, value)
    return f"{op} {attr} ({len(raw)} -> {len(value)} bytes)"


def m_scale_values(rng, proto) -> str:
    attr = str(rng.choice(["scale", "zero_point"]))
    page = _pick(rng, [p for p in _pages(proto) if getattr(p, attr) and len(getattr(p, attr)) % 4 == 0])
    if page is None:
        return m_payload(rng, proto)
    values = np.frombuffer(getattr(page, attr), "<f4").copy()
    special = float(rng.choice([np.nan, np.inf, -np.inf, 0.0, -1.0, 1e-45, 3e38, 0.5, 127.0, 128.0, -129.0, 2**17]))
    values[rng.integers(values.size)] = special
    setattr(page, attr, values.tobytes())
    return f"{attr} element = {special}"


def m_strings(rng, proto) -> str:
    op = rng.choice(["format", "format", "dtype", "names", "signature"])
    page, layer, other = _pick(rng, _pages(proto)), _pick(rng, proto.layers), _pick(rng, proto.layers)
    if op == "format" and page is not None:
        page.format = str(rng.choice([*FORMATS, "int3", "", "float32\0", "FLOAT32"]))
        return f"format={page.format!r}"
    if op == "dtype" and layer is not None:
        layer.dtype = str(rng.choice(["float32", "float16", "bfloat16", "int8"]))
        return f"dtype={layer.dtype}"
    if op == "names" and layer is not None:
        layer.key_name, other.value_name = other.value_name, layer.key_name
        return "swap names"
    proto.model_signature = proto.model_signature[::-1]
    return "signature"


def m_truncate_row(rng, proto) -> str:
    """A consistent edit: a row keeps its first ``k`` whole blocks (the loader must take it)."""
    seq, bs = _pick(rng, proto.sequences), proto.block_size
    if seq is None or bs < 1 or seq.length < 0:
        return m_repeated(rng, proto)
    length = _between(rng, 0, seq.length // bs) * bs
    keep = [b for b in seq.blocks if b.start < length]
    del seq.blocks[:]
    seq.blocks.extend(keep)
    seq.length, seq.first_position = length, min(seq.first_position, length) // bs * bs
    return f"truncate row to {length}"


def m_evict(rng, proto) -> str:
    """Raise a row's first position and drop, or keep, the blocks wholly below it."""
    seq, bs = _pick(rng, proto.sequences), proto.block_size
    if seq is None or bs < 1 or not 0 <= seq.first_position <= seq.length:
        return m_repeated(rng, proto)
    first = _between(rng, seq.first_position, seq.length)
    seq.first_position = first
    if rng.random() < 0.5:
        keep = [b for b in seq.blocks if b.start + bs > first // bs * bs]
        del seq.blocks[:]
        seq.blocks.extend(keep)
    return f"first_position={first}"


def m_same_size_format(rng, proto) -> str:
    """float16 <-> bfloat16 and key <-> value payload swaps: sizes stay consistent."""
    block = _pick(rng, [b for s in proto.sequences for b in s.blocks])
    if block is None:
        return m_repeated(rng, proto)
    if rng.random() < 0.5:
        key = type(block.key)()
        key.CopyFrom(block.key)
        block.key.CopyFrom(block.value)
        block.value.CopyFrom(key)
        return "swap key and value pages"
    page = block.key if rng.random() < 0.5 else block.value
    page.format = {
        "float16": "bfloat16",
        "bfloat16": "float16",
        "int8": "uint8",
        "uint8": "int8",
        "int4": "uint4",
        "uint4": "int4",
    }.get(page.format, page.format)
    return f"format -> {page.format}"


def m_huge_counts(rng, proto) -> str:
    op = rng.choice(["scale_dims", "sequences", "blocks"])
    page, seq = _pick(rng, _pages(proto)), _pick(rng, [s for s in proto.sequences if len(s.blocks)])
    if op == "scale_dims" and page is not None:
        page.scale_dims.extend([1] * 100_000)
    elif op == "blocks" and seq is not None:
        seq.blocks.extend([seq.blocks[0]] * 1_000)
    else:
        op = "sequences"
        for _ in range(10_000):
            proto.sequences.add()
    return f"huge {op}"


MUTATIONS = [
    m_integer,
    m_integer,
    m_scale_dims,
    m_repeated,
    m_repeated,
    m_payload,
    m_scale_values,
    m_strings,
    m_truncate_row,
    m_evict,
    m_evict,
    m_same_size_format,
    m_same_size_format,
    m_huge_counts,
]


def _mutated(case: Case, rng) -> tuple[bytes, list[str]]:
    proto = PagedCacheProto()
    proto.ParseFromString(case.blob[HEADER:])
    done = [MUTATIONS[rng.integers(len(MUTATIONS))](rng, proto) for _ in range(int(rng.integers(1, 4)))]
    return _frame(proto.SerializeToString()), done


# --------------------------------------------------------------------------- tests


def test_structure_aware_mutations_load_consistently_or_change_nothing(case):
    outcomes = Counter()
    for i in range(examples(15)):
        rng = np.random.default_rng([SEED, list(CASES).index(case.name), i])
        blob, done = _mutated(case, rng)
        outcomes[_check_load(case, blob, f"case {case.name} seed {SEED} iteration {i} {done}")] += 1
    # the mutations reach every stage: the decoder, the loader's checks, and successful loads
    assert outcomes["decoder"] and outcomes["loaded"] + outcomes["loader"], outcomes


def test_byte_flips_with_a_correct_checksum_load_consistently_or_change_nothing(case):
    body = case.blob[HEADER:]
    for i in range(examples(6)):
        rng = np.random.default_rng([SEED, list(CASES).index(case.name), i, 1])
        corrupt = bytearray(body)
        for offset in rng.integers(0, len(body), int(rng.integers(1, 5))):
            corrupt[offset] ^= int(rng.integers(1, 256))
        _check_load(case, _frame(bytes(corrupt)), f"case {case.name} seed {SEED} flip {i}")


def test_the_unmutated_file_loads(case):
    assert _check_load(case, case.blob, f"case {case.name}") == "loaded"


# --------------------------------------------------------------------------- hand-made hostile files


def _edited(blob: bytes, edit: Callable[[PagedCacheProto], None]) -> bytes:
    proto = PagedCacheProto()
    proto.ParseFromString(blob[HEADER:])
    edit(proto)
    return _frame(proto.SerializeToString())


def _state_with_fork(session, windowed: bool = False) -> tuple:
    """A paged state (block size 4) whose fork alone holds the pool's last page id, with free ids below it."""
    if not windowed:  # max_pages 5: the fork's copy of block 3 is id 4; id 3 is free again
        target = session.new_state(cache=CacheConfig("paged", block_size=4, max_pages=5))
        _prompt(target, 1, 13, 2)
        (fork,) = target.fork()
        _step(fork, 3)
        target.truncate(8)
        assert target.page_tables.tolist() == [[0, 1]] and fork.page_tables.tolist() == [[0, 1, 2, 4]]
        return target, fork
    # max_pages 6: the window evicts ids 0..3, the target's copy of block 5 is id 3; the fork keeps id 5
    target = session.new_state(cache=CacheConfig("paged", block_size=4, max_pages=6))
    _prompt(target, 1, 21, 2)
    (fork,) = target.fork()
    _step(target, 3)
    assert target.page_tables.tolist() == [[-1, -1, -1, -1, 4, 3]]
    assert fork.page_tables.tolist() == [[-1, -1, -1, -1, 4, 5]]
    return target, fork


def _snapshot_facts(state, fork) -> tuple:
    return (
        state.page_tables.tolist(),
        state.lengths.tolist(),
        state.first_positions.tolist(),
        state.pool.core.refs().tolist(),
        state.allocator.stats().live,
        _bits(state.values),
        _bits(fork.values),
    )


def _assert_refused(state, fork, blob: bytes, error, pattern: str) -> None:
    before = _snapshot_facts(state, fork)
    with pytest.raises(error, match=pattern):
        state.load_cache(blob)
    after = _snapshot_facts(state, fork)
    assert after[:5] == before[:5]
    for got, want in zip(after[5:], before[5:]):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    state.pool.audit()


def test_a_block_below_the_first_position_never_writes_into_a_forks_page(embedded):
    """The saved row keeps blocks 0 and 1 below its first position 8: the table had no page for them, and the
    load wrote them into page id -1, the fork's last page."""
    with embedded.new_state(cache=CacheConfig("paged", block_size=4)) as src:
        _prompt(src, 1, 9, 1)
        blob = _edited(src.save_cache(), lambda p: setattr(p.sequences[0], "first_position", 8))
    target, fork = _state_with_fork(embedded)
    _assert_refused(
        target,
        fork,
        blob,
        InputError,
        "State.load_cache: sequence 0 has first_position 8 .*the model "
        "attends to every position: first_position must be at most 0",
    )
    fork.close()
    target.close()


def _add_blocks_below_first(proto: PagedCacheProto) -> None:
    """Give every layer of row 0 blocks from position 0 up to its first block (copies of that block's pages)."""
    seq, bs = proto.sequences[0], proto.block_size
    lowest = seq.first_position // bs * bs
    for block in [b for b in seq.blocks if b.start == lowest]:
        for start in range(0, lowest, bs):
            extra = seq.blocks.add()
            extra.CopyFrom(block)
            extra.start = start


def test_a_windowed_load_drops_the_blocks_below_the_first_position(windowed):
    """Blocks below the first position are allowed in a file; they used to be installed into page id -1."""
    with windowed.new_state(cache=CacheConfig("paged", block_size=4)) as src:
        _prompt(src, 1, 13, 1)
        saved = src.save_cache()
        want = {name: v[:, :, 8:] for name, v in src.values.items()}
    blob = _edited(saved, _add_blocks_below_first)
    assert (
        serialize.decode(blob).sequences[0].first_position == 8 and len(serialize.decode(blob).sequences[0].blocks) == 8
    )
    target, fork = _state_with_fork(windowed, windowed=True)
    fork_before = _bits(fork.values)
    target.load_cache(blob)
    assert target.page_tables[0, :2].tolist() == [-1, -1] and target.pool.live_pages == 4
    for name, v in target.values.items():
        np.testing.assert_array_equal(v[:, :, 8:], want[name])
    for name, bits in _bits(fork.values).items():
        np.testing.assert_array_equal(bits, fork_before[name])
    target.pool.audit()
    fork.close()
    target.close()


def _row_without_payload(length: int, held: int | None) -> Callable[[PagedCacheProto], None]:
    """Append a row of ``length`` positions holding none (first_position = length), or only its last ``held``
    positions (copies of row 0's first full block)."""

    def edit(proto):
        seq = proto.sequences.add(length=length, first_position=length)
        if held is not None:
            bs = proto.block_size
            seq.first_position = length - held
            first = min(b.start for b in proto.sequences[0].blocks)
            for block in [b for b in proto.sequences[0].blocks if b.start == first]:
                for start in range((length - held) // bs * bs, length, bs):
                    extra = seq.blocks.add()
                    extra.CopyFrom(block)
                    extra.start = start

    return edit


@pytest.mark.parametrize("length", [2**27, 2**36, 2**62])
@pytest.mark.parametrize("model", ["embedded", "windowed"])
def test_positions_a_file_declares_but_does_not_hold_are_refused_before_any_page(model, length, request):
    """2^36 and 2^62 used to fail allocating the page table after the other rows' pages were taken (MemoryError or
    ValueError, pages leaked); a 5 KB file declaring 2^27 positions was accepted at a cost of 256 MB."""
    session = request.getfixturevalue(model)
    with session.new_state(cache=CacheConfig("paged", block_size=4)) as src:
        _prompt(src, 1, 4, 1)  # one page: the pool has room for this row and the held part of the other
        saved = src.save_cache()
    held = None if model == "embedded" else 5  # the windowed model's next query reads the last 5 positions
    blob = _edited(saved, _row_without_payload(length, held))
    assert len(blob) < 70_000
    target, fork = _state_with_fork(session, windowed=held is not None)
    pattern = (
        "sequence 1 has first_position .* attends to every position"
        if held is None
        else rf"declares rows of up to {length} positions, a page table of 2 x {length // 4} int32 entries"
    )
    _assert_refused(target, fork, blob, InputError, pattern)
    fork.close()
    target.close()


def test_a_file_larger_than_the_pool_can_hold_is_refused_before_it_is_read(embedded, tmp_path):
    target, fork = _state_with_fork(embedded)
    path = tmp_path / "huge.okvc"
    with open(path, "wb") as f:
        f.write(target.save_cache())
        f.truncate(64 << 20)  # sparse
    _assert_refused(
        target,
        fork,
        str(path),
        InputError,
        rf"load\('.*huge\.okvc'\): the input holds {64 << 20} "
        r"bytes, more than max_bytes=\d+ \(nothing was parsed\)",
    )
    fork.close()
    target.close()
