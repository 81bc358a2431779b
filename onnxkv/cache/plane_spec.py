"""What a paged cache's plane is: its native element types, its page geometry (:class:`PlaneSpec`), and
the given quantization parameters of a new page (:class:`PageParams`); pure data, no payloads (those
are :class:`~onnxkv.cache.plane_payloads.PlanePayloads`')."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxkv.cache import formats
from onnxkv.errors import InputError

__all__ = ["PlaneSpec", "PageParams", "STORAGE", "NATIVE_CODE"]

#: Native stored element types of a plane: name -> NumPy dtype (bfloat16 as uint16 bit patterns).
STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}
#: ONNX element type codes of the native (float) storages.
NATIVE_CODE = {"float32": 1, "float16": 10, "bfloat16": 16}


@dataclass(frozen=True)
class PlaneSpec:
    """One plane of a paged cache: the past input it feeds and its page geometry.

    ``storage`` is the native stored element type ("float32", "float16" or
    "bfloat16"; bfloat16 is held as uint16 bit patterns) in which pages are
    written; full pages may be converted to other formats later (see
    :meth:`PlanePayloads.convert_page`).  ``model_dtype`` is the element type the
    model feeds and reads.  ``groups`` and ``header`` give the layout of the
    plane's quantized pages (:mod:`onnxkv.cache.formats`), one of: groups 1
    with header "float32" (one scale per head); groups head_size with header
    "compact" (a scale and zero point per channel, head_size <= 512: KIVI
    keys); groups head_size with header "channel-zp" (one scale per head, a
    zero point per channel).  :meth:`check` rejects other pairs.
    """

    name: str
    heads: int
    head_size: int
    storage: str
    model_dtype: str = "float32"
    #: Scale groups of quantized pages: 1 (one scale per head) or head_size (per channel, for keys).
    groups: int = 1
    #: Header kind of the plane's quantized pages: "float32", "compact" or "channel-zp".
    header: str = formats.HEADER_FLOAT32

    @property
    def dtype(self) -> np.dtype:
        return STORAGE[self.storage]

    def page_bytes(self, block_size: int) -> int:
        return self.heads * block_size * self.head_size * self.dtype.itemsize

    def check(self, api: str) -> None:
        """Raise :class:`InputError` (starting with ``api``) unless storage, groups and header fit together."""
        if self.storage not in STORAGE:
            raise InputError(
                f"{api}: plane '{self.name}' storage must be one of {sorted(STORAGE)}, got {self.storage!r}"
            )
        if self.groups not in (1, self.head_size):
            raise InputError(
                f"{api}: plane '{self.name}' groups must be 1 or its head_size {self.head_size}, got {self.groups!r}"
            )
        if self.header not in formats.HEADERS:
            raise InputError(
                f"{api}: plane '{self.name}' header must be one of {list(formats.HEADERS)}, got {self.header!r}"
            )
        want = 1 if self.header == formats.HEADER_FLOAT32 else self.head_size
        if self.groups != want:
            raise InputError(
                f"{api}: plane '{self.name}' with header {self.header!r} needs groups {want} "
                f"({'one scale per head' if want == 1 else 'one group per channel'}), got {self.groups}"
            )
        if self.header == formats.HEADER_COMPACT and self.groups > formats.COMPACT_MAX_GROUPS:
            raise InputError(
                f"{api}: plane '{self.name}' has per-channel scales over head_size {self.head_size}; "
                f"their compact page headers hold at most {formats.COMPACT_MAX_GROUPS} channels "
                "(key_channel_scales needs head_size <= 512)"
            )


@dataclass(frozen=True)
class PageParams:
    """Given quantization parameters of one new page (instead of parameters computed from its values).

    ``scale`` and ``zero_point``: float32 ``[H * groups]`` (index ``h * groups + g``),
    checked by the caller (:func:`onnxkv.cache.formats.check_params`);
    ``groups``: 1 (per head) or head_size (per channel); ``header``: the header
    kind, "float32" or "channel-zp" (then ``header_bytes`` holds the header
    :func:`onnxkv.cache.formats.encode_header` made from them).
    """

    scale: np.ndarray
    zero_point: np.ndarray
    groups: int
    header: str = formats.HEADER_FLOAT32
    header_bytes: np.ndarray | None = None
