"""The prompt chunk a session feeds a long prompt in, chosen from the model's products and the cache.

A prompt longer than one chunk runs as several runs of ``chunk`` tokens on a
persistent state (``generate``), each attending to the cached past: the
result is the one run's, the temporaries a chunk's.  The chunk's rows are the
M of every product of the prompt, and each product streams its input
(``chunk x K`` float32) once per panel of output columns, so the chunk is the
most rows whose widest product input stays within :data:`CHUNK_BYTES`, about
the second-level caches of two cores: measured on the small builder model
(hidden 1024, intermediate 2816, 2 threads, 4,096-token prompt), 256 and 512
rows take the same time within the noise, 128 rows 5-10% more and 2,048 rows
25% more.  The chunk is a multiple of :data:`ALIGN` rows (of the page size on
a paged cache, so that chunks fill whole pages) within [:data:`MIN_CHUNK`,
:data:`MAX_CHUNK`].
"""

from __future__ import annotations

__all__ = ["prompt_chunk", "widest_product_input", "CHUNK_BYTES", "MIN_CHUNK", "MAX_CHUNK", "ALIGN"]

#: Bytes of the widest product input of one chunk (rows x K float32).
CHUNK_BYTES = 3 << 20
#: Fewest and most rows of a chunk; chunks are multiples of ALIGN rows.
MIN_CHUNK, MAX_CHUNK, ALIGN = 128, 1024, 64


def widest_product_input(kernels) -> int | None:
    """The largest K (input row width) of the packed and block-quantized products among ``kernels`` (the
    plan's op objects), or None when there is none."""
    widths = []
    for kernel in kernels:
        k = getattr(kernel, "k", None)
        packed = getattr(kernel, "packed", None)
        if isinstance(k, int):
            widths.append(k)
        elif packed is not None:
            widths.append(int(packed.shape[1]))
    return max(widths, default=None)


def prompt_chunk(kernels, block_size: int | None = None) -> int:
    """Rows per prompt chunk for a plan whose op objects are ``kernels``; ``block_size``: tokens per page of
    a paged cache (None: contiguous).  See the module docstring."""
    widest = widest_product_input(kernels)
    rows = MAX_CHUNK if widest is None else CHUNK_BYTES // (4 * widest)
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, rows // ALIGN * ALIGN))
    if block_size is not None:
        chunk = max(block_size, chunk // block_size * block_size)
    return chunk
