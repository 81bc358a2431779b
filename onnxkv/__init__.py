"""onnxkv: a KV-cache runtime for ONNX decoder models."""
__version__ = "0.1.0"
