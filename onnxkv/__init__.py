"""onnxkv: a KV-cache runtime for ONNX decoder models.

Public API::

    import onnxkv
    model = onnxkv.load("model_dir_or_file")         # recognise the cache convention
    session = onnxkv.Session(model, threads=2, events=True)
    outputs = session.run({"input_ids": ..., ...})    # stateless, like onnxruntime
    result = onnxkv.generate(session, input_ids, max_new_tokens=32)   # do_sample=, temperature=, top_k=, top_p=
    state = session.new_state(cache=onnxkv.CacheConfig("paged", kv_format="int8"))
    onnxkv.quantize_weights("model_dir", "model_dir_int4", bits=4)  # MatMuls -> MatMulNBits
    print(session.events.summary())
    onnxkv.show_config()                                # the level each kernel family runs
    with onnxkv.kernels.use_settings(onnxkv.kernels.KernelSettings(simd="avx2")):  # kernel switches
        ...
"""

__version__ = "0.1.0"

from onnxkv import (
    _kernels,  # noqa: E402,F401  (a readable ImportError if the build is broken)
    contract,  # noqa: E402
    kernels,  # noqa: E402
)
from onnxkv._config import config, show_config  # noqa: E402
from onnxkv.alloc import Allocator, AllocatorStats, ArenaAllocator, SystemAllocator  # noqa: E402
from onnxkv.contract import check_model  # noqa: E402
from onnxkv.engine import Engine, Request  # noqa: E402
from onnxkv.errors import (  # noqa: E402
    CacheCapacityError,
    Cancelled,
    ContractError,
    InputError,
    ModelError,
    OnnxkvError,
    OperatorError,
    OutOfMemory,
    SegmentsRefused,
    SerializationError,
    StateError,
    UnsupportedOperatorError,
)
from onnxkv.events import Event, EventLog  # noqa: E402
from onnxkv.generate import (  # noqa: E402
    BeamSearchResult,
    GenerationResult,
    SpeculativeResult,
    beam_search,
    generate,
    speculative_generate,
)
from onnxkv.model import Model, load  # noqa: E402
from onnxkv.model.quantize_weights import QuantizeReport, quantize_weights  # noqa: E402
from onnxkv.runtime import Cancellation, Checkpoint, Session, State  # noqa: E402
from onnxkv.runtime.cache_config import CacheConfig, KeyLayout  # noqa: E402

__all__ = [
    "__version__",
    "config",
    "show_config",
    "load",
    "Model",
    "quantize_weights",
    "QuantizeReport",
    "Session",
    "State",
    "CacheConfig",
    "KeyLayout",
    "kernels",
    "Checkpoint",
    "Cancellation",
    "contract",
    "check_model",
    "generate",
    "GenerationResult",
    "beam_search",
    "BeamSearchResult",
    "speculative_generate",
    "SpeculativeResult",
    "Engine",
    "Request",
    "Event",
    "EventLog",
    "Allocator",
    "AllocatorStats",
    "ArenaAllocator",
    "SystemAllocator",
    "OnnxkvError",
    "ModelError",
    "UnsupportedOperatorError",
    "InputError",
    "OperatorError",
    "OutOfMemory",
    "SegmentsRefused",
    "SerializationError",
    "CacheCapacityError",
    "ContractError",
    "StateError",
    "Cancelled",
]
