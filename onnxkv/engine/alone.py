"""The decode steps of a request on a state of its own, in C: :meth:`Engine.run <onnxkv.engine.engine.Engine.run>`
on graph forms the engine does not batch (one state per request).

A request whose prompt is done runs its remaining steps as one call of its state's compiled generation loop
(:meth:`State.decode_steps`), as :func:`onnxkv.generate` runs a sequence's: the same feeds, token choice
and random stream, so its tokens are the steps' one by one.  Requests are independent there (each its own
state, sampling, end ids and limits), so running one's steps ahead of the others changes no token.
"""

from __future__ import annotations

import numpy as np

from onnxkv.engine.request import Request
from onnxkv.errors import OutOfMemory
from onnxkv.generate.generate import compiled_steps

__all__ = ["decode_alone"]


def decode_alone(r: Request) -> int:
    """Run ``r``'s remaining decode steps in C on its own state; returns the steps that ran (0: none, and
    ``r`` is as before: its prompt is not done, it resumes a pause, it has fewer than two tokens left, or
    its state cannot loop -- the event log on, a graph form the loop does not replay, no pages ahead).  A
    request that reaches an end id or its last token finishes (its state closed)."""
    state, builder = r._state, r._builder
    if state is None or builder is None or r._resuming or r.finished is not None or r.prompt_done < r._seq.size:
        return 0
    names, count = builder.decode_names, r.max_new_tokens - len(r.tokens)
    if names is None or count < 2:
        return 0
    fed = builder.total
    run = None
    try:
        feeds = builder.next(np.array([r.tokens[-1]]), r._out)
        run = compiled_steps(state, feeds, count, names, list(r.eos), r.sampling, np.zeros(1, bool), r.pad_id)
    except OutOfMemory:  # the pages of its steps do not fit ahead: nothing changed, steps take them one by one
        run = None
    finally:
        if run is None or not run.steps:
            builder.rewind(fed)
    if run is None or not run.steps:
        return 0
    chosen = run.tokens.reshape(-1).tolist()
    if len(chosen) > 1:  # the steps fed the last id, then each id they chose but the last (fed by the next run)
        builder.next(np.array([chosen[:-1]]), None)
    for token in chosen:
        stop = r._take(token)
        if stop is not None:
            r._release(stop)
            break
    return run.steps
