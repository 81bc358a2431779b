"""Operator implementations; importing this package registers them all."""

from onnxkv.plan.ops import activation, elementwise, matmul, norm, reduce, shape  # noqa: F401
