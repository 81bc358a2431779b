"""``CacheConfig``: how a state keeps its KV cache, one value for every entry point.

``Session.new_state``, ``generate``, ``beam_search`` and
``speculative_generate`` take the same ``cache=`` argument: a
:class:`CacheConfig`, a string (the kind, every other field at its default)
or None (the entry point's default kind).  The kinds:

* ``"contiguous"``: one ``[batch, kv_heads, capacity, head_size]`` buffer per
  past input, updated in place and grown geometrically (or of a fixed
  ``capacity``).
* ``"paged"``: pages of ``block_size`` tokens from a reference-counted pool
  (at most ``max_pages`` live), copy-on-write fork / reorder / checkpoint /
  truncate, full pages optionally quantized (``kv_format``).
* ``"tensor"``: no state at all; ``generate`` and ``beam_search`` thread the
  cache through the graph as tensors (past -> present), the baseline the
  other two are compared with.  ``Session.new_state`` and
  ``speculative_generate`` (which truncates its states) reject it.

``kv_format`` is what the cache is stored as: None (the model's own type),
``"fp32"`` / ``"fp16"`` / ``"bf16"`` (every position in that float type, for
either kind; GroupQueryAttention models), or, paged only, a page-format
policy of :data:`onnxkv.cache.policy.POLICIES` (``"int8"``, ``"int8-kivi"``,
``"int8-head"``, ``"int4"``, ``"residual-int8"``, ``"residual-int4"``) or a
``FormatSelector`` callable: full pages are converted after the run that
filled them.  ``key_layout`` (a :class:`KeyLayout`) chooses where the scales
and zero points of quantized key pages live; None keeps the policy's own.

On a paged cache, the float names differ from the deprecated
``new_state(kv_format="fp16")``, which converted full pages and kept the last
one native: the policy object ``onnxkv.cache.policy.POLICIES["fp16"]`` (a
``FormatSelector``) still does that.

Translation to :class:`~onnxkv.runtime.state.State`'s keywords:
:func:`state_keywords`.  The keywords a CacheConfig replaces (``capacity=``,
``initial_capacity=``, ``cache_dtype=``, ``block_size=``, ``max_pages=``,
``kv_format=``, ``key_channel_scales=``, ``key_channel_zero_points=``) still
work as keywords of the entry points for one release, with a
``DeprecationWarning`` (:func:`cache_request`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from onnxkv._deprecation import warn_deprecated
from onnxkv.cache.policy import POLICIES
from onnxkv.errors import InputError

__all__ = [
    "CacheConfig",
    "KeyLayout",
    "CacheRequest",
    "cache_request",
    "state_keywords",
    "KINDS",
    "FLOAT_FORMATS",
    "LEGACY_KEYWORDS",
]

#: Every cache kind a CacheConfig names.
KINDS = ("contiguous", "paged", "tensor")
#: kv_format names of float storage (any kind) -> State's ``cache_dtype``.
FLOAT_FORMATS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: kv_format names of page-format policies (paged only).
PAGE_POLICIES = tuple(sorted(name for name in POLICIES if name not in FLOAT_FORMATS and name != "native"))
#: Tokens per page when a paged CacheConfig leaves ``block_size`` None.
DEFAULT_BLOCK_SIZE = 16
#: First capacity of a growing contiguous cache when neither the CacheConfig nor the entry point chooses one.
DEFAULT_INITIAL_CAPACITY = 32
#: State keywords a CacheConfig replaces; deprecated as keywords of the entry points.
LEGACY_KEYWORDS = (
    "capacity",
    "initial_capacity",
    "cache_dtype",
    "block_size",
    "max_pages",
    "kv_format",
    "key_channel_scales",
    "key_channel_zero_points",
)
#: What the deprecation warning tells a caller of each legacy keyword to write instead.
_REPLACEMENT = {
    "capacity": "capacity=",
    "initial_capacity": "initial_capacity=",
    "block_size": "block_size=",
    "max_pages": "max_pages=",
    "kv_format": "kv_format= (a paged cache's 'fp16' / 'bf16' now store every page in that type from its first "
    "token; onnxkv.cache.policy.POLICIES['fp16'] converts full pages as before)",
    "cache_dtype": "kv_format='fp16' | 'bf16' | 'fp32' (for cache_dtype='float16' | 'bfloat16' | 'float32')",
    "key_channel_scales": "key_layout=KeyLayout.CHANNEL",
    "key_channel_zero_points": "key_layout=KeyLayout.CHANNEL_ZERO_POINT",
}


class KeyLayout(str, enum.Enum):
    """Where the quantization parameters of quantized key pages live (paged caches).

    * ``HEAD`` (``"head"``): one scale (and zero point) per page and KV head.
    * ``CHANNEL`` (``"channel"``): a scale and a zero point per page, head and
      channel (KIVI; the compact header).
    * ``CHANNEL_ZERO_POINT`` (``"channel-zp"``): one scale per page and head,
      one zero point per channel (the ``"int8"`` policy's layout).
    """

    HEAD = "head"
    CHANNEL = "channel"
    CHANNEL_ZERO_POINT = "channel-zp"


#: KeyLayout -> State's (key_channel_scales, key_channel_zero_points).
_KEY_FLAGS = {
    KeyLayout.HEAD: (False, False),
    KeyLayout.CHANNEL: (True, False),
    KeyLayout.CHANNEL_ZERO_POINT: (False, True),
}


def _count(name: str, value, low: int = 1) -> None:
    if value is not None and (
        isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low
    ):
        raise InputError(f"CacheConfig: {name} must be an int ≥ {low} or None, got {value!r}")


def _own_key_layout(selector) -> KeyLayout | None:
    """The key layout a selector's ``key_channel_scales`` / ``key_channel_zero_points`` attributes ask for."""
    scales = getattr(selector, "key_channel_scales", False) is True
    zero_points = getattr(selector, "key_channel_zero_points", False) is True
    if scales or zero_points:
        return KeyLayout.CHANNEL if scales else KeyLayout.CHANNEL_ZERO_POINT
    return None


@dataclass(frozen=True)
class CacheConfig:
    """How a state keeps its KV cache (see the module docstring for the kinds and formats).

    Attributes:
        kind: ``"contiguous"``, ``"paged"`` or ``"tensor"``.
        block_size: tokens per page (paged; None: 16).
        max_pages: at most this many pages live in the pool (paged; None: unbounded;
            running out raises :class:`~onnxkv.errors.OutOfMemory` before anything is written).
        capacity: positions per sequence at most (contiguous: a fixed buffer, overflow raises
            :class:`~onnxkv.errors.CacheCapacityError`; paged: a cap on the pages a row takes);
            None grows without a cap.
        initial_capacity: first capacity of a growing contiguous cache (None: the entry
            point's choice; ``new_state``: 32).
        kv_format: None, ``"fp32"``, ``"fp16"``, ``"bf16"``, a page-format policy name
            (paged) or a ``FormatSelector`` callable (paged).
        key_layout: a :class:`KeyLayout` (or its value) for quantized key pages; needs a
            paged kind and a page-format policy or selector.  None: the policy's own layout.

    Every field is checked on construction: a bad value raises
    :class:`~onnxkv.errors.InputError` naming the field, the value and what
    was expected.  Instances are immutable; ``dataclasses.replace`` makes a
    changed copy (and checks it again).
    """

    kind: str = "contiguous"
    block_size: int | None = None
    max_pages: int | None = None
    capacity: int | None = None
    initial_capacity: int | None = None
    kv_format: str | Callable | None = None
    key_layout: KeyLayout | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise InputError(f"CacheConfig: kind must be 'contiguous', 'paged' or 'tensor', got {self.kind!r}")
        for name in ("block_size", "max_pages", "capacity", "initial_capacity"):
            _count(name, getattr(self, name))
        paged_only = [n for n in ("block_size", "max_pages") if getattr(self, n) is not None]
        if self.kind != "paged" and paged_only:
            raise InputError(
                f"CacheConfig: {paged_only[0]}={getattr(self, paged_only[0])!r} needs kind='paged', "
                f"got kind={self.kind!r}"
            )
        if self.kind != "contiguous" and self.initial_capacity is not None:
            raise InputError(
                f"CacheConfig: initial_capacity={self.initial_capacity!r} needs kind='contiguous' (a "
                f"paged cache grows page by page), got kind={self.kind!r}"
            )
        if self.kind == "tensor":
            given = [n for n in ("capacity", "kv_format", "key_layout") if getattr(self, n) is not None]
            if given:
                raise InputError(
                    f"CacheConfig: {given[0]}={getattr(self, given[0])!r} needs a state's cache "
                    "(kind='contiguous' or 'paged'), got kind='tensor'"
                )
        self._check_kv_format()
        self._check_key_layout()

    def _check_kv_format(self) -> None:
        fmt = self.kv_format
        if fmt is None or (isinstance(fmt, str) and fmt in FLOAT_FORMATS):
            return
        if (isinstance(fmt, str) and fmt in PAGE_POLICIES) or (callable(fmt) and not isinstance(fmt, str)):
            if self.kind != "paged":
                raise InputError(
                    f"CacheConfig: kv_format={fmt!r} (page formats) needs kind='paged', got "
                    f"kind={self.kind!r}; a contiguous cache takes None, 'fp32', 'fp16' or 'bf16'"
                )
            return
        names = ", ".join(repr(n) for n in (*FLOAT_FORMATS, *PAGE_POLICIES))
        raise InputError(
            f"CacheConfig: kv_format must be None, one of {names} or a FormatSelector callable, got {fmt!r}"
        )

    def _check_key_layout(self) -> None:
        layout = self.key_layout
        if layout is None:
            return
        try:
            layout = KeyLayout(layout)
        except ValueError:
            values = ", ".join(repr(k.value) for k in KeyLayout)
            raise InputError(
                f"CacheConfig: key_layout must be a KeyLayout ({values}) or None, got {layout!r}"
            ) from None
        object.__setattr__(self, "key_layout", layout)
        fmt = self.kv_format
        if fmt is None or (isinstance(fmt, str) and fmt in FLOAT_FORMATS):
            raise InputError(
                f"CacheConfig: key_layout={layout.value!r} needs quantized key pages (kind='paged' and "
                f"a page-format kv_format such as 'int8'), got kv_format={fmt!r}"
            )
        own = None if isinstance(fmt, str) else _own_key_layout(fmt)
        if own is not None and own is not layout:
            raise InputError(
                f"CacheConfig: key_layout={layout.value!r} conflicts with the kv_format selector's own "
                f"layout {own.value!r} (its key_channel_scales / key_channel_zero_points attributes)"
            )


def state_keywords(config: CacheConfig, initial_capacity: int = DEFAULT_INITIAL_CAPACITY) -> dict:
    """The keywords of :class:`~onnxkv.runtime.state.State` that ``config`` (not of kind "tensor") stands for.

    ``initial_capacity`` is used when ``config.initial_capacity`` is None.  A
    named policy with an explicit ``key_layout`` other than its own is passed
    as a copy of the policy with that layout.
    """
    if config.kind == "tensor":
        raise InputError("CacheConfig: kind='tensor' has no state (the cache is threaded through the graph)")
    kw = {
        "cache": config.kind,
        "capacity": config.capacity,
        "initial_capacity": config.initial_capacity if config.initial_capacity is not None else initial_capacity,
    }
    if config.kind == "paged":
        kw["block_size"] = config.block_size if config.block_size is not None else DEFAULT_BLOCK_SIZE
        kw["max_pages"] = config.max_pages
    fmt = config.kv_format
    if isinstance(fmt, str) and fmt in FLOAT_FORMATS:
        kw["cache_dtype"] = FLOAT_FORMATS[fmt]
    elif fmt is not None:
        layout = config.key_layout
        if layout is not None and isinstance(fmt, str):
            scales, zero_points = _KEY_FLAGS[layout]
            fmt = dataclasses.replace(POLICIES[fmt], key_channel_scales=scales, key_channel_zero_points=zero_points)
        elif layout is not None:
            kw["key_channel_scales"], kw["key_channel_zero_points"] = _KEY_FLAGS[layout]
        kw["kv_format"] = fmt
    return kw


@dataclass(frozen=True)
class CacheRequest:
    """The ``cache=`` argument of an entry point, checked, with its deprecated keywords.

    ``config`` is None when the caller left the kind to the entry point
    (``cache=None``); ``legacy`` holds the deprecated State keywords the
    caller passed (already warned about), never together with a config.
    """

    config: CacheConfig | None
    legacy: Mapping

    def kind(self, default: str) -> str:
        """The kind the caller asked for, else ``default``."""
        if self.config is not None:
            return self.config.kind
        return self.legacy.get("cache", default)

    def state_keywords(self, default_kind: str, initial_capacity: int = DEFAULT_INITIAL_CAPACITY) -> dict:
        """State keywords for this request (``default_kind`` when the caller left the kind open)."""
        if self.config is not None:
            return state_keywords(self.config, initial_capacity)
        if self.legacy:
            return {"initial_capacity": initial_capacity, **self.legacy, "cache": self.kind(default_kind)}
        return state_keywords(CacheConfig(kind=default_kind), initial_capacity)


def cache_request(
    api: str,
    cache,
    kinds: Sequence[str],
    legacy: Mapping | None = None,
    *,
    depth: int = 1,
    auto: bool = False,
    given_as: str | None = None,
) -> CacheRequest:
    """Check an entry point's ``cache=`` argument and its deprecated State keywords.

    Args:
        api: the entry point's name (errors and warnings start with it).
        cache: a CacheConfig, a kind string, or None.
        kinds: the kinds this entry point supports.
        legacy: deprecated State keywords the caller passed (name -> value):
            names of :data:`LEGACY_KEYWORDS` (or ``"allocator"`` / ``"initial"``
            through ``state_options``); their values are checked by State.
        depth: onnxkv frames between this call and the caller of the entry point
            (see :func:`onnxkv._deprecation.warn_deprecated`).
        auto: ``cache="auto"`` is a deprecated spelling of None (``generate``).
        given_as: the deprecated keyword that carried ``legacy`` (``"state_options"``),
            named by the warning instead of the State keywords; it warns even when empty.

    Raises:
        InputError: ``cache`` of another type or kind, or a CacheConfig
            together with deprecated keywords.
    """
    legacy = dict(legacy or {})
    listed = ", ".join(repr(k) for k in kinds)
    if auto and isinstance(cache, str) and cache == "auto":
        warn_deprecated(
            f"{api}: cache='auto' is deprecated; leave cache=None for the default (the in-place "
            "contiguous cache when the model has one, else tensors)",
            depth + 1,
        )
        cache = None
    if isinstance(cache, str) and cache in kinds:
        config = None if legacy or given_as else CacheConfig(kind=cache)
    elif isinstance(cache, CacheConfig):
        if cache.kind not in kinds:
            raise InputError(f"{api}: cache kind {cache.kind!r} is not supported here; expected one of {listed}")
        config = cache
    elif cache is None:
        config = None
    else:
        raise InputError(f"{api}: cache must be a CacheConfig, one of {listed} or None, got {cache!r:.80}")
    if legacy or given_as:
        names = [given_as] if given_as else list(legacy)
        spelled = ", ".join(k + "=" for k in names)
        if isinstance(cache, CacheConfig):
            raise InputError(
                f"{api}: {spelled} cannot be combined with cache=CacheConfig(...); put "
                f"{'its entries' if given_as else 'them'} in the CacheConfig"
            )
        fields = "; ".join(f"{k}= -> {_REPLACEMENT[k]}" for k in legacy if k in _REPLACEMENT)
        warn_deprecated(
            f"{api}: {spelled} {'are' if len(names) > 1 else 'is'} deprecated; pass "
            f"cache=onnxkv.CacheConfig(kind=..., ...) instead" + (f" ({fields})" if fields else ""),
            depth + 1,
        )
        if isinstance(cache, str):
            legacy["cache"] = cache
    return CacheRequest(config, legacy)
