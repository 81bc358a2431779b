"""Random sequences of state operations against a plain model of each row's tokens (``hypothesis.stateful``).

The machine drives paged and contiguous states of a tiny decoder through
run / fork / reorder / truncate / checkpoint / restore / release /
quantize_pages / save_cache / load_cache / interrupted runs (cancelled before
a random node, or failing after one) / close.  The model of a state is the
token ids of each of its rows (all rows of a state have one length).  After
every step:

* ``state.lengths`` is each row's token count and ``state.length`` their maximum;
* every page pool passes its audit;
* every live state's cache values, row by row, equal the K/V that a fresh
  contiguous state computes from that row's tokens -- and so does every
  live checkpoint -- within float32 rounding for native pages (prefill and
  decode, paged and contiguous kernels sum in different orders) and within
  the error of their format for converted pages;
* a closed state rejects every call with StateError.

Forks and checkpoints share pages with their origin, so a write of one state
reaching another fails the value check.  A call that may run out of pages
(pools with ``max_pages``) either succeeds or raises OutOfMemory and changes
nothing.  The budget comes from ``tests/fuzzing.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from deprecations import warns_deprecated
from faults import CancelOnCheck, failing_after, node_by_node
from fuzzing import hypothesis_settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

import onnxkv
from onnxkv import CacheConfig
from onnxkv.cache.paged import PagedCache
from onnxkv.cache.policy import POLICIES as PAGE_POLICIES
from onnxkv.errors import Cancelled, InputError, OperatorError, OutOfMemory, StateError
from onnxkv.zoo.builders import DecoderConfig, build_model

CFG = DecoderConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_length=64
)
BLOCK = 2
MAX_TOKENS = 20
#: Page formats quantize_pages may pick, with the error bound of a value stored in them, relative to the range
#: of the values of its head (a step of the format, covering rounding and what the error does to later layers).
FORMATS = {"float16": 2e-3, "bfloat16": 1e-2, "int8": 2e-2, "uint8": 2e-2, "int4": 0.15, "uint4": 0.15}
#: Native float32 pages: rounding of kernels that sum in another order.
NATIVE = 1e-5
#: kv_format policies of paged states (full pages converted after every run) and the error bound of their pages.
POLICIES = {"fp16": FORMATS["float16"], "int8": FORMATS["int8"], "int8-kivi": FORMATS["uint8"]}


@functools.cache
def session(family: str) -> onnxkv.Session:
    cfg = dataclasses.replace(CFG, max_length=MAX_TOKENS + 4) if family == "tensorscatter" else CFG  # static: small
    return onnxkv.Session(build_model(family, cfg, seed=11), threads=1)


def feeds(sess: onnxkv.Session, length: int, tokens: np.ndarray) -> dict:
    """Feeds of ``tokens`` [B, S] following ``length`` cached positions in every row."""
    b, s = tokens.shape
    io = sess.model.io
    capacity = sess.model.convention.capacity
    columns = np.arange(capacity if capacity else length + s)  # a static cache's mask spans its capacity
    out = {
        io.input_ids: tokens.astype(np.int64),
        io.attention_mask: np.broadcast_to(columns < length + s, (b, len(columns))).astype(np.int64),
    }
    if io.position_ids:
        out[io.position_ids] = np.broadcast_to(np.arange(length, length + s), (b, s)).astype(np.int64)
    if capacity:
        out["write_indices"] = np.full(b, length, np.int64)
    return out


@functools.lru_cache(maxsize=4096)
def reference(family: str, tokens: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The cache values [H, L, D] (and last logits) of a fresh contiguous state run on ``tokens``."""
    sess = session(family)
    with sess.new_state() as ref:
        out = ref.run(feeds(sess, 0, np.array([tokens])))
        values = {name: v[0].copy() for name, v in ref.values.items()}
    values[""] = out[sess.model.io.logits][0, -1].copy()
    return values


def assert_close_to(got: np.ndarray, want: np.ndarray, tolerance: float, what: str) -> None:
    """``got`` [H, L, D] within ``tolerance`` times each head's value range (at least 1) of ``want``."""
    span = np.maximum(want.max(axis=(1, 2)) - want.min(axis=(1, 2)), 1.0)[:, None, None]
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= tolerance * span).all(), f"{what}: error {float((err / span).max()):.3g} of the range"


class Handle:
    """A state and its model: the token ids of each row, and the coarsest format its pages may hold."""

    def __init__(self, state, tokens: list[list[int]], tolerance: float) -> None:
        self.state = state
        self.tokens = tokens
        self.tolerance = tolerance

    @property
    def paged(self) -> bool:
        return self.state.paged

    @property
    def length(self) -> int:
        return len(self.tokens[0]) if self.tokens else 0

    def __repr__(self) -> str:
        return f"Handle({self.state.cache}, rows={len(self.tokens)}, length={self.length})"


class Saved:
    """A checkpoint or a saved cache with the model of the state it was taken from."""

    def __init__(self, owner: Handle, tokens: list[list[int]], tolerance: float, payload) -> None:
        self.owner = owner
        self.tokens = [list(row) for row in tokens]
        self.tolerance = tolerance
        self.payload = payload

    def __repr__(self) -> str:
        return f"Saved(rows={len(self.tokens)}, length={len(self.tokens[0])})"


class StateMachine(RuleBasedStateMachine):
    family = "gqa"
    #: max_pages of paged states other than None (unbounded): small enough to run out sometimes.
    max_pages = (12, 24)

    states = Bundle("states")
    checkpoints = Bundle("checkpoints")
    saved = Bundle("saved")

    def __init__(self) -> None:
        super().__init__()
        self.sess = session(self.family)
        self.live: list[Handle] = []
        self.closed: list[Handle] = []
        self.held: list[Saved] = []

    # -- making states -------------------------------------------------------------------------------------------
    def _prompt(self, data, batch: int, length: int) -> np.ndarray:
        return np.array(
            data.draw(
                st.lists(
                    st.lists(st.integers(0, CFG.vocab_size - 1), min_size=length, max_size=length),
                    min_size=batch,
                    max_size=batch,
                )
            )
        )

    def _new_state(self, cache: str, data) -> Handle:
        tolerance = NATIVE
        if cache == "paged":
            policy = data.draw(st.sampled_from([None, None, "fp16", "int8", "int8-kivi"]), label="kv_format")
            header = (
                "float32"
                if policy
                else data.draw(st.sampled_from(["float32", "compact", "channel-zp"]), label="key header")
            )
            max_pages = data.draw(st.sampled_from([None, *self.max_pages]), label="max_pages")
            if header == "float32":  # "fp16" as the policy object: full pages converted, as the old kv_format="fp16"
                state = self.sess.new_state(
                    cache=CacheConfig(
                        "paged", block_size=BLOCK, max_pages=max_pages, kv_format=policy and PAGE_POLICIES[policy]
                    )
                )
            else:  # a key layout without a page format has no CacheConfig spelling: the deprecated keywords
                with warns_deprecated(__file__, "key_channel_.* deprecated"):
                    state = self.sess.new_state(
                        cache="paged",
                        block_size=BLOCK,
                        max_pages=max_pages,
                        key_channel_scales=header == "compact",
                        key_channel_zero_points=header == "channel-zp",
                    )
            tolerance = POLICIES.get(policy, NATIVE)
        else:
            state = self.sess.new_state(cache=CacheConfig(initial_capacity=4))
        h = Handle(state, [], tolerance)
        self.live.append(h)
        return h

    @initialize(
        target=states,
        cache=st.sampled_from(["contiguous", "paged", "paged"]),
        batch=st.integers(1, 3),
        length=st.integers(1, 8),
        data=st.data(),
    )
    def first_state(self, cache, batch, length, data):
        return self._started(cache, batch, length, data)

    @rule(
        target=states,
        cache=st.sampled_from(["contiguous", "paged", "paged"]),
        batch=st.integers(1, 3),
        length=st.integers(1, 8),
        data=st.data(),
    )
    def new_state(self, cache, batch, length, data):
        return self._started(cache, batch, length, data)

    def _started(self, cache, batch, length, data) -> Handle:
        h = self._new_state(cache, data)
        prompt = self._prompt(data, batch, length)
        try:
            h.state.run(feeds(self.sess, 0, prompt))
        except OutOfMemory:
            assert h.state.length == 0 and h.state.committed_bytes == 0
            prompt = prompt[:, :0]
        h.tokens = prompt.tolist() if prompt.shape[1] else []
        return h

    # -- runs ----------------------------------------------------------------------------------------------------
    def _step_tokens(self, h: Handle, data) -> np.ndarray | None:
        """New tokens [B, S] for ``h`` (S > 1 only where GroupQueryAttention allows it), None when full."""
        batch = len(h.tokens)
        s = data.draw(st.integers(1, 3), label="new tokens") if batch == 1 or h.length == 0 else 1
        if not batch or h.length + s > MAX_TOKENS:
            return None
        return self._prompt(data, batch, s)

    def _unchanged(self, h: Handle, before: dict) -> None:
        after = snapshot(h)
        assert after == before, f"{h}: a failed call changed the state"

    @rule(h=states, data=st.data())
    def run(self, h, data):
        if h not in self.live:
            return
        tokens = self._step_tokens(h, data)
        if tokens is None:
            return
        before = snapshot(h)
        try:
            out = h.state.run(feeds(self.sess, h.length, tokens))
        except OutOfMemory:
            self._unchanged(h, before)
            return
        for row, new in zip(h.tokens, tokens.tolist()):
            row.extend(new)
        if h.tolerance == NATIVE:  # the next token's logits of every row
            logits = out[self.sess.model.io.logits][:, -1]
            for row, got in zip(h.tokens, logits):
                np.testing.assert_allclose(got, reference(self.family, tuple(row))[""], rtol=1e-4, atol=1e-4)

    @rule(h=states, data=st.data(), how=st.sampled_from(["cancel", "fail"]))
    def interrupted_run(self, h, data, how):
        if h not in self.live:
            return
        tokens = self._step_tokens(h, data)
        if tokens is None:
            return
        k = data.draw(st.integers(0, len(self.sess.plan.nodes) - 1), label="node")
        before = snapshot(h)
        if how == "cancel":
            with node_by_node(self.sess.plan), pytest.raises((Cancelled, OutOfMemory)):
                h.state.run(feeds(self.sess, h.length, tokens), cancel=CancelOnCheck(k))
        else:
            with failing_after(self.sess.plan, k), pytest.raises((OperatorError, OutOfMemory)):
                h.state.run(feeds(self.sess, h.length, tokens))
        self._unchanged(h, before)

    # -- page tables ---------------------------------------------------------------------------------------------
    @rule(target=states, h=states, n=st.integers(1, 2))
    def fork(self, h, n):
        if h not in self.live or not h.paged or not h.tokens:
            return multiple()
        out = []
        for f in h.state.fork(n):
            fh = Handle(f, [list(row) for row in h.tokens], h.tolerance)
            self.live.append(fh)
            out.append(fh)
        return multiple(*out)

    @rule(h=states, data=st.data())
    def reorder(self, h, data):
        if h not in self.live or not h.paged or not h.tokens:
            return
        idx = data.draw(st.lists(st.integers(0, len(h.tokens) - 1), min_size=1, max_size=3), label="indices")
        h.state.reorder(idx)
        h.tokens = [list(h.tokens[i]) for i in idx]

    @rule(h=states, data=st.data())
    def truncate(self, h, data):
        if h not in self.live or not h.tokens:
            return
        length = data.draw(st.integers(0, h.length), label="length")
        if h.state._static:
            with pytest.raises(StateError, match="static TensorScatter cache"):
                h.state.truncate(length)
            return
        h.state.truncate(length)
        h.tokens = [row[:length] for row in h.tokens]

    @rule(target=checkpoints, h=states)
    def checkpoint(self, h):
        if h not in self.live or not h.paged or not h.tokens:
            return multiple()
        saved = Saved(h, h.tokens, h.tolerance, h.state.checkpoint())
        self.held.append(saved)
        return saved

    @rule(cp=checkpoints)
    def restore(self, cp):
        h = cp.owner
        if cp.payload.table is None or h not in self.live:
            with pytest.raises(StateError):
                h.state.restore(cp.payload)
            return
        h.state.restore(cp.payload)
        h.tokens, h.tolerance = [list(row) for row in cp.tokens], cp.tolerance

    @rule(cp=consumes(checkpoints))
    def release(self, cp):
        cp.payload.release()
        self.held.remove(cp)

    @rule(h=states, data=st.data())
    def quantize_pages(self, h, data):
        if h not in self.live or not h.paged or h.length < BLOCK:
            return
        blocks = data.draw(
            st.lists(st.integers(0, h.length // BLOCK - 1), min_size=1, max_size=3, unique=True), label="blocks"
        )
        names = [None, *FORMATS]
        k_fmt, v_fmt = data.draw(
            st.tuples(st.sampled_from(names), st.sampled_from(names)).filter(lambda f: f != (None, None)),
            label="formats",
        )
        before = snapshot(h)
        try:
            h.state.quantize_pages(blocks, k_fmt, v_fmt)
        except OutOfMemory:
            self._unchanged(h, before)
            return
        h.tolerance = max(h.tolerance, *(FORMATS[f] for f in (k_fmt, v_fmt) if f is not None))

    # -- serialisation -------------------------------------------------------------------------------------------
    @rule(target=saved, h=states)
    def save_cache(self, h):
        if h not in self.live or not h.paged or not h.tokens:
            return multiple()
        return Saved(h, h.tokens, h.tolerance, h.state.save_cache())

    @rule(h=states, data=saved)
    def load_cache(self, h, data):
        if h not in self.live or not h.paged:
            return
        before = snapshot(h)
        other_layout = data.owner.state._key_header != h.state._key_header  # key pages may not fit this pool
        try:
            h.state.load_cache(data.payload)
        except (OutOfMemory, InputError) as e:
            if isinstance(e, InputError) and not other_layout:
                raise
            self._unchanged(h, before)
            return
        h.tokens, h.tolerance = [list(row) for row in data.tokens], data.tolerance

    @rule(h=consumes(states))
    def close(self, h):
        if h in self.live:
            h.state.close()
            self.live.remove(h)
            self.closed.append(h)

    # -- invariants ----------------------------------------------------------------------------------------------
    @invariant()
    def lengths_are_the_tokens_of_each_row(self):
        for h in self.live:
            want = [len(row) for row in h.tokens]
            assert h.state.lengths.tolist() == want, f"{h}: lengths {h.state.lengths.tolist()}, want {want}"
            assert h.state.length == max(want, default=0)

    @invariant()
    def every_pool_is_whole(self):
        for pool in {id(h.state.pool): h.state.pool for h in self.live if h.state.pool is not None}.values():
            pool.audit()

    @invariant()
    def values_are_the_k_v_of_each_row(self):
        for h in self.live:
            if h.length:
                check_values(self.family, h.state.values, h.tokens, h.tolerance, repr(h))
            if h.state._static and h.state._caches:  # what the model reads past the written positions: zeros
                cap = h.state._static_capacity
                for name, c in h.state._caches.items():
                    rest = (c.gather(cap) if h.paged else c.buffer)[:, :, h.length :]
                    assert not rest.any(), f"{h}: '{name}' holds non-zero values past the positions written"

    @invariant()
    def checkpoints_hold_what_they_saw(self):
        for cp in self.held:
            if cp.payload.table is not None and cp.owner in self.live:
                st_ = cp.owner.state
                cache = PagedCache(st_.pool, cp.payload.table)
                values = {name: cache.gather(i, len(cp.tokens[0])) for i, name in enumerate(cache.planes)}
                check_values(self.family, values, cp.tokens, cp.tolerance, f"checkpoint of {cp.owner}")

    @invariant()
    def closed_states_reject_every_call(self):
        for h in self.closed:
            s = h.state
            calls = [
                lambda: s.run(feeds(self.sess, 0, np.zeros((1, 1), np.int64))),
                lambda: s.fork(1),
                lambda: s.reorder([0]),
                lambda: s.truncate(0),
                s.checkpoint,
                lambda: s.quantize_pages([0], "int8", None),
                s.save_cache,
                lambda: s.load_cache(b""),
                s.reset,
            ]
            for call in calls:
                with pytest.raises(StateError, match="closed"):
                    call()

    def teardown(self):
        for saved in self.held:
            saved.payload.release()
        for h in self.live:
            h.state.close()


def snapshot(h: Handle) -> dict:
    """What a failed call must leave as it was: lengths, bytes held, page table and every value's bytes."""
    s = h.state
    snap = {
        "lengths": s.lengths.tolist() if s.batch else [],
        "committed": s.committed_bytes,
        "values": {k: v.tobytes() for k, v in s.values.items()},
    }
    if s.page_tables is not None:
        snap["table"] = (s.page_tables.tobytes(), s.page_tables.shape)
    return snap


def check_values(family: str, values: dict, tokens: list[list[int]], tolerance: float, what: str) -> None:
    """Row ``b`` of every value [B, H, >= L, D] matches ``reference(tokens[b])`` within ``tolerance``."""
    for b, row in enumerate(tokens):
        if not row:
            continue
        want = reference(family, tuple(row))
        for name, v in values.items():
            assert_close_to(v[b, :, : len(row)], want[name], tolerance, f"{what} row {b} '{name}'")


StateMachine.TestCase.settings = hypothesis_settings(10, stateful_step_count=30)


class TestGroupQueryAttention(StateMachine.TestCase):
    pass


class AttentionMachine(StateMachine):
    family = "attention"


AttentionMachine.TestCase.settings = hypothesis_settings(4, stateful_step_count=20)


class TestOnnxAttention(AttentionMachine.TestCase):
    pass


class StaticMachine(StateMachine):
    family = "tensorscatter"
    max_pages = (40, 80)  # the whole capacity of every row is held from the first run


StaticMachine.TestCase.settings = hypothesis_settings(4, stateful_step_count=20)


class TestTensorScatter(StaticMachine.TestCase):
    pass
