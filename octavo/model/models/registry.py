"""HF model_type -> the class that runs it (config.SUPPORTED_MODEL_TYPES names the same set).

Mistral and Qwen2 are Llama's computation (Qwen2 with the qkv bias its config implies, see
config.py); Qwen3 and Phi-3 differ in a layer or in their checkpoint's layout.
Qwen2-MoE and Mixtral swap MLPs for sparse mixture-of-experts blocks (moe.py).
"""

from __future__ import annotations

from octavo.config import SUPPORTED_MODEL_TYPES, ModelConfig
from octavo.model.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from octavo.model.models.gemma4 import Gemma4ForCausalLM
from octavo.model.models.llama import LlamaForCausalLM
from octavo.model.models.mixtral import MixtralForCausalLM
from octavo.model.models.nemotron_h import NemotronHForCausalLM
from octavo.model.models.phi3 import Phi3ForCausalLM
from octavo.model.models.qwen2_moe import Qwen2MoeForCausalLM
from octavo.model.models.qwen3 import Qwen3ForCausalLM
from octavo.model.models.qwen3_5 import Qwen35ForCausalLM
from octavo.model.models.qwen3_next import Qwen3NextForCausalLM
from octavo.model.models.smollm3 import SmolLM3ForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,  # sparse MoE blocks (moe.py)
    "mixtral": MixtralForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "smollm3": SmolLM3ForCausalLM,  # no RoPE on every fourth layer
    "gemma4_text": Gemma4ForCausalLM,  # later layers share earlier layers' K/V
    "qwen3_5_text": Qwen35ForCausalLM,  # Gated DeltaNet (recurrent state) + full attention
    "qwen3_next": Qwen3NextForCausalLM,  # Qwen3.5's layers with sparse MoE MLPs
    "nemotron_h": NemotronHForCausalLM,  # Mamba-2 (recurrent state) + attention + MLP blocks
}
assert set(MODELS) == set(SUPPORTED_MODEL_TYPES), "config.SUPPORTED_MODEL_TYPES is out of date"


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return MODELS[config.model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {config.model_type!r}; octavo runs these "
                         f"model types: {', '.join(MODELS)}") from None
