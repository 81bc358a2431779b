"""A small attention-only decoder over an explicitly stated paged KV cache (``ai.rt::PagedAttention``).

Graph inputs / outputs (``T`` = float32 or float16, ``L`` = layers)::

    hidden       T     [batch, seq, hidden_size]
    block_table  int32 [batch, max_blocks]   logical block -> page, shared by every layer
    seqlens_k    int32 [batch]               tokens already cached per row
    past.{i}     T     [num_pages, 2, num_kv_heads, block_size, head_size]   i < L, READ_WRITE
    output       T     [batch, seq, hidden_size]
    present.{i}  T     same as past.{i}

Layer ``i``: ``q, k, v = x @ Wq, x @ Wk, x @ Wv``;
``y, present.{i} = PagedAttention(q, k, v, past.{i}, block_table, seqlens_k)``;
``x = x + y @ Wo``.  The output is the last ``x``.

With ``key_format`` and/or ``value_format`` (an integer page format, e.g.
``"int8"``) each layer first runs ``c.{i} = QuantizePagedCache(past.{i},
quantize_blocks, key_scale.{i}, key_zero_point.{i}, value_scale.{i},
value_zero_point.{i})`` and attention reads ``c.{i}`` (the same pages).  These
inputs have empty defaults, so a step that feeds none of them converts
nothing; a step that feeds them converts those pages (of every layer) before
the step's attention reads them::

    quantize_blocks       int32 [N]            distinct page ids (full pages: no later token goes there)
    key_scale.{i}         float32 [N, kv_heads] or, with key_channel_scales or key_channel_zero_points,
                          [N, kv_heads, head_size] (key_channel_zero_points: equal within each head)
    key_zero_point.{i}    key_format's type, the shape of key_scale.{i}
    value_scale.{i}       float32 [N, kv_heads]
    value_zero_point.{i}  value_format's type, the shape of value_scale.{i}

A plane without a format has no inputs: its zero point is a constant empty
marker of the cache's own type, which leaves its pages as they are.

The contract makes the cache persistent and in place: each PagedAttention
node declares ``present.{i}`` ``MUST_ALIAS`` of ``past.{i}``, ``past.{i}`` is
``READ_WRITE`` and ``GraphProto.persistent_bindings`` binds ``past.{i} <-
present.{i}``, so ``Session.new_state()`` holds the pages (zeros at first) and
every ``State.run`` writes the new tokens into them.  The caller owns the
block tables and the per-row lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxkv.model.contract import Access, OutputAlias, set_access, set_output_alias, set_persistent_bindings

from ._graph import INT32, GraphBuilder

__all__ = ["PagedConfig", "PagedLayerWeights", "paged_weights", "build_paged_model"]

#: Integer page formats a model may quantize to: name -> (ONNX element type, bits).
_QUANTIZED = {
    "int8": (TensorProto.INT8, 8),
    "uint8": (TensorProto.UINT8, 8),
    "int4": (TensorProto.INT4, 4),
    "uint4": (TensorProto.UINT4, 4),
    "int2": (TensorProto.INT2, 2),
    "uint2": (TensorProto.UINT2, 2),
}


@dataclass(frozen=True)
class PagedConfig:
    """Sizes and attention attributes of :func:`build_paged_model`.

    ``max_tokens`` defaults to ``max_blocks * block_size``; ``dtype`` is
    ``"float32"`` or ``"float16"`` (weights, activations and pages).
    ``key_format`` / ``value_format``: None, or an integer page format
    ("int8", "uint8", "int4", "uint4", "int2", "uint2") that the model's
    ``QuantizePagedCache`` nodes convert fed pages to (see the module
    docstring); ``key_channel_scales`` gives keys one scale per channel;
    ``key_channel_zero_points`` gives keys one scale per head and one zero
    point per channel (channel-zp pages: the nodes' ``key_channel_zero_points``
    attribute).  At most one of the two.
    """

    hidden_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 8
    num_layers: int = 1
    num_pages: int = 32
    block_size: int = 4
    max_blocks: int = 8
    max_tokens: int | None = None
    left_window_size: int = -1
    softcap: float = 0.0
    is_causal: int = 1
    dtype: str = "float32"
    key_format: str | None = None
    value_format: str | None = None
    key_channel_scales: bool = False
    key_channel_zero_points: bool = False

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_size",
            "num_layers",
            "num_pages",
            "block_size",
            "max_blocks",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PagedConfig: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"PagedConfig: num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not 0 < self.capacity <= self.max_blocks * self.block_size:
            raise ValueError(
                f"PagedConfig: max_tokens={self.max_tokens} must be in "
                f"[1, max_blocks * block_size = {self.max_blocks * self.block_size}]"
            )
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"PagedConfig: dtype must be 'float32' or 'float16', got {self.dtype!r}")
        for name in ("key_format", "value_format"):
            value = getattr(self, name)
            if value is not None and value not in _QUANTIZED:
                raise ValueError(f"PagedConfig: {name} must be None or one of {sorted(_QUANTIZED)}, got {value!r}")
            if value is not None and self.head_size * _QUANTIZED[value][1] % 8:
                raise ValueError(
                    f"PagedConfig: {name}={value!r} needs head_size * bits to be a multiple of 8, "
                    f"head_size is {self.head_size}"
                )
        for name in ("key_channel_scales", "key_channel_zero_points"):
            if getattr(self, name) and self.key_format is None:
                raise ValueError(f"PagedConfig: {name} needs a key_format")
        if self.key_channel_scales and self.key_channel_zero_points:
            raise ValueError("PagedConfig: key_channel_scales and key_channel_zero_points are mutually exclusive")

    @property
    def capacity(self) -> int:
        """Tokens per sequence (the ``max_tokens`` attribute)."""
        return self.max_blocks * self.block_size if self.max_tokens is None else self.max_tokens

    @property
    def past_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of every ``past.{i}``: [num_pages, 2, num_kv_heads, block_size, head_size]."""
        return (self.num_pages, 2, self.num_kv_heads, self.block_size, self.head_size)


@dataclass(frozen=True)
class PagedLayerWeights:
    """One layer's projections, ``y = x @ W`` layout, in the config's dtype."""

    q_proj: np.ndarray  # [hidden, num_heads * head_size]
    k_proj: np.ndarray  # [hidden, num_kv_heads * head_size]
    v_proj: np.ndarray  # [hidden, num_kv_heads * head_size]
    o_proj: np.ndarray  # [num_heads * head_size, hidden]


def paged_weights(cfg: PagedConfig, seed: int = 0) -> tuple[PagedLayerWeights, ...]:
    """Reproducible random projections with std ``1/sqrt(fan_in)``, one set per layer."""
    rng = np.random.default_rng(seed)
    q_size, kv_size = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size

    def matrix(fan_in: int, fan_out: int) -> np.ndarray:
        return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(cfg.dtype)

    return tuple(
        PagedLayerWeights(
            matrix(cfg.hidden_size, q_size),
            matrix(cfg.hidden_size, kv_size),
            matrix(cfg.hidden_size, kv_size),
            matrix(q_size, cfg.hidden_size),
        )
        for _ in range(cfg.num_layers)
    )


def build_paged_model(
    cfg: PagedConfig, weights: tuple[PagedLayerWeights, ...] | None = None, seed: int = 0
) -> onnx.ModelProto:
    """Build the graph described in the module docstring (weights default to ``paged_weights(cfg, seed)``)."""
    layers = weights if weights is not None else paged_weights(cfg, seed)
    if len(layers) != cfg.num_layers:
        raise ValueError(f"build_paged_model: {len(layers)} layer weights for num_layers={cfg.num_layers}")
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(cfg.dtype))
    g = GraphBuilder("paged_decoder")
    x = g.input("hidden", elem, ["batch", "seq", cfg.hidden_size])
    table = g.input("block_table", INT32, ["batch", cfg.max_blocks])
    seqlens = g.input("seqlens_k", INT32, ["batch"])
    quantize = cfg.key_format is not None or cfg.value_format is not None
    if quantize:
        blocks = _with_default(g, "quantize_blocks", INT32, ["quantize"])
    for i, w in enumerate(layers):
        past = g.input(f"past.{i}", elem, cfg.past_shape)
        base = f"/model/layers.{i}/attn"
        if quantize:
            per_channel = cfg.key_channel_scales or cfg.key_channel_zero_points
            params = [
                *_plane_inputs(g, cfg, "key", i, cfg.key_format, per_channel, elem),
                *_plane_inputs(g, cfg, "value", i, cfg.value_format, False, elem),
            ]
            attrs = {"key_channel_zero_points": 1} if cfg.key_channel_zero_points else {}
            past = g.node(
                "QuantizePagedCache",
                [past, blocks, *params],
                f"{base}/QuantizePagedCache",
                outputs=[f"c.{i}"],
                domain="ai.rt",
                **attrs,
            )
            set_output_alias(g.nodes[-1], [OutputAlias(0, 0)])
        q, k, v = (
            g.node("MatMul", [x, g.initializer(f"layers.{i}.{name}.weight", getattr(w, name))], f"{base}/{name}/MatMul")
            for name in ("q_proj", "k_proj", "v_proj")
        )
        y = g.node(
            "PagedAttention",
            [q, k, v, past, table, seqlens],
            f"{base}/PagedAttention",
            outputs=[f"{base}/PagedAttention/output_0", f"present.{i}"],
            domain="ai.rt",
            num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            block_size=cfg.block_size,
            max_tokens=cfg.capacity,
            is_causal=cfg.is_causal,
            left_window_size=cfg.left_window_size,
            scale=float(1.0 / np.sqrt(cfg.head_size)),
            softcap=float(cfg.softcap),
        )[0]
        set_output_alias(g.nodes[-1], [OutputAlias(1, 3)])
        o = g.node("MatMul", [y, g.initializer(f"layers.{i}.o_proj.weight", w.o_proj)], f"{base}/o_proj/MatMul")
        x = g.node(
            "Add", [x, o], f"/model/layers.{i}/residual/Add", outputs=["output"] if i == cfg.num_layers - 1 else 1
        )
    g.output("output", elem, ["batch", "seq", cfg.hidden_size])
    for i in range(cfg.num_layers):
        g.output(f"present.{i}", elem, cfg.past_shape)
    two_bit = {cfg.key_format, cfg.value_format} & {"int2", "uint2"}
    model = g.model({"": 21, "ai.rt": 1}, ir_version=13 if two_bit else 10)  # INT2/UINT2 came with IR 13
    for value_info in model.graph.input:
        if value_info.name.startswith("past."):
            set_access(value_info, Access.READ_WRITE)
    set_persistent_bindings(model.graph, {f"past.{i}": f"present.{i}" for i in range(cfg.num_layers)})
    return model


def _with_default(g: GraphBuilder, name: str, elem: int, shape: list) -> str:
    """A graph input whose default (an initializer of the same name) is empty along dim 0."""
    g.input(name, elem, shape)
    dims = [0 if isinstance(d, str) else d for d in shape]
    return g.initializer(name, np.zeros(dims, helper.tensor_dtype_to_np_dtype(elem)))


def _plane_inputs(
    g: GraphBuilder, cfg: PagedConfig, plane: str, layer: int, fmt: str | None, per_channel: bool, elem: int
) -> tuple[str, str]:
    """(scale, zero point) inputs of one plane of one layer's QuantizePagedCache (see the module docstring)."""
    if fmt is None:  # a constant empty marker of the cache's own type: the plane is left as it is
        return (
            g.initializer(f"{plane}_scale.{layer}", np.zeros(0, np.float32)),
            g.initializer(f"{plane}_zero_point.{layer}", np.zeros(0, helper.tensor_dtype_to_np_dtype(elem))),
        )
    shape = ["quantize", cfg.num_kv_heads] + ([cfg.head_size] if per_channel else [])
    return (
        _with_default(g, f"{plane}_scale.{layer}", TensorProto.FLOAT, shape),
        _with_default(g, f"{plane}_zero_point.{layer}", _QUANTIZED[fmt][0], shape),
    )
