"""The graph inputs of a run: each feed checked against its input (name, dtype, rank, fixed dims) and
bound to its slot, C-contiguous (a strided feed is copied; one whose copy cannot be allocated raises
:class:`~onnxkv.errors.OutOfMemory`, never NumPy's MemoryError)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from onnxkv.errors import InputError, OutOfMemory

if TYPE_CHECKING:
    from onnxkv.plan.plan import Plan

__all__ = ["bind"]

_MISSING = object()


def bind(plan: Plan, feeds: Mapping[str, np.ndarray], views: Mapping | None = None) -> list:
    """Validate ``feeds`` against the graph inputs; return the initial slot list.  Inputs named in
    ``views`` (a state's caches) are its store's views, bound as given (another stored dtype, strided)."""
    slots = plan._template.copy()
    names = plan._input_names
    for name in feeds:
        if name not in names:
            expected = ", ".join(g.name for g in plan.inputs)
            raise InputError(f"Session.run: unknown input '{name}'; the model's inputs are: {expected}")
        if name in plan._fixed_inputs:
            raise InputError(f"Session.run: input '{name}' is a constant of an IR 3 model (an initializer); not fed")
    views = views or {}
    for g, s, dtype, rank, fixed, aliased in plan._input_checks:
        v = feeds.get(g.name, _MISSING)
        if v is _MISSING:
            if g.has_default:
                if s in plan._defaults:
                    slots[s] = plan._defaults[s]
                continue
            raise InputError(f"Session.run: missing input '{g.name}' (dtype {g.dtype}, shape {g.shape})")
        if g.name in views:  # a state's cache, viewed by its store: may store another dtype, fed as given
            slots[s] = v
            continue
        if type(v) is not np.ndarray:
            v = np.asarray(v)
        if v.dtype != dtype:
            raise InputError(f"Session.run: input '{g.name}' has dtype {v.dtype}, expected {g.dtype}")
        if rank >= 0:
            shape = v.shape
            if len(shape) != rank:
                raise InputError(f"Session.run: input '{g.name}' has shape {shape}, expected rank {rank} {g.shape}")
            for axis, size in fixed:
                if shape[axis] != size:
                    raise InputError(f"Session.run: input '{g.name}' has shape {shape}, expected {g.shape}")
        if aliased or v.flags.c_contiguous:
            slots[s] = v
            continue
        try:  # a strided view (a zero-stride broadcast costs nothing, whatever its shape)
            slots[s] = v.copy(order="C")
        except MemoryError as e:
            raise OutOfMemory(
                f"Session.run: input '{g.name}' of shape {v.shape} ({v.nbytes} bytes) is not C-contiguous and "
                "its contiguous copy could not be allocated"
            ) from e
    return slots
