"""The sliding window a ``genai_config.json`` states, applied to the graph's attention nodes.

The ONNX Runtime GenAI model builder may state a model's attention window
only in ``model.decoder.sliding_window`` of ``genai_config.json`` (a Mistral
folder: ``GroupQueryAttention`` nodes with ``local_window_size=-1``, the
window in the config).  Running such a graph with full attention returns
wrong tokens once a sequence passes the window, so :func:`apply_config_window`
writes the window into the nodes instead:

* ``window_size`` ``W`` (int >= 1) is the number of most recent keys each
  query sees, its own included (GroupQueryAttention's ``local_window_size``);
* ``layers``: the indices of the layers that have the window; absent or empty
  means every layer (the builder writes ``[]`` when the Hugging Face
  configuration names no layer types, as for Mistral, whose window applies to
  every layer);
* ``slide_key_value_cache`` / ``slide_inputs`` true ask the GenAI runtime to
  shift a fixed-size cache or to feed the prompt in window-sized pieces:
  onnxkv does neither, so such a model is refused.

A listed layer's node keeps a window it already has when it equals ``W``; a
different one, a listed layer that does not exist, or a cache convention
without GroupQueryAttention nodes (nothing onnxkv could put the window into)
is a :class:`~onnxkv.errors.ModelError`: a stated window is applied or the
model is refused, never silently dropped.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from onnxkv.errors import ModelError
from onnxkv.model.convention import CacheConvention

__all__ = ["apply_config_window"]

_INT_LIMIT = 1 << 31


def _window_section(cfg: dict, path: Path) -> dict | None:
    """``model.decoder.sliding_window`` checked for the keys onnxkv reads (None when absent or null)."""
    section = ((cfg.get("model") or {}).get("decoder") or {}).get("sliding_window")
    if section is None:
        return None
    where = f"load: {path}: model.decoder.sliding_window"
    if not isinstance(section, dict):
        raise ModelError(f"{where} must be a JSON object, got {section!r:.60}")
    w = section.get("window_size")
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w < _INT_LIMIT:
        raise ModelError(f"{where}.window_size must be an int in [1, {_INT_LIMIT}), got {w!r:.60}")
    layers = section.get("layers", [])
    if not isinstance(layers, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in layers):
        raise ModelError(f"{where}.layers must be a list of layer indices, got {layers!r:.60}")
    for key in ("slide_key_value_cache", "slide_inputs"):
        flag = section.get(key, False)
        if not isinstance(flag, bool):
            raise ModelError(f"{where}.{key} must be true or false, got {flag!r:.60}")
        if flag:
            raise ModelError(
                f"{where}.{key} is true: the model expects the GenAI runtime to "
                f"{'shift a window-sized KV cache' if key == 'slide_key_value_cache' else 'feed the prompt in window-sized pieces'}"
                f", which onnxkv does not do (window_size {w}); expected false"
            )
    return section


def apply_config_window(proto: onnx.ModelProto, conv: CacheConvention, cfg: dict, path: Path) -> bool:
    """Write the window of ``cfg`` (a checked genai_config) into ``proto``'s attention nodes.

    Returns True when a node changed (the caller then recognises the cache
    convention anew), False when the config states no window or every listed
    node already has it.

    Raises:
        ModelError: the section is malformed, asks for runtime sliding, lists a
            layer the graph does not have, conflicts with a node's own window,
            or the graph's cache convention has no GroupQueryAttention node to
            hold the window.
    """
    section = _window_section(cfg, path)
    if section is None:
        return False
    w = section["window_size"]
    where = f"load: {path}: model.decoder.sliding_window (window_size {w})"
    if conv.kind != "group_query_attention":
        raise ModelError(
            f"{where} cannot be applied: the graph's cache convention is '{conv.kind}', and onnxkv puts "
            "a configured window only into GroupQueryAttention nodes; expected a GroupQueryAttention "
            "graph"
        )
    by_index = {layer.index: layer for layer in conv.layers}
    wanted = section.get("layers") or sorted(by_index)
    missing = [i for i in wanted if i not in by_index]
    if missing:
        raise ModelError(
            f"{where} lists layers {missing} that the graph does not have; its layers are {sorted(by_index)}"
        )
    producers = {n.output[1]: n for n in proto.graph.node if n.op_type == "GroupQueryAttention" and len(n.output) > 1}
    changed = False
    for i in wanted:
        node = producers[by_index[i].present_key]
        attr = next((a for a in node.attribute if a.name == "local_window_size"), None)
        have = -1 if attr is None else helper.get_attribute_value(attr)
        if have == w:
            continue
        if not isinstance(have, int) or have > 0:
            raise ModelError(
                f"{where} conflicts with layer {i}'s GroupQueryAttention node '{node.name}', whose "
                f"local_window_size is {have!r:.40}; expected {w} or -1 (no window of its own)"
            )
        if attr is not None:
            node.attribute.remove(attr)
        node.attribute.append(helper.make_attribute("local_window_size", w))
        changed = True
    return changed
