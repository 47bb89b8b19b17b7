"""octavo: an LLM inference and serving engine built on PagedAttention."""

from octavo.engine.outputs import CompletionOutput, RequestOutput
from octavo.engine.sampling_params import BeamSearchParams, SamplingParams
from octavo.llm import LLM

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
