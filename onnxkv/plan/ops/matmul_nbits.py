"""``com.microsoft::MatMulNBits``: Y = A @ dequant(B) (+ bias), B in 4- or 8-bit blocks along K.

The contract is ONNX Runtime's contrib operator: A float32 or float16
[..., K]; B uint8 [N, ceil(K / block_size), block_size * bits / 8] (4-bit codes
low nibble first); scales [N * n_blocks] (or [N, n_blocks]) of A's type;
optional zero_points (uint8 packed like B along a column's blocks, or of A's
type; absent: 2^(bits-1)); optional g_idx (int32 [K], act-order groups);
optional bias [N];
attributes K, N, bits (default 4), block_size (power of two >= 16),
accuracy_level (default 0).  w[k, n] = (q[n, k] - zp[n, b]) * scale[n, b],
b = k // block_size.

onnxkv runs bits 4 and 8 and block sizes 16..256.  B, scales and zero_points
must be initializers: they are repacked once, when the kernel object is built,
into :class:`onnxkv._kernels.qmatmul.PackedNBits` (the op absorbs them, so the
plan drops its own copies and a memory-mapped B has its pages released).
A node with ``g_idx`` is a load error (the GenAI builder never emits it, and
ONNX Runtime's CPU kernel reads packed zero points differently when it is
given, even for the identity grouping).

``accuracy_level`` 4 quantizes A to int8 per block at every row count unless
the zero points are floats (as ONNX Runtime's CPU kernel does; qmatmul.h gives
the exact arithmetic, the same bits on every instruction set); for prompt-sized
products the integer dot products are also faster than float32 ones.  Levels 0..3 keep A in float32:
up to ``DECODE_M`` rows in the block kernels, above on dequantized panels
with the packed float32 kernel (faster than NumPy's BLAS on dequantized
columns at every prompt size: 1,024 x 1,024 x 2,816 at 2 threads 28 ms
against 42, and no BLAS thread left spinning on a core).  Up to ``STEP_M``
rows a product is compilable (a compiled step records it).  float16 A,
scales, zero points and bias are converted to float32 and Y back to float16.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv._kernels.qmatmul import DECODE_M, matmul_nbits, nbits_columns, pack_nbits
from onnxkv.plan.constant_data import release_pages
from onnxkv.plan.ops._util import round_into, widened
from onnxkv.plan.registry import BuildContext, Op, register

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))
_BLOCKS = (16, 32, 64, 128, 256)
#: Up to this many rows a float32-activation product is compilable (int8 products at every row count).
STEP_M = 512

__all__ = ["MatMulNBits", "SiblingMatMulNBits", "DECODE_M", "STEP_M", "layout_problem"]


def layout_problem(k, n, bits, block_size, B: np.ndarray, scales: np.ndarray, zp: np.ndarray | None) -> str | None:
    """What is wrong with the shapes of a MatMulNBits node's B, scales and zero_points for its attributes
    K, N, bits and block_size, as ONNX Runtime's layout has them (B [N, blocks, block bytes], scales
    [N * blocks] or [N, blocks], zero points N * ceil(blocks * bits / 8) bytes or N * blocks floats),
    or None."""
    if not all(isinstance(v, int) and v >= 1 for v in (k, n)) or bits not in (4, 8) or block_size not in _BLOCKS:
        return f"K={k!r}, N={n!r}, bits={bits!r}, block_size={block_size!r}: not a layout onnxkv runs"
    nblk, blob = -(-k // block_size), block_size * bits // 8
    if B.shape != (n, nblk, blob):
        return f"B: expected shape [N={n}, {nblk} blocks, {blob} bytes], got {list(B.shape)}"
    if scales.shape not in ((n * nblk,), (n, nblk)):
        return f"scales: expected shape [{n * nblk}] or [N={n}, {nblk} blocks], got {list(scales.shape)}"
    if zp is not None:
        want = n * nblk if zp.dtype.kind == "f" else n * -(-nblk * bits // 8)
        if zp.size != want:
            return f"zero_points: expected {want} elements, got shape {list(zp.shape)}"
    return None


def _constant(op: Op, ctx: BuildContext, name: str, role: str) -> np.ndarray | None:
    """The initializer ``name`` (None for an omitted input); a load error naming ``role`` if it is not one."""
    if not name:
        return None
    value = ctx.constant(name)
    if value is None:
        raise op.error(f"input {role} ('{name}') must be an initializer: onnxkv packs the weight once at load")
    return value


def _float32(a: np.ndarray | None) -> np.ndarray | None:
    """float16 scales, zero points or bias as float32 (other dtypes unchanged: pack_nbits checks them)."""
    return a.astype(np.float32) if a is not None and a.dtype == np.float16 else a


@register("MatMulNBits", domain="com.microsoft")
class MatMulNBits(Op):
    """Kernel object of one MatMulNBits node (see the module docstring).

    Attributes:
        weight: the packed weight (owned by this object, read-only arrays).
        int8: whether products quantize A to int8 (accuracy_level 4).
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        inputs = list(node.input) + [""] * (6 - len(node.input))
        if inputs[4]:
            raise self.error(
                f"input g_idx ('{inputs[4]}') is not supported: onnxkv runs weights grouped by "
                f"k // block_size, without act-order indices"
            )
        self._layout(self.attrs.get("N"))
        B, scales, zp = (
            _constant(self, ctx, inputs[i], role) for i, role in ((1, "B"), (2, "scales"), (3, "zero_points"))
        )
        if B is None or scales is None:
            raise self.error("inputs B and scales are required")
        problem = layout_problem(self.k, self.n, self.bits, self.block_size, B, scales, zp)
        bias = ctx.constant(inputs[5]) if inputs[5] else None  # an initializer is checked now, a feed per run
        if problem is None and bias is not None and (bias.dtype not in _FLOATS or bias.shape != (self.n,)):
            problem = f"bias must be float [{self.n}], got {bias.dtype} {list(bias.shape)}"
        if problem is not None:
            raise self.error(problem)
        self._pack(B, scales, zp)
        self.absorbed_inputs = tuple(i for i in (1, 2, 3) if inputs[i])

    def _layout(self, n) -> None:
        """Checks the attributes (the node's N given as ``n``) and sets k, n, bits, block_size, int8."""
        a = self.attrs
        for name, value in (("K", a.get("K")), ("N", n), ("block_size", a.get("block_size"))):
            if not isinstance(value, int):
                raise self.error(f"attribute '{name}' is required (an int), got {value!r}")
        self.k, self.n = a["K"], n
        self.bits, self.block_size, level = a.get("bits", 4), a["block_size"], a.get("accuracy_level", 0)
        if self.bits not in (4, 8):
            raise self.error(f"bits={self.bits} is not supported: onnxkv runs 4- and 8-bit weights")
        if not (16 <= self.block_size <= 256 and self.block_size & (self.block_size - 1) == 0):
            raise self.error(f"block_size={self.block_size}: expected a power of two in [16, 256]")
        if not (0 <= level <= 4):
            raise self.error(f"accuracy_level={level}: expected 0..4")
        if not (1 <= self.k < 2**31 and 1 <= self.n < 2**31):
            raise self.error(f"K={self.k}, N={self.n}: expected each in [1, 2^31)")
        self.int8 = level == 4

    def _pack(self, B: np.ndarray, scales: np.ndarray, zp: np.ndarray | None) -> None:
        """Packs the weight (ORT layout, self.n columns) into self.weight; a load error for a bad layout.
        Float zero points keep A in float32 at every accuracy level, as ONNX Runtime's CPU kernel."""
        if zp is not None and zp.dtype.kind == "f":
            self.int8 = False
        try:
            self.weight = pack_nbits(
                np.ascontiguousarray(B),
                np.ascontiguousarray(_float32(scales)),
                None if zp is None else np.ascontiguousarray(_float32(zp)),
                self.k,
                self.n,
                self.bits,
                self.block_size,
            )
        except ValueError as e:
            raise self.error(
                f"{e} (K={self.k}, N={self.n}, bits={self.bits}, block_size={self.block_size}, "
                f"{-(-self.k // self.block_size)} blocks per column)"
            ) from None
        release_pages(B)

    def _product(self, a: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None, rt) -> np.ndarray:
        """A [..., K] (checked here) @ w (+ bias, checked by the caller) as float32 [rows, n], into ``out``
        (float32 [..., n], or None for a new array); ``rt`` holds a float16 A's widening."""
        if a.dtype not in _FLOATS or a.ndim < 1 or a.shape[-1] != self.k:
            raise ValueError(
                f"{self.op_type} node '{self.name}': input A must be float32 or float16 [..., {self.k}], "
                f"got {a.dtype} {a.shape}"
            )
        half = a.dtype == np.float16
        x = widened(a, rt) if half else np.ascontiguousarray(a)
        rows = x.size // self.k
        o = (np.empty((rows, self.n), np.float32) if out is None else out).reshape(rows, self.n)
        matmul_nbits(x.reshape(rows, self.k), self.weight, o, bias, int8=self.int8)
        if half and rt is not None:
            rt.unscratch(x)
        return o

    def compilable(self, inputs: list) -> bool:
        """One kernel call on A as it is: C-contiguous float32 [..., K], rows the kernel takes, and no bias
        or a float32 one (no per-run copies); float16 A (a q4f16 file): its widening, the call and the
        rounding."""
        bias = inputs[5] if len(inputs) > 5 else None
        return self._one_call(inputs[0]) and (
            bias is None or (bias.dtype == np.float32 and bias.shape == (self.n,) and bias.flags.c_contiguous)
        )

    def _one_call(self, a) -> bool:
        return (
            isinstance(a, np.ndarray)
            and a.dtype in _FLOATS
            and a.ndim >= 1
            and a.shape[-1] == self.k
            and a.size > 0
            and a.flags.c_contiguous
            and (self.int8 or a.size // self.k <= STEP_M)
        )

    def run(self, inputs: list, rt) -> tuple:
        a, bias = inputs[0], inputs[5] if len(inputs) > 5 else None
        if bias is not None and (bias.dtype not in _FLOATS or bias.shape != (self.n,)):
            raise ValueError(
                f"MatMulNBits node '{self.name}': bias must be float [{self.n}], got {bias.dtype} {bias.shape}"
            )
        f32 = a.dtype == np.float32
        shape = a.shape[:-1] + (self.n,)
        out = None if not a.ndim else rt.empty(0, shape, np.float32) if f32 else rt.scratch(shape, np.float32)
        o = self._product(a, None if bias is None else np.ascontiguousarray(bias, dtype=np.float32), out, rt)
        if f32:
            return (out if out is not None else o.reshape(shape),)
        y = round_into(rt.empty(0, shape, np.float16), o.reshape(shape))
        rt.unscratch(out)
        return (y,)


@register("SiblingMatMulNBits", domain="ai.onnxkv", internal=True)
class SiblingMatMulNBits(MatMulNBits):
    """``ai.onnxkv::SiblingMatMulNBits`` (made by :func:`onnxkv.plan.fusion_matmul.fuse_sibling_nbits`):
    input A, then per member B, scales, zero_points, bias ("" when absent; every one an initializer);
    attributes those of MatMulNBits with ``N`` one int per member; outputs Y_i = A @ W_i (+ bias_i), as the
    MatMulNBits nodes it replaces.  The members' weights are concatenated along N and packed once, so A is
    quantized once and one kernel call covers them all.  A single row returns the outputs as views of
    the one product.  Several rows (a beam search step, a speculative verification, a prompt chunk) take one
    product per output when every output starts on a panel boundary (``members``: each output's columns of
    the packed weight, views of it; A is quantized once per product, and each column is computed as the one
    product computes it, which is what the separate nodes compute), otherwise contiguous copies of the column
    blocks of the one product.

    Attributes: weight (the packed concatenation), bounds ((start, end) columns of each output), members
    (per output: its PackedNBits columns and bias, or None when an output starts inside a panel).
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        Op.__init__(self, node, ctx)
        ns = self.attrs.get("N")
        if not (
            isinstance(ns, list) and len(ns) >= 2 and len(node.input) == 1 + 4 * len(ns) and len(node.output) == len(ns)
        ):
            raise self.error(
                f"needs A, then B, scales, zero_points, bias per member and N per member, got "
                f"{len(node.input)} inputs and N={ns!r}"
            )
        self._layout(sum(ns) if all(isinstance(n, int) and n >= 1 for n in ns) else ns)
        members = [
            [
                _constant(self, ctx, node.input[1 + 4 * i + j], role)
                for j, role in enumerate(("B", "scales", "zero_points", "bias"))
            ]
            for i in range(len(ns))
        ]
        kinds = {None if m[2] is None else m[2].dtype for m in members}
        if any(m[0] is None or m[1] is None for m in members) or len(kinds) != 1:
            raise self.error("every member needs B and scales, and one zero-point kind")
        rows = lambda a, n: np.ascontiguousarray(a).reshape(n, -1)  # noqa: E731
        self._pack(
            np.concatenate([rows(m[0], n) for m, n in zip(members, ns)]),
            np.concatenate([rows(_float32(m[1]), n) for m, n in zip(members, ns)]),
            None if kinds == {None} else np.concatenate([rows(_float32(m[2]), n) for m, n in zip(members, ns)]),
        )
        for m, n in zip(members, ns):
            if m[3] is not None and m[3].shape != (n,):
                raise self.error(f"bias of shape {m[3].shape}: expected ({n},)")
        self._bias = (
            None
            if all(m[3] is None for m in members)
            else np.concatenate(
                [np.zeros(n, np.float32) if m[3] is None else m[3].astype(np.float32) for m, n in zip(members, ns)]
            )
        )
        self._outputs(ns)
        self.absorbed_inputs = tuple(i for i in range(1, len(node.input)) if node.input[i])

    def _outputs(self, ns: list[int]) -> None:
        """``bounds`` and ``members`` of outputs ``ns`` columns wide (``weight`` and ``_bias`` set)."""
        ends = np.cumsum(ns).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self.members = (
            [
                (nbits_columns(self.weight, n0, n1), None if self._bias is None else self._bias[n0:n1])
                for n0, n1 in self.bounds
            ]
            if all(n0 % 16 == 0 for n0, _ in self.bounds)
            else None
        )

    def compilable(self, inputs: list) -> bool:
        """One row (one kernel call; float32 outputs are views of its product, float16 ones rounded from its
        columns), or several with ``members`` (one call per output into the output, and a float16 A's
        widening and each output's rounding)."""
        return self._one_call(inputs[0]) and (inputs[0].size == self.k or self.members is not None)

    def run(self, inputs: list, rt) -> tuple:
        a = inputs[0]
        if a.dtype in _FLOATS and a.ndim and a.shape[-1] == self.k and a.size:
            if a.size > self.k and self.members is not None:
                return self._per_member(a, rt)
            if a.size == self.k and a.dtype == np.float16:
                return self._one_row_rounded(a, rt)
        full = self._product(a, self._bias, None, rt)
        lead, rows = a.shape[:-1], full.shape[0]
        if rows == 1:
            outs = [full[:, n0:n1].reshape(lead + (n1 - n0,)) for n0, n1 in self.bounds]
        else:
            outs = []
            for i, (n0, n1) in enumerate(self.bounds):
                out = rt.empty(i, lead + (n1 - n0,), np.float32)
                np.copyto(out.reshape(rows, n1 - n0), full[:, n0:n1])
                outs.append(out)
        if a.dtype == np.float32:
            return tuple(outs)
        return tuple(round_into(np.empty(y.shape, np.float16), np.ascontiguousarray(y)) for y in outs)

    def _one_row_rounded(self, a: np.ndarray, rt) -> tuple:
        """One float16 row: one product into a scratch row, each output rounded from its columns."""
        wide, lead = rt.scratch((1, self.n), np.float32), a.shape[:-1]
        self._product(a, self._bias, wide, rt)
        outs = tuple(
            round_into(rt.empty(i, lead + (n1 - n0,), np.float16), wide[:, n0:n1].reshape(lead + (n1 - n0,)))
            for i, (n0, n1) in enumerate(self.bounds)
        )
        rt.unscratch(wide)
        return outs

    def _per_member(self, a: np.ndarray, rt) -> tuple:
        """Several rows: one product per output, into the output (float32 A) or into a scratch product
        rounded into it (float16 A, widened once)."""
        half = a.dtype == np.float16
        x = widened(a, rt) if half else np.ascontiguousarray(a)
        x = x.reshape(-1, self.k)
        lead, outs = a.shape[:-1], []
        for i, ((n0, n1), (weight, bias)) in enumerate(zip(self.bounds, self.members, strict=True)):
            shape = lead + (n1 - n0,)
            o = rt.scratch(shape, np.float32) if half else rt.empty(i, shape, np.float32)
            matmul_nbits(x, weight, o.reshape(x.shape[0], n1 - n0), bias, int8=self.int8)
            if half:
                outs.append(round_into(rt.empty(i, shape, np.float16), o))
                rt.unscratch(o)
            else:
                outs.append(o)
        if half:
            rt.unscratch(x)
        return tuple(outs)
