"""``Session``: a loaded model, its plan, allocator, thread setting and event log."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import numpy as np
import onnx

from onnxkv._kernels import current_settings
from onnxkv._threads import ThreadControl
from onnxkv.alloc import as_allocator
from onnxkv.errors import InputError
from onnxkv.events import EventLog
from onnxkv.model import Model, load
from onnxkv.model.cache_casts import CastBoundary, lift_cache_casts
from onnxkv.model.checker import check_model
from onnxkv.model.contract import Contract
from onnxkv.model.rewrite import inplace_bindings
from onnxkv.plan.logit_rows import checked_positions
from onnxkv.plan.plan import Plan
from onnxkv.plan.weight_bytes import WeightBytes, weight_bytes
from onnxkv.runtime.cache_config import LEGACY_KEYWORDS, CacheConfig, cache_request
from onnxkv.runtime.prompt_chunk import prompt_chunk
from onnxkv.runtime.state import State

#: Operators whose every output token is computed from the same token of its inputs in the exporters'
#: GroupQueryAttention graphs (elementwise, norms, products, reshapes of a token, embeddings, the mask's
#: lengths), besides GroupQueryAttention itself: a model whose every node is one of them may run segments.
TOKEN_WISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Abs", "Exp", "Log", "Erf", "Tanh",
    "Sigmoid", "Relu", "Gelu", "FastGelu", "QuickGelu", "BiasGelu", "Softplus", "Clip", "Max", "Min", "Where",
    "Equal", "Cast", "CastLike", "Constant", "Identity", "Shape", "Reshape", "Transpose", "Split", "Squeeze",
    "Unsqueeze", "Softmax", "MatMul", "MatMulNBits", "MatMulBnb4", "Gather", "GatherBlockQuantized", "ReduceSum",
    "LayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
    "SkipLayerNormalization", "RMSNormalization", "RotaryEmbedding", "GroupQueryAttention",
})  # fmt: skip

__all__ = ["Session", "DECODE_ROWS", "check_precision"]

#: Runs feeding at most this many tokens keep BLAS single-threaded (see onnxkv._threads).
DECODE_ROWS = 16


def check_precision(api: str, precision: str | None) -> str | None:
    """``precision`` if it is None, ``"float32"``, or ``"bf16"`` where this process can run it; else InputError
    naming ``api`` and why."""
    if precision is None:
        return None
    try:
        current_settings().replace(prefill_precision=precision)
    except ValueError as e:
        raise InputError(f"{api}: prefill_precision={precision!r}: {str(e).split(': ', 1)[1]}") from None
    return precision


class Session:
    """A model ready to run, stateless like ``onnxruntime.InferenceSession``.

    Args:
        model: a path (``.onnx`` file or GenAI folder), a :class:`Model` or a ModelProto.
        threads: threads for the OpenMP kernels *and* the BLAS under NumPy
            (one setting, applied around every run of this session only: the
            kernel settings of the calling Python thread, whose other settings
            -- SIMD level, AMX: ``onnxkv.kernels.use_settings`` -- the run
            keeps); None = the cores this process may use.  The BLAS limit is
            process-wide (see ``onnxkv._threads``); results never depend on it.
        allocator: an :class:`onnxkv.alloc.Allocator` for the plan's temporaries,
            all returned to it at the end of each run (None = the session's own
            :class:`~onnxkv.alloc.SystemAllocator`; the plan then keeps a run's
            temporaries for the next run, so repeated decode steps allocate
            nothing -- see :mod:`onnxkv.plan.buffers`).
        events: record an :class:`~onnxkv.events.EventLog` (``session.events``).
        compiled_steps: with the session's own allocator, a run that repeats the
            shapes of the run before it (a decode step) replays the recorded kernel
            calls of its compilable nodes instead of running them through Python,
            bit for bit the same (see :mod:`onnxkv.plan.compiled_step`); False runs
            every node through Python.
        prefill_precision: ``"bf16"`` runs the products of packed weights with at
            least ``BF16_MIN_ROWS`` (32) rows and the tiled attention of calls of at
            least 32 query tokens -- prompt chunks, not decode steps or speculative
            verifications -- on bfloat16-rounded operands with float32 sums
            (AVX-512-BF16; caches and decode stay float32; the fidelity is measured
            in ``docs/sessions.md``); ``"float32"`` keeps them float32; None
            (default) keeps the calling thread's kernel setting
            (``KernelSettings.prefill_precision``, float32 unless changed).
            ``"bf16"`` raises InputError where the CPU has no AVX-512-BF16.

    The plan is built once here.  ``run`` may be called any number of times;
    each call is independent.  One session must not run from two threads at once.
    """

    def __init__(
        self,
        model: str | os.PathLike | Model | onnx.ModelProto,
        threads: int | None = None,
        allocator=None,
        events: bool = False,
        compiled_steps: bool = True,
        prefill_precision: str | None = None,
    ) -> None:
        self.model = model if isinstance(model, Model) else load(model)
        self.allocator = as_allocator(allocator)
        self.events = EventLog(enabled=bool(events))
        self._threads = ThreadControl(threads, check_precision("Session", prefill_precision))
        conv = self.model.convention
        contract = Contract.from_model(self.model.proto)
        if contract.output_aliases or contract.access or contract.alias_of or contract.persistent_bindings:
            check_model(self.model.proto)
        #: Persistent bindings declared by the model's contract (input <- output).
        self.declared_bindings = dict(contract.persistent_bindings)
        #: Past/present pairs that a state runs in place (empty: tensor path only).
        self.bindings = [] if self.declared_bindings else inplace_bindings(self.model.proto, conv)
        #: The conversions of a float16 model's cache Casts, moved to the session's boundary so its pairs run
        #: in place (:mod:`onnxkv.model.cache_casts`; the plan then holds those values as float16), or None.
        self.cast_boundary: CastBoundary | None = None
        graph = self.model.proto
        if not self.declared_bindings and not self.bindings:
            lifted = lift_cache_casts(graph, conv)
            bindings = inplace_bindings(lifted[0], conv) if lifted is not None else []
            if bindings:
                (graph, self.cast_boundary), self.bindings = lifted, bindings
        #: The model the plan runs: the file's graph (``model.proto``), or its copy whose cache Casts moved to
        #: the boundary (:attr:`cast_boundary`).  Read only.
        self.planned = graph
        # With its own allocator the plan keeps a run's temporaries for the next run (a decode step then
        # allocates nothing); a caller's allocator gets every temporary back at the end of each run.
        self.plan = Plan(
            graph,
            self.allocator,
            present_outputs=conv.present_outputs,
            past_inputs=conv.past_inputs,
            bindings=self.bindings,
            external=self.model.external,
            keep_buffers=allocator is None,
            compile_steps=compiled_steps,
        )
        self._step = 0
        self._segments: bool | None = None  # takes_segments, found at its first use
        #: Token ids fed as ``input_ids`` must lie in ``[0, token_limit)`` (None: not checked), see Model.token_limit.
        self.token_limit = self.model.token_limit
        #: Tables the graph indexes by position and their rows (Model.position_tables; with the model's
        #: max_length they bound prompt + new tokens, :func:`onnxkv.generate.arguments.check_length`).
        self.position_tables = self.model.position_tables

    @property
    def threads(self) -> int:
        return self._threads.threads

    @property
    def input_names(self) -> list[str]:
        return [g.name for g in self.plan.inputs]

    @property
    def output_names(self) -> list[str]:
        return list(self.plan.output_names)

    @property
    def takes_segments(self) -> bool:
        """Whether a state of this session may run segments (:meth:`State.run
        <onnxkv.runtime.state.State.run>`): a GroupQueryAttention or ONNX Attention graph whose every such
        node is bound to the state's cache and takes them (GroupQueryAttention: no attention_bias,
        head_sink or smooth_softmax; Attention: no qk_matmul_output or nonpad_kv_seqlen, a float32
        softmax), and every other node is of an operator that acts on each token alone
        (:data:`TOKEN_WISE`; control flow, other attention, convolutions, ``Range``, ``Slice``, ``Concat``
        and every operator not listed refuse them) or builds Attention masks only (their values reach
        nothing else; the Attention nodes take only the mask of causal attention over the run's tokens,
        :mod:`onnxkv.plan.ops._attention_segments`), so the rows' tokens may share one axis."""
        if self._segments is None:
            from onnxkv.plan.ops._attention_segments import mask_only_nodes
            from onnxkv.plan.ops.attention_gqa import GroupQueryAttention
            from onnxkv.plan.ops.attention_onnx import Attention23

            kinds = {"group_query_attention": GroupQueryAttention, "attention": Attention23}
            kind = kinds.get(self.model.convention.kind)
            attention = [k for k in self.plan.kernels if kind is not None and isinstance(k, kind)]
            graph = self.model.proto.graph
            masks = mask_only_nodes(graph) if kind is Attention23 else set()
            self._segments = (
                bool(self.bindings)
                and bool(attention)
                and all(k.takes_segments for k in attention)
                and all(
                    n.op_type in TOKEN_WISE
                    or (kind is Attention23 and n.op_type == "Attention" and n.domain in ("", "ai.onnx"))
                    or i in masks
                    for i, n in enumerate(graph.node)
                )
            )
        return self._segments

    @property
    def fallback_nodes(self) -> list[str]:
        """Names of nodes run by ``onnx.reference`` fallbacks."""
        return list(self.plan.fallback_nodes)

    def weight_bytes(self) -> WeightBytes:
        """Where the model's weights live: bytes the kernels hold in their own layouts, constants read
        from file mappings (page cache) and constants held in memory (:mod:`onnxkv.plan.weight_bytes`)."""
        return weight_bytes(self.plan)

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: list[str] | None = None, logits_at=None
    ) -> dict[str, np.ndarray]:
        """Run the model on ``feeds`` (input name -> array) and return the outputs by name.

        ``logits_at`` (one integer position per batch row, each in ``[0, S)`` for token ids fed as
        [B, S]): a logits output of [B, S, V] is then [B, 1, V], row b the logits at position
        ``logits_at[b]``, and the LM head computes those rows alone where the graph allows
        (:mod:`onnxkv.plan.logit_rows`); a logits output of another shape is returned as computed.
        ``logits_at`` [B, K] (K >= 1 positions per row) makes [B, K, V].

        A float16 model whose caches the session holds as float16 (:attr:`cast_boundary`) keeps its
        declared types here: float32 pasts are rounded to float16 as the graph's Casts round them, presents
        come back float32.

        Raises:
            InputError: unknown/missing inputs, wrong dtype or shape, token ids
                of ``input_ids`` outside ``[0, token_limit)``, ``logits_at`` not as above.
            OperatorError: a node failed (the message names it).
        """
        boundary = self.cast_boundary
        if boundary is None:
            return self._run_plan(feeds, output_names, logits_at=logits_at)
        out = self._run_plan(boundary.graph_feeds(feeds, "Session.run"), output_names, logits_at=logits_at)
        return boundary.model_outputs(out)

    def _check_token_ids(self, ids, api: str = "Session.run") -> None:
        """InputError (naming ``api``) unless every entry of the ``input_ids`` feed lies in ``[0, token_limit)``.

        O(ids): a decode step's few ids are compared as Python ints; a longer
        feed takes one reduction (a signed array viewed as unsigned, so a
        negative id compares above the limit; the embedding Gather would wrap it).
        """
        limit = self.token_limit
        if limit is None or not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu" or not ids.size:
            return
        if ids.size <= DECODE_ROWS:
            values = ids.ravel().tolist()
            bad = min(values) < 0 or max(values) >= limit
        elif ids.dtype.kind == "u":
            bad = ids.max() >= limit
        elif limit > np.iinfo(ids.dtype).max:  # every non-negative id of this width is below the limit
            bad = ids.min() < 0
        else:
            bad = ids.view(ids.dtype.str.replace("i", "u")).max() >= limit
        if bad:
            raise InputError(
                f"{api}: input '{self.model.io.input_ids}' holds token ids from {ids.min()} to "
                f"{ids.max()}; expected ids in [0, {limit}) (the model's vocabulary)"
            )

    def decode_loop(self, tokens: int = 1):
        """A context manager around a generation loop whose runs feed ``tokens`` ids each (at
        most): when those runs are decode-sized (``tokens`` ≤ ``DECODE_ROWS``), the thread
        limits they need are set once for the loop instead of per run
        (:meth:`onnxkv._threads.ThreadControl.decode_loop`); otherwise it does nothing.
        Results never depend on it."""
        return self._threads.decode_loop() if tokens <= DECODE_ROWS else contextlib.nullcontext()

    @property
    def prefill_precision(self) -> str | None:
        """The ``prefill_precision`` of this session's runs (None: the calling thread's kernel setting)."""
        return self._threads.precision

    @contextlib.contextmanager
    def precision(self, prefill_precision: str | None):
        """A context manager: runs inside take ``prefill_precision`` (checked as the constructor's; None:
        the session's own); the session's setting is back afterwards (``generate(prefill_precision=...)``)."""
        checked = check_precision("Session.precision", prefill_precision)
        saved = self._threads.precision
        if checked is not None:
            self._threads.precision = checked
        try:
            yield self
        finally:
            self._threads.precision = saved

    def _run_plan(self, feeds, output_names, caches=None, cache_allocator=None, cancel=None, logits_at=None) -> dict:
        io = self.model.io
        ids = feeds.get(io.input_ids) if io.input_ids else None
        if ids is not None and not isinstance(ids, np.ndarray):
            ids = np.asarray(ids)
        self._check_token_ids(ids)
        if logits_at is not None:
            if not io.logits:
                raise InputError("Session.run: logits_at was given, but the model has no logits output")
            logits_at = (io.logits, *checked_positions(logits_at, ids, "Session.run"))
        step = self._step
        self._step += 1
        decode = ids is not None and ids.size <= DECODE_ROWS
        with self._threads(1 if decode else None, lazy_blas=True) as run:
            events = self.events if self.events.enabled else None
            return self.plan.run(
                feeds, output_names, events, step, caches, cache_allocator, cancel, logits_at, run.python_nodes
            )

    def prompt_chunk(self, cache: CacheConfig | str | None = None) -> int:
        """Tokens per chunk in which ``generate`` feeds a long single prompt on a state of ``cache`` (a
        :class:`~onnxkv.CacheConfig` or its kind; None: contiguous): chosen from the widest input of the
        model's products and, for a paged cache, its page size (:mod:`onnxkv.runtime.prompt_chunk`)."""
        keywords = cache_request("Session.prompt_chunk", cache, ("contiguous", "paged")).state_keywords("contiguous")
        return prompt_chunk(self.plan.kernels, keywords.get("block_size") if keywords["cache"] == "paged" else None)

    def new_state(
        self,
        initial: Mapping[str, np.ndarray] | None = None,
        *,
        cache: CacheConfig | str | None = None,
        allocator=None,
        **deprecated,
    ) -> State:
        """A persistent per-request :class:`~onnxkv.runtime.state.State` (see there).

        Args:
            initial: optional past input name -> array [B, H, L, D] to start from (copied in).
            cache: a :class:`~onnxkv.runtime.cache_config.CacheConfig`, the kind
                ``"contiguous"`` or ``"paged"`` (every other field at its default), or
                None (contiguous).  Kind ``"tensor"`` has no state and is rejected.
            allocator: persistent allocator of the caches.  None: a paged state's
                pages come from a new :class:`~onnxkv.alloc.SlabAllocator` (huge-page
                backed chunks, one lane per plane), a contiguous state's caches from a
                new :class:`~onnxkv.alloc.SystemAllocator`.
            deprecated: the keywords a CacheConfig replaces (``capacity``,
                ``initial_capacity``, ``cache_dtype``, ``block_size``, ``max_pages``,
                ``kv_format``, ``key_channel_scales``, ``key_channel_zero_points``)
                still work for one release, with a ``DeprecationWarning``; they
                cannot be combined with a CacheConfig.

        Raises:
            InputError: a bad ``cache`` (or deprecated keyword), or a cache the
                model cannot keep (see :class:`~onnxkv.runtime.state.State`).
            TypeError: an unknown keyword.
        """
        unknown = sorted(set(deprecated) - set(LEGACY_KEYWORDS))
        if unknown:
            raise TypeError(f"Session.new_state() got an unexpected keyword argument {unknown[0]!r}")
        request = cache_request("Session.new_state", cache, ("contiguous", "paged"), deprecated)
        return State(self, initial=initial, allocator=allocator, **request.state_keywords("contiguous"))

    def __repr__(self) -> str:
        src = self.model.path or "<in-memory model>"
        return (
            f"Session({src}, nodes={len(self.plan.nodes)}, threads={self.threads}, {self.model.convention.describe()})"
        )
