"""Compiled kernels (filled in by the kernels work)."""
