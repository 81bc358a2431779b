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
from onnx import helper

from onnxkv.model.contract import Access, OutputAlias, set_access, set_output_alias, set_persistent_bindings

from ._graph import INT32, GraphBuilder

__all__ = ["PagedConfig", "PagedLayerWeights", "paged_weights", "build_paged_model"]


@dataclass(frozen=True)
class PagedConfig:
    """Sizes and attention attributes of :func:`build_paged_model`.

    ``max_tokens`` defaults to ``max_blocks * block_size``; ``dtype`` is
    ``"float32"`` or ``"float16"`` (weights, activations and pages).
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

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_size", "num_layers", "num_pages",
                     "block_size", "max_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PagedConfig: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"PagedConfig: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if not 0 < self.capacity <= self.max_blocks * self.block_size:
            raise ValueError(f"PagedConfig: max_tokens={self.max_tokens} must be in "
                             f"[1, max_blocks * block_size = {self.max_blocks * self.block_size}]")
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"PagedConfig: dtype must be 'float32' or 'float16', got {self.dtype!r}")

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

    return tuple(PagedLayerWeights(matrix(cfg.hidden_size, q_size), matrix(cfg.hidden_size, kv_size),
                                   matrix(cfg.hidden_size, kv_size), matrix(q_size, cfg.hidden_size))
                 for _ in range(cfg.num_layers))


def build_paged_model(cfg: PagedConfig, weights: tuple[PagedLayerWeights, ...] | None = None,
                      seed: int = 0) -> onnx.ModelProto:
    """Build the graph described in the module docstring (weights default to ``paged_weights(cfg, seed)``)."""
    layers = weights if weights is not None else paged_weights(cfg, seed)
    if len(layers) != cfg.num_layers:
        raise ValueError(f"build_paged_model: {len(layers)} layer weights for num_layers={cfg.num_layers}")
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(cfg.dtype))
    g = GraphBuilder("paged_decoder")
    x = g.input("hidden", elem, ["batch", "seq", cfg.hidden_size])
    table = g.input("block_table", INT32, ["batch", cfg.max_blocks])
    seqlens = g.input("seqlens_k", INT32, ["batch"])
    for i, w in enumerate(layers):
        past = g.input(f"past.{i}", elem, cfg.past_shape)
        base = f"/model/layers.{i}/attn"
        q, k, v = (g.node("MatMul", [x, g.initializer(f"layers.{i}.{name}.weight", getattr(w, name))],
                          f"{base}/{name}/MatMul") for name in ("q_proj", "k_proj", "v_proj"))
        y = g.node("PagedAttention", [q, k, v, past, table, seqlens], f"{base}/PagedAttention",
                   outputs=[f"{base}/PagedAttention/output_0", f"present.{i}"], domain="ai.rt",
                   num_heads=cfg.num_heads, kv_num_heads=cfg.num_kv_heads, block_size=cfg.block_size,
                   max_tokens=cfg.capacity, is_causal=cfg.is_causal, left_window_size=cfg.left_window_size,
                   scale=float(1.0 / np.sqrt(cfg.head_size)), softcap=float(cfg.softcap))[0]
        set_output_alias(g.nodes[-1], [OutputAlias(1, 3)])
        o = g.node("MatMul", [y, g.initializer(f"layers.{i}.o_proj.weight", w.o_proj)], f"{base}/o_proj/MatMul")
        x = g.node("Add", [x, o], f"/model/layers.{i}/residual/Add",
                   outputs=["output"] if i == cfg.num_layers - 1 else 1)
    g.output("output", elem, ["batch", "seq", cfg.hidden_size])
    for i in range(cfg.num_layers):
        g.output(f"present.{i}", elem, cfg.past_shape)
    model = g.model({"": 21, "ai.rt": 1})
    for value_info in model.graph.input:
        if value_info.name.startswith("past."):
            set_access(value_info, Access.READ_WRITE)
    set_persistent_bindings(model.graph, {f"past.{i}": f"present.{i}" for i in range(cfg.num_layers)})
    return model
