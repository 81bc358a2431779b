"""Generation: greedy/sampled decoding, beam search and speculative decoding."""

from onnxkv.generate.beam_search import BeamSearchResult, beam_search
from onnxkv.generate.generate import GenerationResult, generate
from onnxkv.generate.sampling import SamplingConfig, select_next
from onnxkv.generate.speculative import SpeculativeResult, speculative_generate

__all__ = [
    "generate",
    "GenerationResult",
    "beam_search",
    "BeamSearchResult",
    "SamplingConfig",
    "select_next",
    "speculative_generate",
    "SpeculativeResult",
]
