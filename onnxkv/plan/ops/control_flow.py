"""``If``, ``Loop`` and ``Scan``: control flow over subgraphs built into plans of their own.

Each subgraph (``then_branch`` / ``else_branch``, ``body``) becomes a
:class:`~onnxkv.plan.plan.Plan` once, when the enclosing plan is built
(``BuildContext.subplan``), so onnxkv kernels, fusions and constant folding
run inside it.  Values a subgraph reads from the enclosing scope are
constants of its plan when they are known at build time; the others are the
node's ``captures``, which the enclosing plan passes after the node's inputs
and counts as uses.  An output may be the very array of an input or capture
(a branch returning an outer value, a Loop of zero iterations), so every
input and capture position is a view input.

Semantics (ONNX, every opset version):

* ``If(cond)`` runs ``then_branch`` when the one element of the bool
  ``cond`` is true, else ``else_branch``; its outputs are that branch's
  (their shapes may differ between the branches).
* ``Loop(M, cond, v_initial...)``: the body takes (iteration number, cond,
  carried values...) and returns (cond, carried values..., scan outputs...).
  It runs while ``i < M`` (when ``M`` is given) and while the condition
  holds: ``cond`` before the first iteration (true when omitted), then the
  body's cond output.  (ONNX's operator text calls that output ignored when
  ``cond`` is omitted; ONNX Runtime and ``onnx.reference`` use it, and so
  does onnxkv.)  Without ``M`` it runs until the body's condition is false
  or the run is cancelled.  Outputs: the final carried values, then each scan
  output's elements stacked along a new axis 0.  After zero iterations the
  carried values are the initial ones and a scan output is empty, of shape
  ``[0] +`` the declared dims of the body output (a dim that is no known
  integer counts 0; ``[0]`` when no shape is declared), as ONNX Runtime does.
* ``Scan`` 9+ (states..., scan inputs...): each of the ``num_scan_inputs``
  last inputs is sliced along ``scan_input_axes`` (default 0, negative
  counts from the end), in order or reversed (``scan_input_directions``
  1); the body takes the states and one slice of each and returns the new
  states and one element per scan output.  Scan output ``k`` stacks its
  elements along ``scan_output_axes[k]`` (in ``[-(r+1), r]`` for elements of
  rank ``r``), in iteration order or reversed (``scan_output_directions``).
  A scan of length zero gives the initial states and empty scan outputs as
  Loop does (ONNX Runtime and ``onnx.reference`` reject it).
* ``Scan`` 8 (sequence_lens, states..., scan inputs...): every input has a
  batch axis 0 and scan inputs are ``[batch, sequence, ...]``; each batch
  row is scanned on its own over its first ``sequence_lens[b]`` positions
  (all without ``sequence_lens``; ``directions`` reverse inputs), and scan
  output positions past a row's length are zero.

Checks, each an onnxkv error naming the node, the value and what was
expected: at build time the subgraphs' input and output counts against the
node's, and the attributes (:class:`~onnxkv.errors.ModelError`); at run time
``cond`` a bool tensor of one element, ``M`` an int64 tensor of one element,
values fed to a body of its declared element types, scan inputs of one
length along axes within their ranks, ``sequence_lens`` int64 ``[batch]``
within the sequence length (:class:`~onnxkv.errors.InputError`); a body's
cond output a bool tensor of one element, carried values and states
keeping their element type, and each scan output's elements keeping the
shape and type of the first (:class:`~onnxkv.errors.OperatorError`).

Running: a subgraph's plan runs inside this node
(:meth:`~onnxkv.plan.plan.Plan.run_nested`): cancellation is checked
between its nodes and before every Loop or Scan iteration (so a Loop with a
huge ``M``, or none, stops there), deferred rollbacks and storage counters
belong to the enclosing run, and an error inside names the failing body
node, prefixed by this node and the branch or iteration.  Cache bindings
never reach a subgraph (:mod:`onnxkv.model.rewrite`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from onnxkv.errors import Cancelled, InputError, OnnxkvError, OperatorError
from onnxkv.plan.context import RunContext
from onnxkv.plan.registry import BuildContext, Op, register

__all__ = ["If", "Loop", "Scan", "Scan8"]


def _declared(vi: onnx.ValueInfoProto) -> tuple[np.dtype | None, tuple[int, ...] | None]:
    """A graph output's declared element type (None: unknown) and dims (a dim that is no known integer: 0)."""
    t = vi.type.tensor_type
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)) if t.elem_type else None
    if not t.HasField("shape"):
        return dtype, None
    return dtype, tuple(d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim)


class _ControlFlow(Op):
    """What If, Loop and Scan share: sub-plans, captures, checks, and running a sub-plan with its errors named."""

    def _subplan(self, attr: str, ctx: BuildContext):
        graph = self.attrs.get(attr)
        if not isinstance(graph, onnx.GraphProto):
            raise self.error(f"needs the graph attribute '{attr}'")
        if ctx.subplan is None:
            raise self.error("subgraphs are built by a Plan; this BuildContext has no subplan builder")
        return ctx.subplan(graph, f"{self.op_type} node '{self.name}': attribute '{attr}'")

    def _capture(self, plans: Sequence) -> None:
        """Set ``captures`` (every plan's scope, once each) and where each plan finds its scope in the inputs."""
        self.captures = tuple(dict.fromkeys(name for plan in plans for name in plan.scope))
        first = len(self.node.input)
        self._scope_at = [tuple(first + self.captures.index(name) for name in plan.scope) for plan in plans]
        self.view_inputs = tuple(range(first + len(self.captures)))

    def _scope(self, inputs: list, plan: int) -> list:
        return [inputs[i] for i in self._scope_at[plan]]

    def _run_body(self, plan, values: list, rt: RunContext, where: str) -> list:
        try:
            return plan.run_nested(values, rt)
        except Cancelled:
            raise
        except OnnxkvError as e:
            raise type(e)(f"{self.op_type} node '{self.name}', {where}: {e}") from e

    def _cancel_point(self, rt: RunContext, where: str) -> None:
        if rt.cancel is not None and rt.cancel.cancelled:
            raise Cancelled(f"run cancelled in {self.op_type} node '{self.name}' before {where}")

    def _one(self, value, dtype: type, what: str, error: type[OnnxkvError] = InputError):
        """The element of ``value``, a ``dtype`` tensor of one element, as a Python scalar."""
        if not isinstance(value, np.ndarray) or value.dtype != dtype or value.size != 1:
            got = f"{value.dtype} of shape {value.shape}" if isinstance(value, np.ndarray) else repr(value)
            raise error(
                f"{self.op_type} node '{self.name}': {what} must be a tensor of one {np.dtype(dtype)} "
                f"element, got {got}"
            )
        return value.reshape(()).item()

    def _check_types(
        self,
        values: Sequence,
        declared: Sequence,
        names: Sequence[str],
        what: str,
        error: type[OnnxkvError] = InputError,
    ) -> None:
        """Each value is an array of the declared input's element type, if any (``names`` name the values)."""
        for value, want, name in zip(values, declared, names):
            if not isinstance(value, np.ndarray) or want.dtype not in (None, value.dtype):
                got = value.dtype if isinstance(value, np.ndarray) else repr(value)
                raise error(
                    f"{self.op_type} node '{self.name}': {what} '{name}' is {got}, but the body input "
                    f"'{want.name}' it feeds is {want.dtype}"
                )

    def _collect(self, items: list, value, output: str, where: str) -> None:
        """Add a scan output element, which has the shape and element type of the first one."""
        if not isinstance(value, np.ndarray):
            raise OperatorError(
                f"{self.op_type} node '{self.name}', {where}: scan output '{output}' is {value!r}, not a tensor"
            )
        if items and (value.shape != items[0].shape or value.dtype != items[0].dtype):
            raise OperatorError(
                f"{self.op_type} node '{self.name}', {where}: scan output '{output}' is "
                f"{value.dtype} of shape {value.shape}, but the first iteration's was "
                f"{items[0].dtype} of shape {items[0].shape}; scan outputs keep their shape"
            )
        items.append(value)

    def _stacked(
        self, rt: RunContext, index: int, items: list, axis: int, reverse: bool, declared: tuple
    ) -> np.ndarray:
        """Output ``index``: the scan elements ``items`` stacked along ``axis`` (reversed if asked)."""
        if not items:
            return self._empty(rt, index, axis, declared)
        rank = items[0].ndim
        if not -rank - 1 <= axis <= rank:
            raise OperatorError(
                f"{self.op_type} node '{self.name}': output {index} stacks elements of rank {rank}, "
                f"so its scan output axis must lie in [{-rank - 1}, {rank}], got {axis}"
            )
        axis %= rank + 1
        shape = items[0].shape
        out = rt.empty(index, shape[:axis] + (len(items),) + shape[axis:], items[0].dtype)
        view = np.moveaxis(out, axis, 0)
        last = len(items) - 1
        for t, item in enumerate(items):
            view[last - t if reverse else t] = item
        return out

    def _empty(self, rt: RunContext, index: int, axis: int, declared: tuple) -> np.ndarray:
        """A scan output after zero iterations: zero along ``axis`` of the declared dims (see the module docstring)."""
        dtype, dims = declared
        if dtype is None:
            raise OperatorError(
                f"{self.op_type} node '{self.name}': output {index} has no elements and its body "
                "output declares no element type"
            )
        dims = () if dims is None else dims
        axis = axis % (len(dims) + 1) if -len(dims) - 1 <= axis <= len(dims) else 0
        return rt.empty(index, dims[:axis] + (0,) + dims[axis:], dtype)


@register("If", since=1)
class If(_ControlFlow):
    """``If(cond) -> outputs of then_branch or else_branch`` (see the module docstring)."""

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        if len(node.input) != 1 or not node.input[0]:
            raise self.error(f"takes one input (cond), got {list(node.input)}")
        self.then_plan = self._subplan("then_branch", ctx)
        self.else_plan = self._subplan("else_branch", ctx)
        for attr, plan in (("then_branch", self.then_plan), ("else_branch", self.else_plan)):
            if len(plan.output_names) != len(node.output):
                raise self.error(f"has {len(node.output)} outputs but its {attr} has {len(plan.output_names)}")
        self._capture([self.then_plan, self.else_plan])

    def run(self, inputs: list, rt: RunContext) -> list:
        if self._one(inputs[0], np.bool_, f"cond '{self.node.input[0]}'"):
            return self._run_body(self.then_plan, self._scope(inputs, 0), rt, "then_branch")
        return self._run_body(self.else_plan, self._scope(inputs, 1), rt, "else_branch")


@register("Loop", since=1)
class Loop(_ControlFlow):
    """``Loop(M, cond, v_initial...) -> (v_final..., scan_outputs...)`` (see the module docstring)."""

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self.body = self._subplan("body", ctx)
        graph = self.attrs["body"]
        n = len(node.input) - 2
        if n < 0 or len(graph.input) != n + 2 or len(graph.output) < n + 1:
            raise self.error(
                f"has {len(node.input)} inputs (M, cond and {max(n, 0)} loop-carried values), so its "
                f"body needs {max(n, 0) + 2} inputs and at least {max(n, 0) + 1} outputs; it has "
                f"{len(graph.input)} and {len(graph.output)}"
            )
        self.carried = n
        self.scans = len(graph.output) - 1 - n
        if len(node.output) > n + self.scans:
            raise self.error(
                f"has {len(node.output)} outputs; its body gives {n} loop-carried values and {self.scans} scan outputs"
            )
        counter, cond = self.body.inputs[:2]
        if counter.dtype not in (None, np.int64) or cond.dtype not in (None, np.bool_):
            raise self.error(
                f"body inputs '{counter.name}' and '{cond.name}' must be the int64 iteration number "
                f"and the bool condition, but are {counter.dtype} and {cond.dtype}"
            )
        self._declared = [_declared(vi) for vi in graph.output[1 + n :]]
        self._outputs = [vi.name for vi in graph.output]
        self._capture([self.body])

    def run(self, inputs: list, rt: RunContext) -> list:
        node, n = self.node, self.carried
        m, cond = inputs[0], inputs[1]
        carried = inputs[2 : len(node.input)]
        self._check_types(carried, self.body.inputs[2:], node.input[2:], "loop-carried input")
        limit = None if m is None else self._one(m, np.int64, f"trip count M '{node.input[0]}'")
        going = True if cond is None else self._one(cond, np.bool_, f"condition '{node.input[1]}'")
        scope = self._scope(inputs, 0)
        scans: list[list] = [[] for _ in range(self.scans)]
        i = 0
        while going and (limit is None or i < limit):
            where = f"iteration {i}"
            self._cancel_point(rt, where)
            outs = self._run_body(self.body, [np.array(i, np.int64), np.array(going), *carried, *scope], rt, where)
            going = self._one(outs[0], np.bool_, f"{where}: body output '{self._outputs[0]}'", OperatorError)
            carried = outs[1 : 1 + n]
            self._check_types(
                carried, self.body.inputs[2:], self._outputs[1 : 1 + n], f"{where}: loop-carried output", OperatorError
            )
            for k, value in enumerate(outs[1 + n :]):
                self._collect(scans[k], value, self._outputs[1 + n + k], where)
            i += 1
        stacked = [
            self._stacked(rt, n + k, items, 0, False, self._declared[k]) if n + k < len(node.output) else None
            for k, items in enumerate(scans)
        ]
        return [*carried, *stacked][: len(node.output)]


class _ScanBody(_ControlFlow):
    """The body of both Scan versions: counts, attributes and the iteration over slices."""

    #: Leading inputs that are neither states nor scan inputs (Scan 8: sequence_lens).
    lead = 0

    def _build_body(self, ctx: BuildContext, directions: str) -> None:
        node = self.node
        self.body = self._subplan("body", ctx)
        graph = self.attrs["body"]
        m = self.attrs.get("num_scan_inputs")
        if not isinstance(m, int) or not 1 <= m <= len(node.input) - self.lead:
            raise self.error(
                f"num_scan_inputs must be an int in [1, {len(node.input) - self.lead}] (its scan "
                f"inputs are among its last inputs), got {m!r}"
            )
        n = len(node.input) - self.lead - m
        if len(graph.input) != n + m or len(graph.output) < n:
            raise self.error(
                f"has {n} state and {m} scan inputs, so its body needs {n + m} inputs and at least "
                f"{n} outputs; it has {len(graph.input)} and {len(graph.output)}"
            )
        self.states, self.inputs, self.scans = n, m, len(graph.output) - n
        if len(node.output) > n + self.scans:
            raise self.error(f"has {len(node.output)} outputs; its body gives {n} states and {self.scans} scan outputs")
        self.directions = self._flags(directions, m)
        self._declared = [_declared(vi) for vi in graph.output[n:]]
        self._outputs = [vi.name for vi in graph.output]
        self._capture([self.body])

    def _ints(self, attr: str, count: int, default: int) -> list[int]:
        values = self.attrs.get(attr)
        if values is None:
            return [default] * count
        if len(values) != count:
            raise self.error(f"attribute '{attr}' has {len(values)} entries, expected {count}")
        return [int(v) for v in values]

    def _flags(self, attr: str, count: int) -> list[bool]:
        values = self._ints(attr, count, 0)
        if any(v not in (0, 1) for v in values):
            raise self.error(f"attribute '{attr}' must hold 0 (forward) or 1 (reverse), got {values}")
        return [bool(v) for v in values]

    def _iterate(
        self, states: list, sequences: list, length: int, scope: list, rt: RunContext, prefix: str = ""
    ) -> tuple[list, list[list]]:
        """Run the body over positions ``[0, length)`` of ``sequences`` (scan axis first, C-contiguous).

        Returns the final states and each scan output's elements in iteration order.
        """
        n = self.states
        elements: list[list] = [[] for _ in range(self.scans)]
        last = length - 1
        for t in range(length):
            where = f"{prefix}iteration {t}"
            self._cancel_point(rt, where)
            slices = [s[last - t if rev else t, ...] for s, rev in zip(sequences, self.directions)]
            outs = self._run_body(self.body, [*states, *slices, *scope], rt, where)
            states = outs[:n]
            self._check_types(states, self.body.inputs[:n], self._outputs[:n], f"{where}: state output", OperatorError)
            for k, value in enumerate(outs[n:]):
                self._collect(elements[k], value, self._outputs[n + k], where)
        return states, elements


@register("Scan", since=9)
class Scan(_ScanBody):
    """``Scan(states..., scan inputs...) -> (final states..., scan outputs...)``, opset 9+ (module docstring)."""

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self._build_body(ctx, "scan_input_directions")
        self.axes = self._ints("scan_input_axes", self.inputs, 0)
        self.output_axes = self._ints("scan_output_axes", self.scans, 0)
        self.output_reversed = self._flags("scan_output_directions", self.scans)

    def run(self, inputs: list, rt: RunContext) -> list:
        node, n = self.node, self.states
        states, xs = inputs[:n], inputs[n : len(node.input)]
        names = node.input[n:]
        self._check_types(states, self.body.inputs[:n], node.input[:n], "state input")
        self._check_types(xs, self.body.inputs[n:], names, "scan input")
        sequences, length = [], None
        for x, axis, name in zip(xs, self.axes, names):
            if not -x.ndim <= axis < x.ndim:
                raise InputError(
                    f"Scan node '{self.name}': scan input '{name}' of shape {x.shape} has no axis {axis} "
                    f"(scan_input_axes must lie in [{-x.ndim}, {x.ndim - 1}])"
                )
            axis %= x.ndim
            if length is not None and x.shape[axis] != length:
                raise InputError(
                    f"Scan node '{self.name}': scan input '{name}' has length {x.shape[axis]} along axis "
                    f"{axis}, but '{names[0]}' has {length}; every scan input needs the same length"
                )
            length = x.shape[axis]
            sequences.append(np.ascontiguousarray(np.moveaxis(x, axis, 0)))
        states, elements = self._iterate(states, sequences, length, self._scope(inputs, 0), rt)
        outputs = [
            self._stacked(rt, n + k, items, axis, rev, declared) if n + k < len(node.output) else None
            for k, (items, axis, rev, declared) in enumerate(
                zip(elements, self.output_axes, self.output_reversed, self._declared)
            )
        ]
        return [*states, *outputs][: len(node.output)]


@register("Scan", since=8)
class Scan8(_ScanBody):
    """``Scan(sequence_lens, states..., scan inputs...)``, opset 8, batched (see the module docstring)."""

    lead = 1

    def __init__(self, node: onnx.NodeProto, ctx: BuildContext) -> None:
        super().__init__(node, ctx)
        self._build_body(ctx, "directions")

    def run(self, inputs: list, rt: RunContext) -> list:
        node, n = self.node, self.states
        states, xs = inputs[1 : 1 + n], inputs[1 + n : len(node.input)]
        names = node.input[1:]
        batch, length = self._batch(states, xs, names)
        lens = self._lengths(inputs[0], batch, length)
        self._check_types(states, self.body.inputs[:n], names[:n], "state input")
        self._check_types(xs, self.body.inputs[n:], names[n:], "scan input")
        scope = self._scope(inputs, 0)
        rows = [
            self._iterate(
                [np.ascontiguousarray(s[b, ...]) for s in states],
                [np.ascontiguousarray(x[b, : lens[b]]) for x in xs],
                lens[b],
                scope,
                rt,
                f"batch row {b}, ",
            )
            for b in range(batch)
        ]
        finals = [self._rows(rt, k, [r[0][k] for r in rows]) for k in range(n)] if batch else states
        outputs = []
        for k in range(self.scans):
            if n + k >= len(node.output):
                break
            items = [r[1][k] for r in rows]
            shaped = next((row[0] for row in items if row), None)
            if shaped is None:
                outputs.append(
                    self._empty(rt, n + k, 0, self._declared[k])
                    if batch == 0
                    else self._padded(rt, n + k, batch, length, self._declared[k])
                )
                continue
            out = rt.empty(n + k, (batch, length) + shaped.shape, shaped.dtype)
            for b, row in enumerate(items):
                for t, item in enumerate(row):
                    if item.shape != shaped.shape:
                        raise OperatorError(
                            f"Scan node '{self.name}', batch row {b}: scan output "
                            f"'{self._outputs[n + k]}' has shape {item.shape}, but batch rows "
                            f"before it gave {shaped.shape}"
                        )
                    out[b, t] = item
                out[b, len(row) :] = 0
            outputs.append(out)
        return [*finals, *outputs][: len(node.output)]

    def _batch(self, states: list, xs: list, names: Sequence[str]) -> tuple[int, int]:
        """The batch size (axis 0 of every input) and the sequence length (axis 1 of every scan input)."""
        batch = length = None
        for i, x in enumerate([*states, *xs]):
            scan = i >= len(states)
            if x.ndim < 1 + scan:
                raise InputError(
                    f"Scan node '{self.name}': input '{names[i]}' has shape {x.shape}; Scan 8 needs a "
                    f"batch axis{' and a sequence axis' if scan else ''}"
                )
            if batch is not None and x.shape[0] != batch:
                raise InputError(
                    f"Scan node '{self.name}': input '{names[i]}' has batch {x.shape[0]}, but '{names[0]}' has {batch}"
                )
            batch = x.shape[0]
            if scan:
                if length is not None and x.shape[1] != length:
                    raise InputError(
                        f"Scan node '{self.name}': scan input '{names[i]}' has sequence length "
                        f"{x.shape[1]}, but another scan input has {length}"
                    )
                length = x.shape[1]
        return batch, length

    def _lengths(self, given, batch: int, length: int) -> list[int]:
        if given is None:
            return [length] * batch
        name = self.node.input[0]
        if not isinstance(given, np.ndarray) or given.dtype != np.int64 or given.shape != (batch,):
            got = f"{given.dtype} of shape {given.shape}" if isinstance(given, np.ndarray) else repr(given)
            raise InputError(
                f"Scan node '{self.name}': sequence_lens '{name}' must be int64 of shape [{batch}] "
                f"(the batch), got {got}"
            )
        lens = given.tolist()
        if any(not 0 <= v <= length for v in lens):
            raise InputError(
                f"Scan node '{self.name}': sequence_lens '{name}' is {lens}; each must lie in "
                f"[0, {length}] (the sequence length)"
            )
        return lens

    def _rows(self, rt: RunContext, index: int, values: list) -> np.ndarray:
        """Output ``index``: the final state of each batch row (at least one), stacked along a new axis 0."""
        out = rt.empty(index, (len(values),) + values[0].shape, values[0].dtype)
        for b, value in enumerate(values):
            if value.shape != values[0].shape:
                raise OperatorError(
                    f"Scan node '{self.name}', batch row {b}: state '{self._outputs[index]}' has "
                    f"shape {value.shape}, but batch row 0 gave {values[0].shape}"
                )
            out[b] = value
        return out

    def _padded(self, rt: RunContext, index: int, batch: int, length: int, declared: tuple) -> np.ndarray:
        """A scan output of rows that all had length zero: zeros of the declared element dims."""
        dtype, dims = declared
        if dtype is None:
            raise OperatorError(
                f"Scan node '{self.name}': output {index} has no elements and its body output declares no element type"
            )
        out = rt.empty(index, (batch, length) + (dims or ()), dtype)
        out[...] = 0
        return out
