"""Allocators: the :class:`Allocator` protocol, system, arena and slab allocators.

``SystemAllocator`` takes memory on demand from NumPy; ``ArenaAllocator``
carves buffers from one region reserved up front and never grows;
``SlabAllocator`` carves equal-size slots, adjacent in allocation order, from
huge-page backed chunks it maps as needed (the default page storage of paged
caches; chunks it releases go, zeroed, to the process's bounded reserve in
:mod:`onnxkv.alloc.chunk_reserve` for the next one). Any object with
``allocate``/``free``/``stats`` (see
:mod:`onnxkv.alloc.protocol`) can be used instead; :func:`as_allocator`
accepts it.
"""

from onnxkv.errors import OutOfMemory

from .arena import ArenaAllocator, ArenaBuffer
from .protocol import Allocator, AllocatorStats, Buffer
from .resolve import as_allocator, check_allocator
from .slab import SlabAllocator, SlabBuffer, SlabLane
from .system import SystemAllocator, SystemBuffer

__all__ = [
    "Allocator",
    "AllocatorStats",
    "ArenaAllocator",
    "ArenaBuffer",
    "Buffer",
    "OutOfMemory",
    "SlabAllocator",
    "SlabBuffer",
    "SlabLane",
    "SystemAllocator",
    "SystemBuffer",
    "as_allocator",
    "check_allocator",
]
