"""Small model builders (random weights, any size) and the embedded trained model.

* :mod:`onnxkv.zoo.builders`: random-weight decoders in each cache
  convention's graph form (GenAI GroupQueryAttention, opset-23/24 Attention,
  Concat, TensorScatter) and a NumPy reference forward pass.
* :mod:`onnxkv.zoo.embedded`: the shipped byte-level model and its codec.
"""

from onnxkv.zoo import embedded  # noqa: F401
