"""``ai.onnxkv::PositionTable``: values computed entry by entry from positions, read from tables.

Written by :func:`onnxkv.plan.fusion_position.fuse_position_tables` over the
nodes that turn ``position_ids`` [B, S] into an export's rotary cosines and
sines (its ``body``; :mod:`onnxkv.plan.position_cone` proves that each output
entry ``[..., b, ..., s, ...]`` depends on ``position_ids[b, s]`` alone).
Inputs: the positions, then the constants the body reads.  Outputs: the cone's
outputs, each ``[B, S, features]`` in memory (unit axes anywhere).

At build, the body is evaluated once on the positions ``0 .. rows - 1``
(attribute ``rows``), with onnxkv's own kernels, into one float32 table per
distinct output (``[rows, features]``); a spot check evaluates the body again
on single positions, as a decode step does, and keeps the tables only when
every row is bit for bit what the body gives there.  A run whose positions are
a C-contiguous int64 [B, S] array within ``[0, rows)`` copies table rows (the
``gather_rows`` kernel, without wrapping: a negative position is not a row); any
other run evaluates the body literally, with the same values and errors as the
unfused graph.  A compiled step replays the row copies (a replay refuses
positions outside the tables, and that run evaluates the body).

A run whose positions pass the tables' end grows them: the tables are built
again, checked the same way, for the positions doubled until they cover it,
as long as all of them together stay within :data:`MAX_TABLE_BYTES`; compiled
steps recorded with the smaller tables are then dropped
(:func:`~onnxkv.plan.registry.bump_baked_epoch`).  Positions past that limit,
or tables whose check fails, evaluate the body.
"""

from __future__ import annotations

import numpy as np

from onnxkv._kernels.gather import gather_rows
from onnxkv.plan.context import RunContext
from onnxkv.plan.fusion import FUSED_DOMAIN
from onnxkv.plan.ops._body import Body
from onnxkv.plan.registry import BuildContext, Op, bump_baked_epoch, register

__all__ = ["MAX_TABLE_BYTES", "PositionTable"]

#: Positions the spot check evaluates one at a time (besides the first and last rows).
_SPOT_CHECKS = 16
#: The bytes a node's tables may grow to, all outputs together.
MAX_TABLE_BYTES = 64 << 20


def _numpy_context() -> RunContext:
    """A run context whose allocations are plain NumPy arrays (the body's evaluation at build time)."""
    return RunContext(lambda _rt, _i, shape, dtype: np.empty(shape, dtype), False, 0)


@register("PositionTable", domain=FUSED_DOMAIN, internal=True)
class PositionTable(Op):
    """Kernel of one PositionTable node (see the module docstring)."""

    def __init__(self, node, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.body = Body.of(self, ctx, ("positions",))
        self.rows = int(self.attrs.get("rows", 0))
        if self.rows < 1:
            raise self.error(f"attribute rows = {self.rows}; expected a positive count of positions")
        axes = list(self.attrs.get("position_axes", []))
        if len(axes) != 2 * len(node.output) or any(not 0 <= a < b for a, b in zip(axes[::2], axes[1::2])):
            raise self.error(f"attribute position_axes = {axes}; expected two increasing axes per output")
        self._axes = list(zip(axes[::2], axes[1::2]))
        #: Per output, its shape with -1 and -2 where the positions' two dims go.
        self._shapes: list[tuple] = []
        constants = [ctx.constant(n) if n else None for n in node.input[1:]]
        tables = self._tables(self.rows, constants)
        #: (rows, per output its table [rows, features] (tables of equal values are one array)), or None: the
        #: positions the tables hold, replaced whole when they grow (runs read one snapshot).
        self._cover: tuple[int, list[np.ndarray]] | None = None if tables is None else (self.rows, tables)
        #: The row count whose tables failed their check (no run tries it again).
        self._failed = 0

    def _evaluate(self, positions: np.ndarray, constants: list) -> list[np.ndarray] | None:
        inputs = [positions, *constants]
        if any(x is None for n, x in zip(self.node.input[1:], constants) if n):
            return None
        try:
            return self.body.evaluate(self.node.input, inputs, _numpy_context())
        except Exception:  # a body that fails here runs literally, and fails there as the graph does
            return None

    def _tables(self, rows: int, constants: list) -> list[np.ndarray] | None:
        """The tables of positions ``0 .. rows - 1``, or None when the body does not give one row per position
        or a single-position evaluation differs from its row."""
        whole = self._evaluate(np.arange(rows, dtype=np.int64).reshape(1, rows), constants)
        if whole is None or any(
            y.dtype != np.float32 or y.ndim <= a1 or y.shape[a0] != 1 or y.shape[a1] != rows
            for y, (a0, a1) in zip(whole, self._axes)
        ):
            return None
        if not self._shapes:
            for y, (a0, a1) in zip(whole, self._axes):
                shape = list(y.shape)
                shape[a0], shape[a1] = -1, -2
                self._shapes.append(tuple(shape))
        tables: list[np.ndarray] = []
        for y in whole:
            table = np.ascontiguousarray(y.reshape(rows, -1))
            table = next((t for t in tables if t.shape == table.shape and np.array_equal(t, table)), table)
            table.flags.writeable = False
            tables.append(table)
        spots = np.unique(np.r_[0, rows - 1, np.linspace(0, rows - 1, _SPOT_CHECKS).astype(np.int64)])
        for p in spots:
            one = self._evaluate(np.full((1, 1), p, np.int64), constants)
            if one is None or any(not np.array_equal(o.reshape(-1), t[p]) for o, t in zip(one, tables)):
                return None
        return tables

    @staticmethod
    def _readable(positions) -> bool:
        """Whether ``positions`` is a non-empty C-contiguous int64 [B, S] array of no negative value."""
        return (
            type(positions) is np.ndarray
            and positions.dtype == np.int64
            and positions.ndim == 2
            and positions.size > 0
            and positions.flags.c_contiguous
            and positions.min() >= 0
        )

    def _covering(self, positions) -> tuple[int, list[np.ndarray]] | None:
        """The tables when ``positions`` is :meth:`_readable` and within them, else None."""
        cover = self._cover
        return cover if cover is not None and self._readable(positions) and positions.max() < cover[0] else None

    def _grown(self, positions, constants: list) -> tuple[int, list[np.ndarray]] | None:
        """The tables grown to cover ``positions`` (see the module docstring), or None."""
        cover = self._cover
        if cover is None or not self._readable(positions):
            return None
        top = int(positions.max())
        if top < cover[0]:
            return None
        rows = cover[0]
        while rows <= top:
            rows *= 2
        per_row = sum(t.shape[1] * t.itemsize for t in {id(t): t for t in cover[1]}.values())
        if rows * per_row > MAX_TABLE_BYTES or rows == self._failed:
            return None
        tables = self._tables(rows, constants)
        if tables is None:
            self._failed = rows
            return None
        self._cover = (rows, tables)
        bump_baked_epoch()  # compiled steps read the smaller tables: record them again
        return self._cover

    #: Reads nothing through BLAS (table rows, or the body's element-wise operators).
    uses_blas = False

    def compilable(self, inputs: list) -> bool:
        """Positions the tables cover: one recorded row copy per output, whose replay refuses positions outside
        them (the run then evaluates the body, or grows the tables)."""
        return self._covering(inputs[0]) is not None

    def run(self, inputs: list, rt) -> tuple:
        positions = inputs[0]
        cover = self._covering(positions) or self._grown(positions, list(inputs[1:]))
        if cover is None:
            return tuple(self.body.evaluate(self.node.input, inputs, rt))
        b, s = positions.shape
        flat = positions.reshape(-1)
        outs = []
        for j, (table, shape) in enumerate(zip(cover[1], self._shapes)):
            out = rt.empty(j, tuple(b if d == -1 else s if d == -2 else d for d in shape), np.float32)
            gather_rows(table, flat, out.reshape(b * s, table.shape[1]), wrap=False)
            outs.append(out)
        return tuple(outs)
