"""The execution plan: built once per model and options, run as a plain loop.

A :class:`Plan` holds the nodes in topological order, one kernel object per
node, integer value slots (no name lookups while running), a release list per
node (values dropped after their last use) and a free list per node (buffers
returned to the allocator once no view of them can be read any more).

Buffer lifetime: outputs a kernel obtains with ``rt.empty`` come from the
plan's allocator unless the value (or anything that may be a view of it)
reaches the caller (storage classes: :mod:`onnxkv.plan.lifetimes`).

Constant folding: nodes whose inputs are all known at build time are run once
while the plan is built (:mod:`onnxkv.plan.folding`); shape computations over
static dims are folded, and repeated ones merged, by
:mod:`onnxkv.plan.shape_fold`.

Subgraphs: a node with subgraphs (``If``, ``Loop``, ``Scan``) builds each into
a plan of its own through ``BuildContext.subplan`` (:mod:`onnxkv.plan.subgraph`
resolves its scope); the values it reads from this plan at run time are the
kernel's ``captures``, passed after the node's inputs and counted as uses
(release lists, storage classes) like inputs.  A nested plan never writes a
value from outside its subgraph in place, and runs inside the node with the
enclosing run's context (:meth:`Plan.run_nested`).

Build-time checks (:class:`~onnxkv.errors.ModelError` naming the node and the
value): every value a node reads (inputs and subgraph captures) is defined
and has one producer; attributes and initializers are well formed
(:mod:`onnxkv.model.tensors`); a kernel class failing on a node's attributes,
or a node failing on constant inputs, is a ModelError too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from onnxkv.errors import InputError, ModelError, OnnxkvError, OperatorError, UnsupportedOperatorError
from onnxkv.events import EventLog
from onnxkv.model.contract import get_output_alias
from onnxkv.model.tensors import check_attributes, tensor_array
from onnxkv.plan import ops as _ops  # noqa: F401  (registers the kernels)
from onnxkv.plan.buffers import RunBuffers, slot_allocator
from onnxkv.plan.context import RunContext
from onnxkv.plan.fallback import FallbackOp, has_fallback
from onnxkv.plan.folding import NON_DETERMINISTIC, fold_node, foldable
from onnxkv.plan.fusion_passes import fuse_graph
from onnxkv.plan.graph_order import dims, node_label, node_reads, topological
from onnxkv.plan.inputs import bind
from onnxkv.plan.lifetimes import plan_lifetimes
from onnxkv.plan.logit_rows import LogitHead, find_head, rows_of_output
from onnxkv.plan.ops._page_readers import share_pages
from onnxkv.plan.registry import DOMAIN_ALIASES, BuildContext, Op, lookup, refuse_internal
from onnxkv.plan.run_loops import needed_nodes, run_plain, run_recording, segmented
from onnxkv.plan.shape_fold import ShapeFolder
from onnxkv.plan.static_dims import static_dims
from onnxkv.plan.step_pool import StepPool
from onnxkv.plan.subgraph import subgraph_model, type_kind

__all__ = ["Plan", "GraphInput", "unsupported_nodes"]

#: Marks an input absent from the feeds.


@dataclass(frozen=True)
class GraphInput:
    """A graph input the caller may feed: name, NumPy dtype (None: a subgraph's untyped input), static shape
    (None = dynamic dim)."""

    name: str
    dtype: np.dtype | None
    shape: tuple[int | str | None, ...] | None
    has_default: bool


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {DOMAIN_ALIASES.get(o.domain, o.domain): o.version for o in model.opset_import}


def unsupported_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes with neither a kernel nor an ``onnx.reference`` fallback."""
    opsets = _opsets(model)
    bad = []
    for n in model.graph.node:
        dom = DOMAIN_ALIASES.get(n.domain, n.domain)
        if lookup(dom, n.op_type, opsets.get(dom, 0)) is None and not has_fallback(dom, n.op_type, opsets.get(dom, 0)):
            bad.append(n)
    return bad


class Plan:
    """Nodes, kernels, slots and release lists for one model; see the module docstring.

    Args:
        model: the ONNX model (already checked and loaded with external data).
        allocator: object of the :class:`onnxkv.alloc.Allocator` protocol for
            temporaries.
        present_outputs / past_inputs: cache value names (for storage counters).
        fuse: apply the fusions of :mod:`onnxkv.plan.fusion` (results are unchanged).
        fold_shapes: fold and merge shape computations with
            :mod:`onnxkv.plan.shape_fold` (results are unchanged).
        bindings: :class:`~onnxkv.model.rewrite.CacheBinding` s whose nodes write
            in place when a state supplies caches to :meth:`run`.
        external: initializer name -> array for initializers kept outside the
            proto (memory-mapped external data, see :func:`onnxkv.load`).
        keep_buffers: after a successful run keep its temporaries (taken from
            ``allocator``) for the next run instead of returning them (see
            :mod:`onnxkv.plan.buffers`); a failed run returns them all.
        compile_steps: replay the kernel calls of compilable nodes on runs that repeat a
            recorded run's shapes (see :mod:`onnxkv.plan.compiled_step`; runs with an
            event log always run node by node).  The steps keep their buffers between
            runs, so only with ``keep_buffers``.
        scope: None for a model's graph; for a subgraph's plan (built by a
            node's kernel through ``BuildContext.subplan``), the names it reads
            from enclosing scopes at run time, fed after its graph inputs by
            :meth:`run_nested`.

    A plan is immutable after construction and may be run from one thread at
    a time per :class:`RunContext`; ``run`` allocates its own slot list.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        allocator,
        present_outputs: Iterable[str] = (),
        past_inputs: Iterable[str] = (),
        fuse: bool = True,
        bindings: Iterable = (),
        external: Mapping[str, np.ndarray] | None = None,
        fold_shapes: bool = True,
        keep_buffers: bool = False,
        scope: Sequence[str] | None = None,
        compile_steps: bool = False,
    ) -> None:
        graph = model.graph
        self.allocator = allocator
        self._fuse, self._fold_shapes = fuse, fold_shapes
        #: Names fed from enclosing scopes after the graph inputs (a subgraph's plan), else None.
        self.scope = None if scope is None else tuple(scope)
        #: Keep a successful run's temporaries for the next run (see onnxkv.plan.buffers).
        self.keep_buffers = bool(keep_buffers)
        self._idle_buffers: list[RunBuffers] = []
        #: Compiled steps (onnxkv.plan.compiled_step) of runs without an event log, or None: plain runs only.
        self.steps = StepPool() if compile_steps and self.keep_buffers else None
        #: Present (cache) outputs: a run always computes them, whatever outputs it is asked for.
        self.present_output_names = frozenset(present_outputs)
        #: Requested output slots -> the nodes a run needs for them (None: every node); see :meth:`needed`.
        self._needed: dict[tuple, list[bool] | None] = {}
        self._heads: dict[str, LogitHead | None] = {}  # see logit_head
        self.opsets = _opsets(model)
        bad = unsupported_nodes(model)
        if bad:
            listed = ", ".join(f"'{n.name or n.output[0]}' ({n.domain or 'ai.onnx'}::{n.op_type})" for n in bad[:10])
            raise UnsupportedOperatorError(
                f"{len(bad)} node(s) use operators onnxkv has no implementation for: {listed}"
                + (" ..." if len(bad) > 10 else "")
            )
        refuse_internal(graph.node)
        external = external or {}
        if any(i.data_location == onnx.TensorProto.EXTERNAL and i.name not in external for i in graph.initializer):
            raise ModelError("initializers with external data were not loaded; load the model with onnxkv.load")

        slot_of: dict[str, int] = {}

        def slot(name: str) -> int:
            if name not in slot_of:
                slot_of[name] = len(slot_of)
            return slot_of[name]

        check_attributes(graph, self.opsets)
        constants: dict[str, np.ndarray] = {}
        for init in graph.initializer:
            if init.name in constants:  # ONNX names a value once; which copy counted depended on its storage
                raise ModelError(f"initializer '{init.name}' is defined twice; a value has one producer")
            arr = external[init.name] if init.name in external else tensor_array(init, f"initializer '{init.name}'")
            if not arr.flags.c_contiguous:
                arr = arr.copy(order="C")
            arr.flags.writeable = False
            constants[init.name] = arr
        if len(graph.sparse_initializer):
            raise ModelError("sparse initializers are not supported")

        self.inputs: list[GraphInput] = []
        for vi in graph.input:
            elem = vi.type.tensor_type.elem_type
            if not elem and self.scope is None:  # a subgraph's untyped input is checked by its node's kernel
                kind = type_kind(vi.type) or "a tensor without an element type"
                raise ModelError(f"graph input '{vi.name}' is {kind}; onnxkv runs tensor values only")
            try:
                dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)) if elem else None
            except (KeyError, TypeError, ValueError):
                raise ModelError(
                    f"graph input '{vi.name}' has element type {elem}, not a tensor type onnxkv reads"
                ) from None
            self.inputs.append(GraphInput(vi.name, dtype, dims(vi), vi.name in constants))
        # An initializer listed as a graph input is from IR 4 on a default a feed may replace (as in ONNX
        # Runtime): never folded or packed.  Before IR 4 every initializer was listed: a constant, not fed.
        self._fixed_inputs = frozenset(g.name for g in self.inputs if g.has_default and model.ir_version < 4)
        defaults = {g.name: constants.pop(g.name) for g in self.inputs if g.has_default and model.ir_version >= 4}
        self.output_names = [o.name for o in graph.output]
        known = set(constants) | {i.name for i in self.inputs} | set(self.scope or ())
        nodes = topological(list(graph.node), known)
        subgraph_reads = {x for n in nodes for x in node_reads(n)} - {x for n in nodes for x in n.input}
        protected = {o.name for o in graph.output} | subgraph_reads
        if fuse:
            nodes = fuse_graph(nodes, protected, constants)

        self.bindings = list(bindings)
        by_node: dict[str, list] = {}
        for b in self.bindings:
            by_node.setdefault(b.node, []).append(b)
        self.build_context = BuildContext(
            self.opsets, constants, frozenset(present_outputs), frozenset(past_inputs), by_node, self._subplan
        )
        kernels: list[Op] = []
        kept_nodes: list[onnx.NodeProto] = []
        shapes = None
        if fold_shapes:
            # Merged values are shared by their readers: only safe when no intermediate value is written in place.
            inputs = {g.name for g in self.inputs}
            shapes = ShapeFolder(static_dims(model), protected, self._written_in_place(nodes) <= inputs)
        for node in nodes:
            if shapes is not None:
                node = shapes.rewrite(shapes.rename(node), constants)
            kernel = None
            if foldable(node, constants):
                kernel = self._make_kernel(node)
                if fold_node(node, kernel, constants, self.opsets):
                    continue
            if shapes is not None and (
                shapes.fold(node, constants)
                or shapes.merge(
                    node,
                    constants,
                    node.op_type not in NON_DETERMINISTIC and (node.name or node.output[0]) not in by_node,
                )
            ):
                continue
            kernels.append(kernel or self._make_kernel(node))
            kept_nodes.append(node)
        if shapes is not None:
            alive = shapes.prune(kept_nodes, [node_reads(n) for n in kept_nodes])
            kept_nodes = [kept_nodes[k] for k in alive]
            kernels = [kernels[k] for k in alive]
        alive = _read_nodes(kept_nodes, protected)  # a node no output depends on never runs (nor stops a replay)
        kept_nodes = [kept_nodes[k] for k in alive]
        kernels = [kernels[k] for k in alive]
        self.nodes = kept_nodes
        self.kernels = kernels
        #: Per node, whether its kernel may call BLAS (run_loops calls the run's on_python hook before one).
        self.uses_blas = [k is None or k.uses_blas for k in kernels]
        share_pages(kept_nodes, kernels)
        #: Names of the nodes run by ``onnx.reference`` fallbacks.
        self.fallback_nodes = [n.name or n.output[0] for n, k in zip(kept_nodes, kernels) if isinstance(k, FallbackOp)]
        self.folded_nodes = len(nodes) - len(kept_nodes)
        #: Nodes removed by shape folding (:mod:`onnxkv.plan.shape_fold`), included in ``folded_nodes``.
        self.shape_folded_nodes = shapes.removed if shapes is not None else 0
        self._drop_absorbed(constants)

        for name in constants:
            slot(name)
        for name in [*(gi.name for gi in self.inputs), *(self.scope or ())]:
            slot(name)
        in_idx, out_idx = [], []
        for node, kernel in zip(kept_nodes, kernels):
            in_idx.append(tuple(slot(x) if x else -1 for x in [*node.input, *kernel.captures]))
            out_idx.append(tuple(slot(x) if x else -1 for x in node.output))
        for name in self.output_names:
            if name not in slot_of:
                raise ModelError(f"graph output '{name}' is never produced")
        self.n_slots = len(slot_of)
        self.slot_of = slot_of
        self.in_idx = in_idx
        self.out_idx = out_idx
        self.input_slots = [slot_of[g.name] for g in self.inputs]
        #: Slots :meth:`run_nested` fills: the graph inputs, then the scope names.
        self.nested_slots = self.input_slots + [slot_of[name] for name in self.scope or ()]
        self.output_slots = [slot_of[n] for n in self.output_names]

        # Two slots past the values: one never written (read for an omitted input), one never read
        # (written for an omitted output), so the run loop needs no test for -1.
        none_slot, sink_slot = self.n_slots, self.n_slots + 1
        template: list = [None] * (self.n_slots + 2)
        for name in constants:
            template[slot_of[name]] = self.build_context.constant(name)
        self._defaults = {slot_of[name]: arr for name, arr in defaults.items()}  # not constants: bound per run
        self._template = template
        self.must_alias = [self._aliases(node, kernel, constants) for node, kernel in zip(kept_nodes, kernels)]
        #: Graph inputs written in place (MUST_ALIAS): fed as given, never copied.
        self.aliased_inputs = frozenset(
            node.input[i] for node, pairs in zip(kept_nodes, self.must_alias) for _, i in pairs
        ) & {g.name for g in self.inputs}
        self._input_names = frozenset(g.name for g in self.inputs)
        #: Per graph input: (input, slot, dtype, rank or -1, ((axis, size) of each fixed dim), fed as given).
        self._input_checks = [
            (
                g,
                s,
                g.dtype,
                -1 if g.shape is None else len(g.shape),
                () if g.shape is None else tuple((a, d) for a, d in enumerate(g.shape) if isinstance(d, int) and d > 0),
                g.name in self.aliased_inputs,
            )
            for g, s in zip(self.inputs, self.input_slots)
        ]
        if self.scope is not None:
            self._check_nested_writes(kept_nodes)
        self._plan_lifetimes(kept_nodes, set(constants))
        self._steps = [
            (k.run, tuple(none_slot if s < 0 else s for s in i), tuple(sink_slot if s < 0 else s for s in o))
            for k, i, o in zip(kernels, in_idx, out_idx)
        ]
        # Only non-persistent node outputs ever hold a run buffer (see buffers.slot_allocator).
        owners = {x for o in out_idx for x in o if x >= 0 and not self.persistent[x]}
        #: Per node, what the run loop does after it: (MUST_ALIAS pairs to check, slots to clear, slots whose
        #: storage class ends there and may hold a run buffer).
        self._after = [
            (pairs, release + ((sink_slot,) if -1 in o else ()), tuple(x for x in frees if x in owners))
            for pairs, release, frees, o in zip(self.must_alias, self.release, self.frees, out_idx)
        ]

    # -- build helpers -------------------------------------------------
    def _subplan(self, graph: onnx.GraphProto, where: str) -> Plan:
        """A plan of its own for a subgraph of a node being built, in this plan's scope (BuildContext.subplan).

        An error building it is raised as the same onnxkv error prefixed by ``where`` (the node and attribute).
        """
        overridable = {g.name for g in self.inputs if g.has_default}
        model, external, scope = subgraph_model(graph, self.opsets, self.build_context.constants, overridable, where)
        try:
            return Plan(
                model,
                self.allocator,
                fuse=self._fuse,
                external=external,
                fold_shapes=self._fold_shapes,
                keep_buffers=self.keep_buffers,
                scope=scope,
            )
        except OnnxkvError as e:
            raise type(e)(f"{where}: {e}") from e

    def _check_nested_writes(self, nodes: list[onnx.NodeProto]) -> None:
        """A subgraph's plan writes no value from outside the subgraph (its inputs and scope) in place."""
        outer = self._input_names | set(self.scope)
        for node, pairs in zip(nodes, self.must_alias):
            for _, i in pairs:
                if node.input[i] in outer:
                    raise ModelError(
                        f"{node_label(node)} writes '{node.input[i]}' in place (MUST_ALIAS) inside a "
                        "subgraph, but that value comes from outside it; onnxkv never writes values "
                        "of an enclosing scope from inside control flow"
                    )

    def _drop_absorbed(self, constants: dict) -> None:
        """Forget constants every reader captured at build time (``Op.absorbed_inputs``): kept as None."""
        absorbed: dict[str, bool] = {}
        for node, kernel in zip(self.nodes, self.kernels):
            for pos, x in enumerate([*node.input, *kernel.captures]):
                if x in constants:
                    absorbed[x] = absorbed.get(x, True) and pos in kernel.absorbed_inputs
        for name, all_readers in absorbed.items():
            if all_readers and name not in self.output_names:
                constants[name] = None

    def _written_in_place(self, nodes: list[onnx.NodeProto]) -> set[str]:
        """Values some node writes in place: MUST_ALIAS inputs (contract or kernel class) and bound pasts."""
        written = {b.past for b in self.bindings}
        for node in nodes:
            dom = DOMAIN_ALIASES.get(node.domain, node.domain)
            positions = {a.input_index for a in get_output_alias(node)}
            positions.update(
                i for _, i in getattr(lookup(dom, node.op_type, self.opsets.get(dom, 0)), "must_alias", ())
            )
            written.update(node.input[i] for i in positions if i < len(node.input) and node.input[i])
        return written

    def _make_kernel(self, node: onnx.NodeProto) -> Op:
        """The node's kernel object; a kernel class failing on the node's attributes is a ModelError naming it."""
        dom = DOMAIN_ALIASES.get(node.domain, node.domain)
        cls = lookup(dom, node.op_type, self.opsets.get(dom, 0))
        try:
            return (FallbackOp if cls is None else cls)(node, self.build_context)
        except OnnxkvError:
            raise
        except Exception as e:
            names = sorted(a.name for a in node.attribute)
            raise ModelError(
                f"{node_label(node)} cannot be built from its attributes {names}: {type(e).__name__}: {e}"
            ) from e

    @staticmethod
    def _aliases(node: onnx.NodeProto, kernel: Op, constants: dict) -> tuple[tuple[int, int], ...]:
        """(output, input) positions declared MUST_ALIAS by the contract or the kernel class."""
        pairs = {(a.output_index, a.input_index) for a in get_output_alias(node)}
        pairs.update(getattr(kernel, "must_alias", ()))
        for o, i in pairs:
            if i >= len(node.input) or o >= len(node.output):
                raise ModelError(
                    f"{node.op_type} node '{node.name}': MUST_ALIAS ({o} <- {i}) names a missing input or output"
                )
            if node.input[i] in constants:
                raise ModelError(
                    f"{node.op_type} node '{node.name}': MUST_ALIAS input '{node.input[i]}' is an "
                    "initializer; aliased storage must be writable"
                )
        return tuple(sorted(pairs))

    def _check_aliases(self, k: int, inputs: list, results) -> None:
        node = self.nodes[k]
        for o, i in self.must_alias[k]:
            a, b = results[o], inputs[i]
            if (
                a is None
                or b is None
                or a.shape != b.shape
                or a.__array_interface__["data"][0] != b.__array_interface__["data"][0]
            ):
                raise OperatorError(
                    f"{node.op_type} node '{node.name}': output '{node.output[o]}' must alias input "
                    f"'{node.input[i]}' (MUST_ALIAS) but the kernel returned other storage"
                )

    def _plan_lifetimes(self, nodes: list[onnx.NodeProto], constant_names: set[str]) -> None:
        pinned = set(self.output_slots) | set(self.nested_slots) | {self.slot_of[c] for c in constant_names}
        self.persistent, self.release, self.frees = plan_lifetimes(
            nodes, self.kernels, self.in_idx, self.out_idx, self.must_alias, self.slot_of, self.n_slots, pinned
        )

    # -- running -------------------------------------------------------
    def bind_inputs(self, feeds: Mapping[str, np.ndarray], views: Mapping | None = None) -> list:
        """Validate ``feeds`` against the graph inputs; return the initial slot list (:func:`.inputs.bind`)."""
        return bind(self, feeds, views)

    def needed(self, out_slots: tuple) -> list[bool] | None:
        """Per node, whether a run asked for the outputs in slots ``out_slots`` must run it: it computes
        one of them, a present (cache) output, or a value another needed node reads, or it writes an input
        in place; None when every node is needed.  Nodes that only feed outputs nobody asked for (the
        logits of a prompt chunk whose caller wants only its cache) are skipped.  Cached per request."""
        hit = self._needed.get(out_slots, False)
        if hit is not False:
            return hit
        result = needed_nodes(self, out_slots)
        if len(self._needed) < 16:  # a few output sets per plan (all, logits, nothing)
            self._needed[out_slots] = result
        return result

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: list[str] | None = None,
        events: EventLog | None = None,
        step: int = 0,
        caches: dict | None = None,
        cache_allocator=None,
        cancel=None,
        logits_at: tuple[str, np.ndarray, int] | None = None,
        on_python=None,
    ) -> dict[str, np.ndarray]:
        """Run every node once and return the requested graph outputs (all by default).

        ``caches`` (past input name -> CacheTensor) makes bound nodes write in
        place; their past feeds are the caches' zero-copy views.  Staged cache
        lengths are committed or discarded by the caller (the state).
        ``cancel`` (an object with a ``cancelled`` flag) is checked between nodes.  A run asked for some
        outputs skips the nodes none of them, no cache output and no in-place write needs (:meth:`needed`;
        such a run takes the node loop, not a compiled step).  ``logits_at`` (an output's name, [B] positions
        in [0, S) and S, the tokens fed; checked by the caller): that output, when it is [B, S, V], is
        [B, 1, V], its rows at those positions, computed for them alone where the graph allows
        (:mod:`.logit_rows`).  ``on_python`` (a callable, or None) is called once, before the first node that
        runs in Python and may call BLAS (not at all when a compiled step replays the others:
        :attr:`RunContext.on_python`).
        """
        needed = None
        if output_names is None:
            out_slots = self.output_slots
            output_names = self.output_names
        else:
            out_slots = []
            for name in output_names:
                if name not in self.output_names:
                    raise InputError(
                        f"Session.run: unknown output '{name}'; outputs are: {', '.join(self.output_names)}"
                    )
                out_slots.append(self.slot_of[name])
            needed = self.needed(tuple(out_slots))
        slots = self.bind_inputs(feeds, caches)
        bufs = self._take_buffers()
        recording = events is not None and events.enabled
        rt = RunContext(bufs.plan_alloc, recording, step, caches, cache_allocator, cancel, on_python)
        compiled, taken = None, False
        head = None if logits_at is None else self.logit_head(logits_at[0])
        rows = None if head is None else (head, logits_at[1])
        try:
            if recording:
                taken = run_recording(self, slots, bufs, rt, events, step, cache_allocator, cancel, needed, rows)
            elif self.steps is not None and needed is None and logits_at is None and not segmented(caches):
                compiled = self.steps.run(self, slots, bufs, rt, cancel)
            else:
                taken = run_plain(self, slots, bufs, rt, cancel, needed, rows)
        except BaseException:
            try:
                rt.finish(False)
            finally:
                bufs.close()
            raise
        try:
            rt.finish(True)
        except BaseException:
            bufs.close()
            if compiled is not None:
                self.steps.done(compiled)
            raise
        outputs = {name: slots[s] for name, s in zip(output_names, out_slots)}
        if logits_at is not None and not taken and logits_at[0] in outputs:
            outputs[logits_at[0]] = rows_of_output(outputs[logits_at[0]], logits_at[1], logits_at[2])
        if compiled is not None:
            for name, s in zip(output_names, out_slots):
                if s in compiled.owned_outputs:
                    outputs[name] = outputs[name].copy()  # the step's memory: the next replay rewrites it
            self.steps.done(compiled)
        self._end_buffers(bufs, outputs.values())
        return outputs

    def logit_head(self, logits: str) -> LogitHead | None:
        """Where runs given ``logits_at`` for the output ``logits`` take rows (:func:`.logit_rows.find_head`)."""
        if logits not in self._heads:
            self._heads[logits] = find_head(self, logits)
        return self._heads[logits]

    def run_nested(self, values: Sequence, rt: RunContext) -> list:
        """Run this plan of a subgraph inside the node ``rt`` is running; return the graph outputs in order.

        ``values`` holds one array per graph input, then one per :attr:`scope`
        name, unchecked (the calling kernel validates what it feeds; arrays
        must be C-contiguous).  The nodes run with ``rt.nested``: cancellation
        is checked between them, and deferred rollbacks, storage counters and
        cache events belong to the enclosing run.  Temporaries come from this
        plan's allocator and are returned (or kept, see ``keep_buffers``) when
        the call ends; outputs never live in them.

        Raises:
            OperatorError naming the node that failed, or the onnxkv error a node raised.
        """
        slots = self._template.copy()
        for s, v in zip(self.nested_slots, values):
            slots[s] = v
        bufs = self._take_buffers()
        try:
            run_plain(self, slots, bufs, rt.nested(bufs.plan_alloc), rt.cancel)
        except BaseException:
            bufs.close()
            raise
        outputs = [slots[s] for s in self.output_slots]
        self._end_buffers(bufs, outputs)
        return outputs

    def _take_buffers(self) -> RunBuffers:
        """The buffers of a run starting: kept ones from an earlier run, else new ones."""
        try:
            return self._idle_buffers.pop()
        except IndexError:
            bufs = RunBuffers(self.allocator)
            bufs.plan_alloc = slot_allocator(bufs, self.persistent, self.out_idx)
            return bufs

    def _end_buffers(self, bufs: RunBuffers, outputs: Iterable[np.ndarray]) -> None:
        """End a successful run's buffers: keep them for the next run (``keep_buffers``) or return them."""
        if self.keep_buffers:
            bufs.recycle(outputs)
            self._idle_buffers.append(bufs)
        else:
            bufs.close()


def _read_nodes(nodes: list[onnx.NodeProto], protected: set[str]) -> list[int]:
    """Indices of ``nodes`` (topologically ordered) some graph output depends on: a node whose outputs
    neither a later such node reads (inputs or subgraph captures) nor ``protected`` names goes.  ONNX nodes
    have no effects beyond their outputs, so no result changes; a run asked for every output then needs
    every node, which is what a compiled step replays (:meth:`Plan.needed`)."""
    read = set(protected)
    alive = []
    for k in range(len(nodes) - 1, -1, -1):
        if any(o and o in read for o in nodes[k].output):
            alive.append(k)
            read.update(x for x in node_reads(nodes[k]) if x)
    return alive[::-1]
