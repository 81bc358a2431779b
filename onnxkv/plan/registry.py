"""Operator registry: one kernel class per (domain, op_type, since_version).

A *kernel object* is built once per node when a :class:`~onnxkv.plan.plan.Plan`
is made, and called for every run.  Contract of a kernel class:

* ``__init__(self, node: onnx.NodeProto, ctx: BuildContext)`` parses and
  validates the node's attributes (raise :class:`onnxkv.errors.ModelError`
  naming the node for anything it cannot run).
* ``run(self, inputs: list, rt: RunContext) -> Sequence``: ``inputs`` holds one
  NumPy array per node input position (``None`` for an omitted optional
  input); it returns one value per node output (``None`` allowed for an
  unused optional output).  Inputs are read-only for the kernel unless the
  node's alias contract (:mod:`onnxkv.model.contract`) says otherwise.
* Outputs are fresh arrays, except that a class which sets ``view_inputs`` to
  a tuple of input positions may return outputs sharing memory with those
  inputs (Reshape, Squeeze, Identity, ...).  The plan uses that declaration to
  keep the underlying buffers alive as long as any view is.
* A node with subgraphs (``If``, ``Loop``, ``Scan``) sets ``captures`` to the
  names its subgraphs read from the enclosing scope at run time: the plan
  passes their values after the node's inputs (``inputs[len(node.input):]``)
  and counts them as uses of those values, like inputs.
* Outputs written by a kernel into memory it asked for with
  ``rt.empty(index, shape, dtype)`` come from the session's allocator where
  the plan owns the value's lifetime.

Ops register with :func:`register`; :func:`lookup` picks the implementation
with the highest ``since`` not above the model's opset for that domain.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from onnxkv.errors import ModelError, UnsupportedOperatorError
from onnxkv.model.tensors import tensor_array
from onnxkv.plan.constant_data import kernel_view

if TYPE_CHECKING:  # pragma: no cover
    from onnxkv.plan.context import RunContext
    from onnxkv.plan.plan import Plan

__all__ = [
    "Op",
    "BuildContext",
    "register",
    "lookup",
    "is_internal",
    "refuse_internal",
    "registered_ops",
    "DOMAIN_ALIASES",
]

#: Domain spellings that mean the default ONNX domain.
DOMAIN_ALIASES = {"": "", "ai.onnx": ""}


class BuildContext:
    """What a kernel may know about the model while it is being built.

    Attributes:
        opsets: domain -> opset version imported by the model.
        constants: name -> NumPy array for every initializer and Constant
            output known before the run (read-only arrays).
        present_outputs: names of graph outputs that carry a KV cache
            (``present.*``); kernels producing them count storage events.
        past_inputs: names of graph inputs that carry a KV cache (``past*``).
        bindings: node name -> the :class:`~onnxkv.model.rewrite.CacheBinding`
            s that node may serve in place (when a state runs the plan).
        subplan: ``subplan(graph, where) -> Plan`` builds a subgraph of a node
            into a plan of its own, in the scope of the plan being built
            (``where`` names the node and attribute in errors); None outside
            a plan build.
    """

    def __init__(
        self,
        opsets: dict[str, int],
        constants: dict[str, np.ndarray] | None = None,
        present_outputs: frozenset[str] = frozenset(),
        past_inputs: frozenset[str] = frozenset(),
        bindings: dict[str, list] | None = None,
        subplan: Callable[[onnx.GraphProto, str], Plan] | None = None,
    ) -> None:
        self.opsets = opsets
        self.constants = constants if constants is not None else {}
        self.present_outputs = present_outputs
        self.past_inputs = past_inputs
        self.bindings = bindings or {}
        self.subplan = subplan
        # The aligned copies constant() made, shared while a kernel or the plan's values hold them (weakly
        # held: a copy only a packing kernel read is freed once packed).
        self._aligned: weakref.WeakValueDictionary[str, np.ndarray] = weakref.WeakValueDictionary()

    def opset(self, domain: str = "") -> int:
        return self.opsets.get(DOMAIN_ALIASES.get(domain, domain), 0)

    @staticmethod
    def attributes(node: onnx.NodeProto) -> dict[str, Any]:
        """Attribute name -> Python value (bytes decoded to str, tensors to NumPy).

        Raises:
            ModelError: naming the node and attribute, for an attribute of no
                known type, a string that is not UTF-8 or a tensor whose data
                does not match its dims (see :mod:`onnxkv.model.tensors`).
        """
        out: dict[str, Any] = {}
        for a in node.attribute:
            where = f"{node.op_type} node '{node.name or ','.join(node.output)}': attribute '{a.name}'"
            try:
                v = helper.get_attribute_value(a)
                if isinstance(v, bytes):
                    v = v.decode("utf-8")
                elif isinstance(v, list) and v and isinstance(v[0], bytes):
                    v = [s.decode("utf-8") for s in v]
            except (ValueError, TypeError) as e:  # UnicodeDecodeError is a ValueError
                raise ModelError(f"{where} cannot be read: {type(e).__name__}: {e}") from None
            if isinstance(v, onnx.TensorProto):
                v = tensor_array(v, where)
            out[a.name] = v
        return out

    def bindings_for(self, node: onnx.NodeProto) -> dict[str, object]:
        """``past`` input name -> binding, for the cache values this node serves in place."""
        return {b.past: b for b in self.bindings.get(node.name or node.output[0], [])}

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is known at build time (initializer/Constant), as kernels may read it
        (:func:`~onnxkv.plan.constant_data.kernel_view`: a misaligned map is copied once per build)."""
        value = self.constants.get(name)
        if not isinstance(value, np.ndarray) or value.flags.aligned:
            return value
        copy = self._aligned.get(name)
        if copy is None:
            copy = self._aligned[name] = kernel_view(value)
        return copy


_baked_epoch = 0


def baked_epoch() -> int:
    """The count of run-time changes to data that recorded kernel calls bake (:func:`bump_baked_epoch`)."""
    return _baked_epoch


def bump_baked_epoch() -> None:
    """Say that an operator changed, at run time, data its recorded calls bake (a PositionTable's tables grown):
    compiled steps recorded before are dropped (:mod:`onnxkv.plan.compiled_step`), in every plan."""
    global _baked_epoch
    _baked_epoch += 1


class Op:
    """Base class of kernel objects (see the module docstring for the contract)."""

    #: Input positions whose build-time constant the kernel captured (e.g. a packed weight): the
    #: plan drops its own copy when every reader absorbs it, and passes None for them at run time.
    absorbed_inputs: tuple[int, ...] = ()
    #: Input positions whose storage the outputs may share (views).
    view_inputs: tuple[int, ...] = ()
    #: Input positions a recorded call of a compilable node does not read (a cache view whose buffer the call
    #: takes by name): they are no external values of its segment (see :mod:`onnxkv.plan.compiled_step`).
    replay_unread: tuple[int, ...] = ()
    #: Input positions whose values (not only their shapes) decide the calls a compilable node records (a
    #: slice bound computed from a shape): a compiled step records the node only when each is a constant or a
    #: value fixed for the step (see :mod:`onnxkv.plan.compiled_step`).
    replay_fixed: tuple[int, ...] = ()
    #: Input positions a recorded call takes whole with their last dim read when replayed (a mask over the
    #: cache length): several nodes may take one such value when every reader declares it.
    ragged_inputs: tuple[int, ...] = ()
    #: Whether the kernel may call BLAS (NumPy's matmul and the like): a run calls the session's BLAS thread
    #: limit (``RunContext.on_python``) before the first such node that runs in Python; a kernel that never
    #: does sets False.
    uses_blas: bool = True
    #: Whether the outputs depend on the inputs' shapes alone (Shape, ShapeOf): a compiled step keeps such a
    #: node's value for its replays when it reads values of the step's own segments (their shapes are fixed).
    shape_only: bool = False
    #: Names read from the enclosing scope by the node's subgraphs, passed after its inputs (see the module docstring).
    captures: tuple[str, ...] = ()
    #: Set by :func:`register`.
    domain: str = ""
    op_type: str = ""

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        self.node = node
        self.name = node.name or f"{node.op_type}({', '.join(node.output)})"
        self.attrs = ctx.attributes(node)

    def run(self, inputs: list, rt: RunContext) -> Sequence[Any]:  # pragma: no cover
        raise NotImplementedError(f"{type(self).__name__}.run")

    def compilable(self, inputs: list) -> bool:
        """True when ``run(inputs, rt)`` would write only through kernels a compiled step replays.

        That is: every write goes through the noting kernels of
        :mod:`onnxkv._kernels._record` (packed and block-quantized products,
        RMS norms, activations, embedding rows), every other value is a fresh
        allocation or a view, and no scalar read from ``inputs`` steers the
        calls (their arguments depend on the input shapes only; an operator
        that reads one notes it as a call that checks it when replayed, as
        GroupQueryAttention's fused decode does, and one whose call takes a
        length from an input notes that input ragged, as MaskLengths does).  A compiled step (:mod:`onnxkv.plan.compiled_step`) then
        records the node's kernel calls once and replays them while the inputs
        keep their shapes.  The default is False: the node always runs in Python.
        """
        return False

    def error(self, message: str) -> ModelError:
        """A ModelError naming this node and operator."""
        return ModelError(f"{self.op_type} node '{self.name}': {message}")


_REGISTRY: dict[tuple[str, str], list[tuple[int, type[Op]]]] = {}
_INTERNAL: set[tuple[str, str]] = set()  # (domain, op_type) registered internal


def register(op_type: str, domain: str = "", since: int = 1, internal: bool = False) -> Callable[[type[Op]], type[Op]]:
    """Class decorator registering a kernel for ``domain::op_type`` from opset ``since``.

    ``internal``: an operator only onnxkv's own passes make (fusions, shape folding), whose kernel trusts
    the structure those passes guarantee; a model given to a plan may not hold it (:func:`is_internal`).
    """
    domain = DOMAIN_ALIASES.get(domain, domain)
    if internal:
        _INTERNAL.add((domain, op_type))

    def deco(cls: type[Op]) -> type[Op]:
        versions = _REGISTRY.setdefault((domain, op_type), [])
        if any(v == since for v, _ in versions):
            raise RuntimeError(f"operator {domain}::{op_type} since {since} registered twice")
        bisect.insort(versions, (since, cls), key=lambda t: t[0])
        if not cls.op_type:
            cls.op_type = op_type
            cls.domain = domain
        return cls

    return deco


def is_internal(domain: str, op_type: str) -> bool:
    """Whether ``domain::op_type`` is registered ``internal`` (made only by onnxkv's passes)."""
    return (DOMAIN_ALIASES.get(domain, domain), op_type) in _INTERNAL


def refuse_internal(nodes) -> None:
    """UnsupportedOperatorError naming the nodes of ``nodes`` (a model's, before any pass) whose operators
    are :func:`is_internal`: a model may not hold them."""
    made = [n for n in nodes if is_internal(n.domain, n.op_type)]
    if made:
        listed = ", ".join(f"'{n.name or n.output[0]}' ({n.domain}::{n.op_type})" for n in made[:10])
        raise UnsupportedOperatorError(
            f"{len(made)} node(s) use operators only onnxkv's own passes make, which a model may not hold: "
            f"{listed} (their kernels trust the structure the passes guarantee; give the unfused nodes)"
        )


def lookup(domain: str, op_type: str, opset_version: int) -> type[Op] | None:
    """The registered class for this operator at this opset, or None."""
    versions = _REGISTRY.get((DOMAIN_ALIASES.get(domain, domain), op_type))
    if not versions:
        return None
    chosen = None
    for since, cls in versions:
        if since <= opset_version or opset_version == 0:
            chosen = cls
    return chosen


def registered_ops() -> list[tuple[str, str, int]]:
    """(domain, op_type, since) of every registered kernel, sorted."""
    return sorted((d, t, s) for (d, t), vs in _REGISTRY.items() for s, _ in vs)
