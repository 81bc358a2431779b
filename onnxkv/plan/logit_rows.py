"""Logits at chosen positions only: the LM head of a prompt chunk computed for the rows a caller reads.

A prompt chunk of S tokens makes logits [B, S, V], of which generation reads
one row per sequence (its last fed token).  The LM head is one of the widest
products of a decoder (V columns; 8,000 to 256,000), so computing it for all S
rows costs up to a quarter of a prompt's time and S * V * 4 bytes.  A run given
``logits_at`` (one position per batch row) instead feeds the head only those
rows: its logits output is [B, 1, V], row b equal to row ``logits_at[b]`` of
the full output.  ``logits_at`` [B, K] (K positions per row, as a run of
segments reads the last token of each of its rows: :meth:`State.run
<onnxkv.runtime.state.State.run>`) makes [B, K, V].

:func:`find_head` finds, once per plan and logits output, the node where rows
can be taken: a product computing each row of its output from the same row of
its inputs (a MatMul with a packed weight, a MatMulNBits, either fused after a
norm) whose output reaches the logits output only through elementwise nodes
whose other operands are constants that broadcast along the last axis alone
(a bias, a softcap scale, a Cast).  Its inputs of one row per token ([B, S, H])
are then replaced, just before the head runs, by their rows at ``logits_at``
(:func:`take_rows`); nothing read later sees a replaced value
(:func:`find_head` checks that the head is its last reader, and that it is
computed by the plan: no graph input or output).  A graph without such a node, or a run whose A
value is not [B, S, H], computes every row and takes them from the output:
the same result, without the saving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from onnxkv.errors import InputError

if TYPE_CHECKING:
    from onnxkv.plan.plan import Plan

__all__ = ["LogitHead", "checked_positions", "find_head", "take_rows", "rows_of_output"]

#: Nodes between the head MatMul and the logits output that act on each row alone (with constant operands
#: that broadcast along the last axis only, see ``_row_wise``; Softcap: the fused Div, Tanh and Mul).
_ELEMENTWISE = frozenset({"Cast", "Identity", "Tanh", "Div", "Mul", "Add", "Sub", "Softcap"})


@dataclass(frozen=True)
class LogitHead:
    """Where a run given ``logits_at`` takes rows: before node ``node`` (the head product, an index into
    the plan's steps), in the slots ``rows`` (its inputs of one row per token: A, and a skip norm's skip)."""

    node: int
    rows: tuple[int, ...]


def _row_wise(plan: Plan, k: int, value: int) -> bool:
    """Node ``k`` is elementwise, reads ``value`` once, and its other inputs are constants of rank at most 3
    with every axis but the last of size 1 (they broadcast the same way over [B, 1, V] as over [B, S, V],
    and add no axis)."""
    ins = plan.in_idx[k]
    if plan.nodes[k].op_type not in _ELEMENTWISE or ins.count(value) != 1:
        return False
    for s in ins:
        c = plan._template[s] if s >= 0 and s != value else None
        if s != value and (not isinstance(c, np.ndarray) or c.ndim > 3 or any(d != 1 for d in c.shape[:-1])):
            return False
    return True


def _is_head(kernel) -> bool:
    """A product computing each output row from the same row of its non-constant inputs alone: a MatMul
    with a packed weight, a MatMulNBits or MatMulBnb4, or a PrologueMatMul (a row-wise norm, then one of those) whose
    skip sum the graph does not read."""
    from onnxkv.plan.ops.matmul import MatMul
    from onnxkv.plan.ops.matmul_bnb4 import MatMulBnb4
    from onnxkv.plan.ops.matmul_nbits import MatMulNBits
    from onnxkv.plan.ops.prologue_matmul import PrologueMatMul

    if isinstance(kernel, PrologueMatMul):
        return kernel.sum_index is None and kernel.kind != "SiluMul" and _is_head(kernel.product)
    return (isinstance(kernel, MatMul) and kernel.packed is not None) or type(kernel) in (MatMulNBits, MatMulBnb4)


def find_head(plan: Plan, logits: str | None) -> LogitHead | None:
    """The node of ``plan`` before which rows of the logits output ``logits`` can be taken, or None (see
    the module docstring)."""
    slot = plan.slot_of.get(logits) if logits else None
    if slot is None:
        return None
    producer = {s: k for k, outs in enumerate(plan.out_idx) for s in outs if s >= 0}
    readers: dict[int, list[int]] = {}
    for k, ins in enumerate(plan.in_idx):
        for s in ins:
            readers.setdefault(s, []).append(k)
    outputs, inputs = set(plan.output_slots), set(plan.nested_slots)
    k = producer.get(slot)
    while k is not None and not _is_head(plan.kernels[k]):
        value = [s for s in plan.in_idx[k] if s in producer or s in inputs]
        if len(value) != 1 or not _row_wise(plan, k, value[0]) or value[0] in outputs or readers[value[0]] != [k]:
            return None
        k = producer.get(value[0])
    if k is None or len(plan.out_idx[k]) != 1:
        return None
    rows = tuple(dict.fromkeys(s for s in plan.in_idx[k] if s in producer or s in inputs))
    # Replaced values: computed by the plan (never the caller's arrays), read by nothing after the head.
    if not rows or any(s in outputs or s in inputs or max(readers[s]) != k for s in rows):
        return None
    return LogitHead(k, rows)


def take_rows(head: LogitHead, slots: list, at: np.ndarray) -> bool:
    """Replace the values of ``head.rows`` in ``slots`` by their rows at ``at`` ([B] positions, or [B, K]
    positions per row, checked by the caller to lie in [0, S)): new C-contiguous [B, 1, H] ([B, K, H])
    arrays.  False, with nothing replaced, when one of them is not [B, S, H] with the same B and S (the
    caller then takes the rows from the output)."""
    values = [slots[s] for s in head.rows]
    shape = getattr(values[0], "shape", ())
    if any(not isinstance(v, np.ndarray) or v.ndim != 3 or v.shape[:2] != shape[:2] for v in values):
        return False
    if shape[0] != at.shape[0]:
        return False
    b, cols = np.arange(shape[0])[:, None], at.reshape(shape[0], -1)
    for s, v in zip(head.rows, values):
        slots[s] = np.ascontiguousarray(v[b, cols])
    return True


def rows_of_output(logits: np.ndarray, at: np.ndarray, length: int) -> np.ndarray:
    """The logits of a run that computed every row, at positions ``at``: [B, 1, V] ([B, K, V] for ``at``
    [B, K]) from [B, S, V] (S = ``length``, the tokens fed); an output of another shape (a graph that
    computes some positions only) is returned as it is."""
    if logits.ndim != 3 or logits.shape[:2] != (at.shape[0], length):
        return logits
    return np.ascontiguousarray(logits[np.arange(logits.shape[0])[:, None], at.reshape(at.shape[0], -1)])


def checked_positions(at, ids, api: str) -> tuple[np.ndarray, int]:
    """``at`` as int64 [B] (one position per row of the fed token ids ``ids`` [B, S], each in [0, S)) or
    [B, K] (1 <= K <= S positions per row: more would repeat one), and S.  InputError naming ``api``
    otherwise (compared in ``at``'s own width, before any conversion)."""
    shape = getattr(ids, "shape", None)
    if shape is None or len(shape) != 2:
        raise InputError(f"{api}: logits_at needs token ids fed as [batch, tokens]; the feed has shape {shape}")
    a = np.asarray(at)
    if a.dtype.kind not in "iu" or not (
        a.shape == (shape[0],) or (a.ndim == 2 and a.shape[0] == shape[0] and 1 <= a.shape[1] <= shape[1])
    ):
        raise InputError(
            f"{api}: logits_at has dtype {a.dtype} and shape {a.shape}; expected {shape[0]} integer "
            f"positions (one per batch row), or [{shape[0]}, K] (1 <= K <= {shape[1]} per row)"
        )
    if a.size and (int(a.min()) < 0 or int(a.max()) >= shape[1]):
        raise InputError(
            f"{api}: logits_at holds positions from {a.min()} to {a.max()}; expected positions in "
            f"[0, {shape[1]}) (the tokens fed)"
        )
    return a.astype(np.int64), int(shape[1])
