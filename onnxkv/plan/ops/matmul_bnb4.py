"""``com.microsoft::MatMulBnb4``: Y = A @ dequant(B)^T, B in bitsandbytes' 4-bit FP4 or NF4 blocks.

The contract is ONNX Runtime's contrib operator (what its ``MatMulBnb4Quantizer``
writes, the ``model_bnb4.onnx`` files of Transformers.js repositories): A float32
or float16 [..., K]; B uint8 [(N * K + 1) // 2], the 4-bit codes of the
flattened [N, K] weight, two per byte, the even flat index in the high nibble;
absmax [ceil(N * K / block_size)] of A's type; attributes K, N, block_size (a
power of two >= 16), quant_type (0: FP4, 1: NF4), transB (1, the layout the
quantizer writes) and training_mode (0).  Element i = n * K + k of the
weight is ``CODEBOOKS[quant_type][code_i] * absmax[i // block_size]``.

B and absmax must be initializers.  They are repacked once, when the kernel
object is built, into qmatmul's panel layout with the codebook as the packed
weight's ``lut`` (the op absorbs them, as MatMulNBits does): the products take
float32 activations at every row count (ONNX Runtime dequantizes and runs
SGEMM), decode rows on the block kernels, prompts on dequantized panels, and
the compiled step records them as MatMulNBits products.  The kernel's block is
the largest power of two up to 256 dividing both K and block_size, so that an
absmax block starting inside a column (K not a multiple of block_size) starts
a kernel block too; below 16 that is a load error.  Results differ from ONNX
Runtime's by float32 rounding only: the kernel scales each block's sum, ONNX
Runtime each element.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv._kernels.qmatmul import pack_nbits
from onnxkv.plan.constant_data import release_pages
from onnxkv.plan.ops.matmul_nbits import MatMulNBits, SiblingMatMulNBits, _constant
from onnxkv.plan.registry import BuildContext, Op, register

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))

#: The values the 4-bit codes stand for, by quant_type (bitsandbytes' FP4 and NF4, as ONNX Runtime has them).
CODEBOOKS = {
    0: np.float32([0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3]) / np.float32(12),
    1: np.float32([
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ]),
}  # fmt: skip

__all__ = ["MatMulBnb4", "SiblingMatMulBnb4", "CODEBOOKS", "kernel_block", "layout_problem"]


def kernel_block(k: int, block_size: int) -> int:
    """The largest power of two up to 256 dividing both ``k`` and ``block_size`` (see the module docstring)."""
    return min(256, block_size, k & -k)


def layout_problem(k, n, block_size, quant_type, B: np.ndarray, absmax: np.ndarray) -> str | None:
    """What is wrong with a MatMulBnb4 node's attributes K, N, block_size, quant_type and its B and absmax
    (see the module docstring), or None."""
    if quant_type not in CODEBOOKS:
        return f"quant_type={quant_type!r}: expected 0 (FP4) or 1 (NF4)"
    if not all(isinstance(v, int) for v in (k, n, block_size)):
        return f"K={k!r}, N={n!r}, block_size={block_size!r}: expected ints"
    if not (16 <= block_size < 2**31 and block_size & (block_size - 1) == 0):
        return f"block_size={block_size}: expected a power of two >= 16"
    if not (1 <= k < 2**31 and 1 <= n < 2**31):
        return f"K={k}, N={n}: expected each in [1, 2^31)"
    if kernel_block(k, block_size) < 16:
        return (
            f"K={k} with block_size={block_size}: absmax blocks start {k & -k} values apart within a column; "
            f"onnxkv's kernels need 16 or more"
        )
    size, blocks = n * k, -(-n * k // block_size)
    if B.dtype != np.uint8 or B.size != (size + 1) // 2:
        return f"B: expected uint8 with {(size + 1) // 2} elements (N * K codes), got {B.dtype} {list(B.shape)}"
    if absmax.dtype not in _FLOATS or absmax.size != blocks:
        return f"absmax: expected float with {blocks} elements, got {absmax.dtype} {list(absmax.shape)}"
    return None


def repack(B: np.ndarray, absmax: np.ndarray, k: int, n: int, block_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """MatMulBnb4's B and absmax as a MatMulNBits layout of 4-bit codes: (B' uint8 [n, k / g, g / 2] low
    nibble first, scales float32 [n, k / g], g = :func:`kernel_block`).  Shapes are the caller's to check."""
    g = kernel_block(k, block_size)
    b = B.reshape(-1)
    codes = np.empty(2 * b.size, np.uint8)
    codes[0::2], codes[1::2] = b >> 4, b & 15
    q = codes[: n * k].reshape(n, k // g, g)
    starts = (np.arange(n, dtype=np.int64)[:, None] * k + np.arange(0, k, g, dtype=np.int64)[None, :]) // block_size
    scales = absmax.reshape(-1).astype(np.float32)[starts]
    return q[:, :, 0::2] | (q[:, :, 1::2] << 4), scales, g


@register("MatMulBnb4", domain="com.microsoft")
class MatMulBnb4(MatMulNBits):
    """Kernel object of one MatMulBnb4 node (see the module docstring); ``weight`` is a codebook
    ``PackedNBits`` (owned by this object, read-only arrays), ``int8`` always False.  It runs as MatMulNBits
    does (its inputs stop before MatMulNBits' bias)."""

    op_type = "MatMulBnb4"  # not MatMulNBits' (the registry names only classes without one)

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        Op.__init__(self, node, ctx)
        self._attributes(self.attrs.get("N"))
        inputs = list(node.input) + [""] * (3 - len(node.input))
        B, absmax = (_constant(self, ctx, inputs[i], role) for i, role in ((1, "B"), (2, "absmax")))
        if B is None or absmax is None:
            raise self.error("inputs B and absmax are required")
        self._pack_members([(B, absmax)], [self.n])
        self.absorbed_inputs = (1, 2)

    def _attributes(self, n) -> None:
        """Checks transB and training_mode and sets k, n (``n``: the node's N), bits, block_size,
        quant_type and int8 (False)."""
        a = self.attrs
        trans_b, training = a.get("transB", 1), a.get("training_mode", 0)
        if trans_b != 1 or training != 0:
            raise self.error(
                f"transB={trans_b!r}, training_mode={training!r}: onnxkv runs transB=1, training_mode=0 (the "
                f"layout ONNX Runtime's quantizer writes)"
            )
        self.k, self.n, self.bits, self.block_size = a.get("K"), n, 4, a.get("block_size")
        self.quant_type, self.int8 = a.get("quant_type"), False

    def _pack_members(self, members: list, ns: list) -> None:
        """Packs the (B, absmax) of each member (``ns``: their N) side by side into self.weight; a load error
        naming what is wrong."""
        qs, scales = [], []
        for (B, absmax), n in zip(members, ns):
            problem = layout_problem(self.k, n, self.block_size, self.quant_type, B, absmax)
            if problem is not None:
                raise self.error(problem)
            q, sc, g = repack(B, absmax, self.k, n, self.block_size)
            qs.append(q)
            scales.append(sc)
            release_pages(B)
        self.weight = pack_nbits(
            np.concatenate(qs), np.concatenate(scales), None, self.k, sum(ns), 4, g, lut=CODEBOOKS[self.quant_type]
        )


@register("SiblingMatMulBnb4", domain="ai.onnxkv", internal=True)
class SiblingMatMulBnb4(SiblingMatMulNBits, MatMulBnb4):
    """``ai.onnxkv::SiblingMatMulBnb4`` (made by :func:`onnxkv.plan.fusion_matmul.fuse_sibling_nbits`):
    input A, then per member B and absmax (initializers); attributes those of MatMulBnb4 with ``N`` one int
    per member; outputs Y_i = A @ W_i, as the MatMulBnb4 nodes it replaces, from one kernel call on the
    members' weights packed side by side (run as SiblingMatMulNBits runs, which comes first in its bases).

    Attributes: weight (the packed concatenation), bounds and members (as SiblingMatMulNBits has them).
    """

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        Op.__init__(self, node, ctx)
        ns = self.attrs.get("N")
        if not (
            isinstance(ns, list)
            and len(ns) >= 2
            and all(isinstance(n, int) for n in ns)
            and len(node.input) == 1 + 2 * len(ns)
            and len(node.output) == len(ns)
        ):
            raise self.error(
                f"needs A, then B and absmax per member and N per member, got {len(node.input)} inputs and N={ns!r}"
            )
        self._attributes(sum(ns))
        members = [
            tuple(_constant(self, ctx, node.input[1 + 2 * i + j], role) for j, role in enumerate(("B", "absmax")))
            for i in range(len(ns))
        ]
        if any(B is None or absmax is None for B, absmax in members):
            raise self.error("every member needs B and absmax")
        self._pack_members(members, ns)
        self._bias = None
        self._outputs(ns)
        self.absorbed_inputs = tuple(range(1, len(node.input)))
