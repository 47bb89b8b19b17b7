"""octavo: an LLM inference and serving engine built on PagedAttention.

The public names are imported lazily, so `import octavo.paging` stays free of torch.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams",
           "RequestOutputKind", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from octavo.llm import LLM
    from octavo.outputs import CompletionOutput, RequestOutput
    from octavo.sampling_params import (
        BeamSearchParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )


def __getattr__(name: str):
    if name == "LLM":
        from octavo.llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams", "StructuredOutputsParams",
                "RequestOutputKind"):
        from octavo import sampling_params

        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from octavo import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'octavo' has no attribute {name!r}")
