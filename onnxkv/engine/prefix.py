"""Automatic prefix caching: full prompt pages shared across an engine's requests.

A page of ``block_size`` prompt tokens is keyed by a hash of the previous
page's key, the page's token ids and the cache's page format (``salt``), so
a key names one whole prefix, never a page out of context.  After each prompt
chunk of a request, the full pages it completed enter the cache; a request
looks its own keys up when it arrives (and, while it has not started, at each
step), takes the longest run of hits from its first page by reference (its
writes past them copy nothing: full pages are never written again; a page it
did write into would be copied on write), and computes only the rest of its
prompt.  The engine makes a request wait while another computes its next
page (:meth:`~onnxkv.engine.batched.BatchedSteps._shares`).

The cache holds one pool reference per page, and is a holder of the pool's
audit (``held_ids``).  A cached page no request holds (reference count 1)
is *unreferenced*: such pages stay, in least-recently-used order, until the
pool needs room (:meth:`PrefixCache.evict`) or more than ``capacity`` pages
are cached.  Under a byte budget the engine may also take back the cache's
reference to pages only one request holds besides it (:meth:`release`), so
that request's cold pages can be converted to a smaller format.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from onnxkv.cache.block_pool import BlockPool

__all__ = ["PrefixCache"]


class PrefixCache:
    """Cached prompt pages of one pool (module docstring).

    Args:
        pool: the engine's page pool.
        salt: bytes naming the page format (pages of different formats never match).
        capacity: most pages cached (referenced ones included); the least recently used unreferenced
            pages go first when it is passed.
    """

    def __init__(self, pool: BlockPool, salt: bytes, capacity: int) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.salt = salt
        self.capacity = int(capacity)
        self._pages: OrderedDict[bytes, int] = OrderedDict()  # key -> page id, least recently used first
        self.evictions = 0
        pool.register(self)

    def __len__(self) -> int:
        return len(self._pages)

    def held_ids(self) -> np.ndarray:
        return np.fromiter(self._pages.values(), np.int32, len(self._pages))

    def written_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, positions): every cached page, each full (the cache holds full pages only)."""
        ids = self.held_ids()
        return ids, np.full(ids.size, self.block_size, np.int64)

    def unreferenced(self) -> int:
        """Cached pages no request holds (what :meth:`evict` can free)."""
        refs = self.pool.core.refs()
        return sum(1 for p in self._pages.values() if refs[p] == 1)

    def keys(self, tokens: np.ndarray) -> list[bytes]:
        """The key of every full page of ``tokens`` (int [L]), in order."""
        bs, out, prev = self.block_size, [], self.salt
        ids = np.ascontiguousarray(tokens, np.int64)
        for i in range(ids.size // bs):
            prev = hashlib.blake2b(prev + ids[i * bs : (i + 1) * bs].tobytes(), digest_size=16).digest()
            out.append(prev)
        return out

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Page ids of the longest run of cached keys from the first; each hit becomes most recently used."""
        hits = []
        for key in keys:
            page = self._pages.get(key)
            if page is None:
                break
            self._pages.move_to_end(key)
            hits.append(page)
        return hits

    def cached_run(self, keys: list[bytes]) -> int:
        """How many of ``keys`` from the first are cached (what :meth:`lookup` would hit; nothing moves)."""
        n = 0
        while n < len(keys) and keys[n] in self._pages:
            n += 1
        return n

    def insert(self, keys: list[bytes], pages: np.ndarray) -> int:
        """Cache ``pages[i]`` under ``keys[i]`` where the key is new (one reference each); returns pages
        added.  Keys already cached keep their page (the same tokens, computed before)."""
        added = [(k, int(p)) for k, p in zip(keys, pages) if k not in self._pages and p >= 0]
        if added:
            self.pool.incref(np.array([p for _, p in added], np.int32))
            for k, p in added:
                self._pages[k] = p
        self.trim()
        return len(added)

    def trim(self) -> int:
        """Evict unreferenced pages while more than ``capacity`` are cached; returns pages freed."""
        return self.evict(len(self._pages) - self.capacity) if len(self._pages) > self.capacity else 0

    def evict(self, n: int) -> int:
        """Drop up to ``n`` unreferenced pages, least recently used first; returns pages freed."""
        refs = self.pool.core.refs()
        gone = [k for k, p in self._pages.items() if refs[p] == 1][: max(0, int(n))]
        if not gone:
            return 0
        ids = np.array([self._pages.pop(k) for k in gone], np.int32)
        freed = self.pool.decref(ids)
        self.evictions += len(gone)
        return freed

    def release(self, pages: np.ndarray) -> int:
        """Drop the cache's reference to each of ``pages`` (page ids) that exactly one request holds
        besides it (reference count 2), so that request alone holds it and may convert it; returns
        entries dropped.  The engine's relief of a full byte budget, before it converts a request's
        pages: a prompt page only its own request holds would otherwise stay native."""
        refs = self.pool.core.refs()
        mine = {int(p) for p in np.asarray(pages).ravel() if p >= 0 and refs[p] == 2}
        gone = [k for k, p in self._pages.items() if p in mine]
        if not gone:
            return 0
        self.pool.decref(np.array([self._pages.pop(k) for k in gone], np.int32))  # frees none: a row holds each
        self.evictions += len(gone)
        return len(gone)

    def clear(self) -> None:
        """Drop every cached page's reference."""
        ids = self.held_ids()
        self._pages.clear()
        if ids.size:
            self.pool.decref(ids)
