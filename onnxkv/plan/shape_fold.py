"""Build-time partial evaluation of shape computations (exact; results never change).

Exporters such as ``torch.onnx.export`` compute every reshape target at run
time: ``Shape -> Gather(index) -> Unsqueeze -> Concat -> Reshape/Expand``,
repeated per use.  Many of the dims read that way are static (head counts,
head size) and the others are the same few run-time dims (batch, sequence
lengths) read again and again.  :class:`ShapeFolder` removes that work while
:class:`onnxkv.plan.plan.Plan` is built:

1. **Dims** (:func:`onnxkv.plan.static_dims.static_dims`): ONNX shape inference on a copy of the graph
   whose only sources of dims are checked ones.  Graph inputs keep their
   declared positive integer dims (``Plan.bind_inputs`` rejects any feed that
   differs); every other input dim gets a symbol of its own (``"x[0]"``), so
   two dims carry the same symbol only where ONNX derived their equality from
   operator semantics.  ``value_info`` and graph output shapes (unchecked
   promises of the exporter) and the defaults of overridable inputs are
   dropped first.  An inferred integer, or the equality of two symbols, holds
   in every run that does not fail.
2. **Partial values**: ``Shape(x)`` gives a 1-D int64 value whose entries are
   x's dims (int, symbol or unknown); ``Gather``/``Slice`` with constant
   parameters, ``Unsqueeze``/``Squeeze``/``Reshape`` between 0-D and 1-D,
   ``Concat``, ``Cast`` to int64, ``Equal`` and ``Where`` carry them on (also
   as the steps of an ``ai.onnxkv::ViewChain``).  A
   value with only integer entries becomes a constant; one with only integer
   and symbolic entries equal to an earlier value is dropped and its readers
   read the earlier value.  ``ai.onnxkv::RepeatKvShape`` whose reshape target
   has no 0/-1 entry is that target.  A dim ONNX left unknown is the symbol
   ``"x[i]"`` of its own tensor and axis (sound: it names one value).
   Any other such value (a ``Gather``, ``Unsqueeze``, ``Concat`` ... of
   shapes, not ``Shape`` itself) becomes one ``ai.onnxkv::ShapeOf`` node
   reading the dims it is made of straight from the tensors they belong to,
   so the chain of shape operators before it can be dropped.
3. **Rewrites** (:meth:`ShapeFolder.rewrite`): a ``Reshape`` target entry
   equal to the data's own dim at that position becomes 0 (copy), an
   ``Expand`` shape entry (also the expand shape of the fused repeat_kv
   operators) equal to the aligned dim becomes 1, when that makes the whole
   target constant.  The reshape target of the fused repeat_kv operators
   (``[B, heads, T, D]`` read from the cache's own shape) becomes a constant
   template over the repeated tensor's dims (:data:`~onnxkv.plan.fusion.RESHAPE_FROM_X`).
4. **Common subexpressions and dead shape nodes**: two deterministic nodes
   with the same operator, attributes and inputs (small constants compared by
   value) compute the same value, so the later one is dropped and its readers
   read the earlier one's outputs (exports repeat e.g. the additive mask and
   the unsqueezed cos/sin in every layer).  A *shape-derived* value is the
   output of a ``Shape`` node or of a deterministic node reading only
   constants and shape-derived values; shape-derived nodes whose outputs no
   one reads any more are dropped at the end.

Merging shares one value between readers, so the plan disables it (steps 2
and 4) when some intermediate value is written in place.  Values that must
stay observable (graph outputs, values captured by subgraphs) are never
folded, merged or dropped.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxkv.plan.fusion import REPEAT_KV_INPUTS, RESHAPE_FROM_X, default_op
from onnxkv.plan.static_dims import Entry

__all__ = ["Entry", "ShapeFolder"]

#: Constants with at most this many elements are compared by value when merging nodes.
_FINGERPRINT_LIMIT = 64
#: Where a fused node's body may read a rewritten expand shape / reshape target: the RepeatKvMatMul inputs.
_BODY_EXPAND_POSITION = {"RepeatKvMatMul": REPEAT_KV_INPUTS["RepeatKvMatMul"][0][2]}
_BODY_RESHAPE_POSITION = {"RepeatKvMatMul": REPEAT_KV_INPUTS["RepeatKvMatMul"][0][3]}
#: Fused operators whose reshape target may become a template (:data:`~onnxkv.plan.fusion.RESHAPE_FROM_X`).
_TEMPLATE_OPS = ("RepeatKvMatMul", "MaskedAttention")
#: Operators that draw random numbers when an input says so (not merged unless they only compute shapes).
_RANDOM_WHEN_TRAINING = {"Dropout"}
#: Element types of partial values: "i" int64 (shape entries), "b" bool (comparisons of them).
_KINDS = {"i": np.dtype(np.int64), "b": np.dtype(np.bool_)}
#: A 0-/1-D value known in part: (flat entries, shape, kind); entries are Entry (kind "i") or bool / None ("b").
Partial = tuple[tuple, tuple[int, ...], str]


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _const_ints(constants: dict, name: str) -> np.ndarray | None:
    arr = constants.get(name)
    if arr is None or arr.dtype.kind not in "iu":
        return None
    return arr.astype(np.int64)


def _broadcast(a: Partial, b: Partial) -> tuple[list[tuple], tuple[int, ...]] | None:
    """Entry pairs of two 0-/1-D partial values under broadcasting, and the result shape; None if unsupported."""
    (ea, sa, _), (eb, sb, _) = a, b
    if sa == sb:
        return list(zip(ea, eb)), sa
    if len(ea) == 1 and len(sa) <= len(sb):
        return [(ea[0], v) for v in eb], sb
    if len(eb) == 1 and len(sb) <= len(sa):
        return [(v, eb[0]) for v in ea], sa
    return None


def _equal(a: Entry, b: Entry) -> bool | None:
    """``a == b`` for shape entries when certain (a symbol is a dim: never negative)."""
    if a is None or b is None:
        return None
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        return True if a == b else None
    return False if min(v for v in (a, b) if isinstance(v, int)) < 0 else None


def _rename_node(node: onnx.NodeProto, renamed: dict[str, str], inputs: bool = True) -> None:
    """Rename ``node``'s inputs (unless ``inputs`` is False) and, recursively, every name its subgraphs use."""
    if inputs:
        for i, x in enumerate(node.input):
            node.input[i] = renamed.get(x, x)
    for a in node.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            for vi in g.input:
                vi.name = renamed.get(vi.name, vi.name)
            for n in g.node:
                _rename_node(n, renamed)


def _body_reads_only_at(node: onnx.NodeProto, name: str, positions: dict[str, int]) -> bool:
    """True when every node of ``node``'s subgraphs that reads ``name`` reads it at ``positions[op_type]`` only."""
    for a in node.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            for n in g.node:
                at = [i for i, x in enumerate(n.input) if x == name]
                if at and at != [positions.get(n.op_type, -1)] or not _body_reads_only_at(n, name, positions):
                    return False
    return True


def _fingerprint(constants: dict, name: str) -> str | tuple:
    """A small constant's dtype, shape and bytes (equal constants merge alike), else the value name."""
    arr = constants.get(name)
    if arr is None or arr.size > _FINGERPRINT_LIMIT:
        return name
    return arr.dtype.str, arr.shape, arr.tobytes()


class ShapeFolder:
    """Partial evaluation, CSE and dead-node removal for one plan build; see the module docstring.

    Args:
        dims: :func:`~onnxkv.plan.static_dims.static_dims` of the plan's model.
        protected: value names that must stay produced by their own node.
        merge: merge repeated deterministic nodes (pass False when some
            intermediate value may be written in place: merged values are shared).

    Use: for each node in topological order call :meth:`rename` (readers of
    merged values read the kept one), then :meth:`fold` (may add constants:
    the node is dropped) and :meth:`merge` (the node duplicates an earlier
    one: dropped); finally :meth:`prune` the kept node list.
    """

    def __init__(self, dims: dict[str, tuple[Entry, ...]], protected: set[str], merge: bool = True) -> None:
        self.dims = dims
        self.protected = protected
        self.merging = merge
        self.partial: dict[str, Partial] = {}
        self.derived: set[str] = set()
        self.renamed: dict[str, str] = {}
        self._seen: dict[tuple, onnx.NodeProto] = {}
        self._values: dict[Partial, str] = {}
        #: symbol -> (tensor, axis) whose dim it is, for every symbol a Shape node read
        self._sources: dict[str, tuple[str, int]] = {}
        #: Nodes removed by :meth:`fold`, :meth:`merge` and :meth:`prune`.
        self.removed = 0

    def rename(self, node: onnx.NodeProto) -> onnx.NodeProto:
        """``node`` itself, or a copy reading the kept value where it read a merged duplicate.

        Names in subgraphs (e.g. a fused node's ``body``) are renamed alike.
        """
        if (
            not self.renamed
            or not any(x in self.renamed for x in node.input)
            and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        ):
            return node
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        _rename_node(copy, self.renamed)
        return copy

    def fold(self, node: onnx.NodeProto, constants: dict) -> bool:
        """Record what ``node`` computes of shapes; True when it is dropped.

        It is dropped when its value became a constant in ``constants`` or
        equals an earlier value (its readers are then renamed to that value).
        """
        if len(node.output) != 1 or node.output[0] in self.protected:
            return False
        if node.domain in ("", "ai.onnx") or (node.domain, node.op_type) == ("ai.onnxkv", "ViewChain"):
            found = self._evaluate(node, constants)
        elif (node.domain, node.op_type) == ("ai.onnxkv", "ShapeOf"):
            found = self.partial.get(node.output[0])
        elif (node.domain, node.op_type) == ("ai.onnxkv", "RepeatKvShape"):
            found = self._repeat_kv_shape(node, constants)
        else:
            return False
        if found is None:
            return False
        values, out_shape, kind = found
        out = node.output[0]
        self.partial[out] = found
        if any(v is None for v in values):
            return False
        if any(isinstance(v, str) for v in values):
            if not self.merging:
                return False
            first = self._values.setdefault(found, out)
            if first == out:
                return False
            self.renamed[out] = first
        else:
            arr = np.array(values, dtype=_KINDS[kind]).reshape(out_shape)
            arr.flags.writeable = False
            constants[out] = arr
        self.removed += 1
        return True

    def rewrite(self, node: onnx.NodeProto, constants: dict) -> onnx.NodeProto:
        """``node``, or a copy reading a new constant instead of a run-time shape that is certain to equal it.

        * ``Reshape(x, target)`` (``allowzero=0``): an entry equal to x's dim at
          the same position becomes 0 ("copy that dim");
        * ``Expand(x, shape)`` and the expand shape of the repeat_kv fusions
          (``ai.onnxkv::RepeatKvMatMul``/``RepeatKvShape``/``MaskedAttention``,
          applied to ``Unsqueeze(x, axes)``): an entry equal to the aligned dim
          of the expanded tensor becomes 1;
        * the reshape target of ``ai.onnxkv::RepeatKvMatMul``/``MaskedAttention``
          whose entries are constants (not 0) or equal to the repeated
          tensor's own dim at the same position becomes a template: those dims
          become 0 and the position is listed in the node's
          :data:`~onnxkv.plan.fusion.RESHAPE_FROM_X` attribute (the operator
          rebuilds the exact target from the tensor's shape);
        * a ``Reshape`` inside an ``ai.onnxkv::ViewChain``, as if it stood alone.

        Applied only when every run-time entry is replaced, so the shape
        computation can be dropped (:meth:`prune`).
        """
        op, dom = node.op_type, node.domain
        if (dom in ("", "ai.onnx") and op != "Shape") or (dom, op) == ("ai.onnxkv", "ViewChain"):
            made = self._shape_of(node, constants)
            if made is not None:
                return made
        # (input position, new constant, where the body may read the input, whether it is a template)
        targets: list[tuple[int, np.ndarray | None, dict[str, int], bool]] = []
        if dom in ("", "ai.onnx") and op == "Reshape" and len(node.input) == 2 and not _attr(node, "allowzero", 0):
            targets.append((1, self._against(node.input[1], self.dims.get(node.input[0]), 0, constants), {}, False))
        elif dom in ("", "ai.onnx") and op == "Expand" and len(node.input) == 2:
            targets.append((1, self._against(node.input[1], self.dims.get(node.input[0]), 1, constants), {}, False))
        elif dom == "ai.onnxkv" and op in REPEAT_KV_INPUTS:
            for x, axes, shape, reshape in REPEAT_KV_INPUTS[op]:
                if len(node.input) > shape and node.input[shape]:
                    dims = self._unsqueezed(node.input[x], node.input[axes], constants)
                    targets.append(
                        (shape, self._against(node.input[shape], dims, 1, constants), _BODY_EXPAND_POSITION, False)
                    )
                if op in _TEMPLATE_OPS and len(node.input) > reshape and node.input[reshape]:
                    targets.append(
                        (
                            reshape,
                            self._template(node.input[reshape], self.dims.get(node.input[x]), constants),
                            _BODY_RESHAPE_POSITION,
                            True,
                        )
                    )
        elif dom == "ai.onnxkv" and op == "ViewChain":
            body = _attr(node, "body", None)
            steps = list(body.node) if body is not None else []
            for step in steps:
                if (
                    default_op(step, "Reshape")
                    and len(step.input) == 2
                    and not _attr(step, "allowzero", 0)
                    and step.input[1] in node.input[1:]
                    and sum(step.input[1] in n.input for n in steps) == 1
                ):
                    arr = self._against(step.input[1], self.dims.get(step.input[0]), 0, constants)
                    targets.append((list(node.input).index(step.input[1]), arr, {"Reshape": 1}, False))
        targets = [t for t in targets if t[1] is not None]
        if not targets:
            return node
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        templates = []
        for pos, arr, body_positions, template in targets:
            old, new = node.input[pos], f"shape_fold::{node.output[0]}::{pos}"
            if list(node.input).count(old) != 1 or not _body_reads_only_at(node, old, body_positions):
                continue
            arr.flags.writeable = False
            constants[new] = arr
            copy.input[pos] = new
            _rename_node(copy, {old: new}, inputs=False)
            if template:
                templates.append(pos)
        if templates:
            copy.attribute.append(onnx.helper.make_attribute(RESHAPE_FROM_X, sorted(templates)))
        return copy

    def _shape_of(self, node: onnx.NodeProto, constants: dict) -> onnx.NodeProto | None:
        """An ``ai.onnxkv::ShapeOf`` node computing ``node``'s run-time shape value from tensor dims, or None.

        Its partial value is recorded (for :meth:`fold`); None unless the
        value is int64, has a symbol among its entries and no unknown one.
        """
        if len(node.output) != 1 or node.output[0] in self.protected or node.output[0] in constants:
            return None
        found = self._evaluate(node, constants)
        if (
            found is None
            or found[2] != "i"
            or not all(isinstance(v, int) or v in self._sources for v in found[0])
            or all(isinstance(v, int) for v in found[0])
        ):
            return None
        tensors = list(dict.fromkeys(self._sources[v][0] for v in found[0] if isinstance(v, str)))
        sources = [tensors.index(self._sources[v][0]) if isinstance(v, str) else -1 for v in found[0]]
        values = [self._sources[v][1] if isinstance(v, str) else v for v in found[0]]
        self.partial[node.output[0]] = found
        return onnx.helper.make_node(
            "ShapeOf",
            tensors,
            list(node.output),
            name=node.name or node.output[0],
            domain="ai.onnxkv",
            sources=sources,
            values=values,
            rank=len(found[1]),
        )

    def _template(self, name: str, dims: tuple[Entry, ...] | None, constants: dict) -> np.ndarray | None:
        """``name``'s partial value as a :data:`~onnxkv.plan.fusion.RESHAPE_FROM_X` template over ``dims``.

        None unless ``name`` is a run-time int64 1-D value with one entry per
        dim, each a non-zero integer or a symbol equal to the dim at its position.
        """
        found = self.partial.get(name)
        if dims is None or found is None or found[2] != "i" or found[1] != (len(dims),) or name in constants:
            return None
        out = []
        for v, d in zip(found[0], dims):
            if isinstance(v, int) and v != 0:
                out.append(v)
            elif isinstance(v, str) and v == d:
                out.append(0)
            else:
                return None
        return np.array(out, dtype=np.int64)

    def _unsqueezed(self, x: str, axes: str, constants: dict) -> tuple[Entry, ...] | None:
        """Dims of ``Unsqueeze(x, axes)`` from x's static dims and constant axes, or None."""
        dims, ax = self.dims.get(x), _const_ints(constants, axes) if axes else None
        if dims is None or ax is None:
            return None
        rank = len(dims) + ax.size
        if np.any(ax < -rank) or np.any(ax >= rank) or len(set((ax % rank).tolist())) != ax.size:
            return None
        out = list(dims)
        for a in sorted((ax % rank).tolist()):
            out.insert(a, 1)
        return tuple(out)

    def _against(self, name: str, dims: tuple[Entry, ...] | None, same: int, constants: dict) -> np.ndarray | None:
        """``name``'s partial value with each symbol equal to the aligned entry of ``dims`` set to ``same``.

        Reshape (``same=0``) aligns from the left, Expand (``same=1``) from the
        right.  None unless ``name`` is a run-time int64 1-D value that
        becomes fully known that way.
        """
        found = self.partial.get(name)
        if dims is None or found is None or found[2] != "i" or len(found[1]) != 1 or name in constants:
            return None
        entries = found[0]
        shift = 0 if same == 0 else len(dims) - len(entries)
        out = []
        for i, v in enumerate(entries):
            j = i + shift
            if isinstance(v, int):
                out.append(v)
            elif isinstance(v, str) and 0 <= j < len(dims) and dims[j] == v:
                out.append(same)
            else:
                return None
        return np.array(out, dtype=np.int64)

    def _value(self, name: str, constants: dict) -> Partial | None:
        """What is known of a 0-/1-D int64 or bool value: a partial value, or a small constant."""
        if name in self.partial:
            return self.partial[name]
        arr = constants.get(name)
        if arr is None or arr.ndim > 1 or arr.size > _FINGERPRINT_LIMIT:
            return None
        kind = next((k for k, t in _KINDS.items() if arr.dtype == t), None)
        if kind is None:
            return None
        return tuple(arr.ravel().tolist()), arr.shape, kind

    def _evaluate(self, node: onnx.NodeProto, constants: dict) -> Partial | None:
        """The partial value ``node`` computes (see :data:`Partial`), or None when not one of the shape operators.

        An ``ai.onnxkv::ViewChain`` is evaluated step by step through its body.
        """
        op = node.op_type
        if (node.domain, op) == ("ai.onnxkv", "ViewChain"):
            found = None
            for step in _attr(node, "body", onnx.GraphProto()).node:
                found = self._evaluate(step, constants)
                if found is None:
                    return None
                self.partial[step.output[0]] = found
            return found
        if op == "Shape":
            dims = self.dims.get(node.input[0])
            if dims is None:
                return None
            x, rank = node.input[0], len(dims)
            start, end = _attr(node, "start", 0), _attr(node, "end", rank)
            start = min(max(start + rank if start < 0 else start, 0), rank)
            end = min(max(end + rank if end < 0 else end, 0), rank)
            entries = tuple(f"{x}[{i}]" if dims[i] is None else dims[i] for i in range(start, end))
            for i, d in zip(range(start, end), entries):
                if isinstance(d, str):
                    self._sources.setdefault(d, (x, i))
            return entries, (len(entries),), "i"
        args = [self._value(x, constants) if x else None for x in node.input]
        if not args or args[0] is None:
            return None
        data, shape, kind = args[0]
        n = len(data)
        if op == "Gather" and len(shape) == 1 and _attr(node, "axis", 0) in (0, -1):
            idx = _const_ints(constants, node.input[1])
            if idx is None or np.any(idx < -n) or np.any(idx >= n):
                return None
            return tuple(data[int(i)] for i in (idx % n).ravel()), idx.shape, kind
        if op == "Slice" and len(shape) == 1:
            return self._slice(node, data, kind, constants)
        if op == "Unsqueeze" and shape == ():
            axes = _const_ints(constants, node.input[1]) if len(node.input) > 1 else np.array(_attr(node, "axes", []))
            return (data, (1,), kind) if axes is not None and axes.ravel().tolist() in ([0], [-1]) else None
        if op == "Squeeze" and shape == (1,):
            axes = _const_ints(constants, node.input[1]) if len(node.input) > 1 and node.input[1] else None
            return (data, (), kind) if axes is None or axes.ravel().tolist() in ([0], [-1]) else None
        if op == "Cast" and kind == "i" and _attr(node, "to", 0) == onnx.TensorProto.INT64:
            return args[0]
        if op == "Reshape":
            target = _const_ints(constants, node.input[1])
            if target is None or target.ndim != 1 or target.size > 1 or _attr(node, "allowzero", 0):
                return None
            out_shape = (n,) if target.size == 1 and int(target[0]) in (-1, 0, n) else () if target.size == 0 else None
            return (data, out_shape, kind) if out_shape is not None and (out_shape or n == 1) else None
        if (
            op == "Concat"
            and _attr(node, "axis", 0) in (0, -1)
            and all(a is not None and len(a[1]) == 1 and a[2] == kind for a in args)
        ):
            joined = tuple(v for a in args for v in a[0])
            return joined, (len(joined),), kind
        if op == "Equal" and len(args) == 2 and args[1] is not None and kind == "i" == args[1][2]:
            pairs = _broadcast(args[0], args[1])
            return None if pairs is None else (tuple(_equal(a, b) for a, b in pairs[0]), pairs[1], "b")
        if (
            op == "Where"
            and kind == "b"
            and len(args) == 3
            and all(a is not None for a in args[1:])
            and args[1][2] == args[2][2]
        ):
            picks = _broadcast(args[1], args[2])
            if picks is None or args[0][1] not in ((), picks[1]):
                return None
            conds = data if shape else data * len(picks[0])
            return (
                tuple(a if c is True else b if c is False else None for c, (a, b) in zip(conds, picks[0])),
                picks[1],
                args[1][2],
            )
        return None

    def _repeat_kv_shape(self, node: onnx.NodeProto, constants: dict) -> Partial | None:
        """``RepeatKvShape(x, axes, expand, reshape)``: the reshape target itself when it has no 0 or -1 entry.

        Such a target is the result's shape in every run that succeeds (a run
        where it does not fit the expanded tensor fails in the repeat itself).
        """
        target = self._value(node.input[3], constants)
        if target is None or target[2] != "i" or len(target[1]) != 1 or any(v in (0, -1) for v in target[0]):
            return None
        entries = target[0]
        start, end = _attr(node, "start", 0), _attr(node, "end", None)
        picked = entries[start:end] if end is not None else entries[start:]
        return tuple(picked), (len(picked),), "i"

    def _slice(self, node: onnx.NodeProto, data: tuple, kind: str, constants: dict) -> Partial | None:
        names = (list(node.input[1:]) + ["", ""])[:4]
        params = [_const_ints(constants, x) if x else None for x in names]
        if any(x and p is None for x, p in zip(names, params)):
            return None
        starts, ends, axes, steps = params
        if starts is None or ends is None or starts.size != 1 or ends.size != 1:
            return None
        if axes is not None and (axes.size != 1 or int(axes[0]) not in (0, -1)):
            return None
        step = 1 if steps is None else int(steps.ravel()[0])
        if step == 0:
            return None
        picked = tuple(data[i] for i in range(len(data))[slice(int(starts[0]), int(ends[0]), step)])
        return picked, (len(picked),), kind

    def merge(self, node: onnx.NodeProto, constants: dict, deterministic: bool) -> bool:
        """True when ``node`` repeats an earlier deterministic node (its outputs are then renamed to that node's)."""
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return False
        if (
            node.op_type == "Shape"
            or (node.domain, node.op_type) == ("ai.onnxkv", "ShapeOf")
            or (
                deterministic and node.input and all((not x) or x in constants or x in self.derived for x in node.input)
            )
        ):
            self.derived.update(o for o in node.output if o)
        elif not deterministic or not node.input or node.op_type in _RANDOM_WHEN_TRAINING:
            return False
        if not self.merging or any(o in self.protected for o in node.output):
            return False
        attrs = tuple(sorted(a.SerializeToString(deterministic=True) for a in node.attribute))
        inputs = tuple(_fingerprint(constants, x) for x in node.input)
        key = (node.domain, node.op_type, inputs, attrs, len(node.output))
        first = self._seen.get(key)
        if first is None:
            self._seen[key] = node
            return False
        for mine, theirs in zip(node.output, first.output):
            if mine:
                self.renamed[mine] = theirs
                if mine in self.partial:
                    self.partial[theirs] = self.partial[mine]
        self.removed += 1
        return True

    def prune(self, nodes: list[onnx.NodeProto], reads: list[list[str]]) -> list[int]:
        """Indices of ``nodes`` to keep: shape-derived nodes none of whose outputs is read go.

        ``reads[k]`` lists every value node ``k`` reads (inputs and subgraph captures).
        """
        read = set(self.protected)
        alive = [True] * len(nodes)
        for k in range(len(nodes) - 1, -1, -1):
            node = nodes[k]
            outs = [o for o in node.output if o]
            if outs and all(o in self.derived and o not in read for o in outs):
                alive[k] = False
                self.removed += 1
                continue
            read.update(x for x in reads[k] if x)
        return [k for k in range(len(nodes)) if alive[k]]
