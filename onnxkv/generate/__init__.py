"""Generation: sampling and greedy/sampled decoding (beam search and speculative decoding come later)."""

from onnxkv.generate.generate import GenerationResult, generate
from onnxkv.generate.sampling import SamplingConfig, select_next

__all__ = ["generate", "GenerationResult", "SamplingConfig", "select_next"]
