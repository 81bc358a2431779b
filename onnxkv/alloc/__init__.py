"""Allocators (filled in by the allocator work)."""
