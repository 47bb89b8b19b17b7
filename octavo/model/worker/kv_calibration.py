"""The per-layer scales of fp8 KV pages (kv_quant.py), decided once at start-up.

Where the checkpoint carries them (vLLM's fp8 checkpoints: `model.layers.N.self_attn.k_scale`
and `v_scale`, one per tensor, or the older single `kv_scale`) they are used as they are.
Otherwise they come from a calibration prompt, as vLLM's `calculate_kv_scales` does: one
forward pass of CALIBRATION_TEXT with the KV cache in the model dtype records, per layer and KV
head, the largest |K| and |V|, and the scale is that over vLLM's ranges (K / 200, V / 100 for
e4m3's maximum of 448: 2.2x and 4.5x of headroom for keys and values larger than the prompt's,
which fp8's exponent pays for with little precision). The pass sees only this rank's KV heads,
so under tensor parallelism the scales are sharded with the heads by construction.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata
from octavo.model.layers.kv_cache import KVCache
from octavo.model.worker.profile_run import prefill_meta

logger = logging.getLogger(__name__)

K_RANGE, V_RANGE = 200.0, 100.0  # vLLM's envs.K_SCALE_CONSTANT and V_SCALE_CONSTANT
CALIBRATION_TEXT = """\
The history of the printing press begins in the fifteenth century, when movable type made it \
possible to reproduce books far faster than any scribe. Within fifty years presses were running \
in more than two hundred cities, and the price of a book fell to a fraction of what it had been.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

Q: A train leaves at 09:40 and arrives at 13:05. How long is the journey?
A: From 09:40 to 13:40 is 4 hours; 13:05 is 35 minutes earlier, so 3 hours and 25 minutes.

| city    | population | area (km2) |
|---------|-----------:|-----------:|
| Lisbon  |    545,000 |        100 |
| Vienna  |  1,980,000 |        415 |

"Could you summarise the meeting?" she asked. "We agreed to ship on Friday, to fix the two \
open bugs first, and to write the release notes together," he replied.
"""


def checkpoint_kv_scales(model_dir: Path, num_layers: int, num_kv_heads: int
                         ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Every layer's (k_scale, v_scale) from the checkpoint, [num_kv_heads] float32 each, or
    None where it has none. A per-tensor scale is repeated over the heads."""
    found: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(("self_attn.k_scale", "self_attn.v_scale",
                                  "self_attn.kv_scale")):
                    found[name] = f.get_tensor(name).float().flatten()
    if not found:
        return None
    out = []
    for i in range(num_layers):
        pre = f"model.layers.{i}.self_attn."
        both = found.get(pre + "kv_scale")
        k, v = found.get(pre + "k_scale", both), found.get(pre + "v_scale", both)
        if k is None or v is None:
            raise ValueError(f"the checkpoint has KV scales, but none for layer {i} "
                             f"({pre}k_scale / v_scale)")
        out.append((_per_head(k, num_kv_heads, pre + "k_scale"),
                    _per_head(v, num_kv_heads, pre + "v_scale")))
    return out


def _per_head(t: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    if t.numel() == 1:
        return t.expand(heads).clone()
    if t.numel() == heads:
        return t.clone()
    raise ValueError(f"{name} has {t.numel()} values; expected 1 or one per KV head ({heads})")


class _Recorder(AttentionBackend):
    """The backend, recording each layer's largest |K| and |V| per KV head as it goes."""

    name = "calibration"

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.amax: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window=None, softcap=None, kv=None):
        self.amax.append((k.float().abs().amax(dim=(0, 2)), v.float().abs().amax(dim=(0, 2))))
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)


@torch.inference_mode()
def calibrate_kv_scales(model: nn.Module, config: ModelConfig, backend: AttentionBackend,
                        token_ids: list[int], block_size: int, dtype: torch.dtype,
                        device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (k_scale, v_scale), [num_kv_heads] float32 each, from one forward pass of
    `token_ids` (the layers must not quantize their KV yet). `config`: what this rank holds."""
    n = len(token_ids)
    blocks = -(-n // block_size)
    cache = KVCache(config, blocks, block_size, dtype, device)
    metas = [prefill_meta([n], blocks, block_size, device) for _ in config.kv_groups.windows]
    recorder = _Recorder(backend)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    model(ids, torch.arange(n, device=device), cache, metas, recorder,
          torch.tensor([n - 1], device=device))
    if len(recorder.amax) != config.num_layers:
        raise RuntimeError(f"calibration saw {len(recorder.amax)} attention calls for "
                           f"{config.num_layers} layers")
    scales = [((k / K_RANGE).clamp_min(1e-8), (v / V_RANGE).clamp_min(1e-8))
              for k, v in recorder.amax]
    logger.info("fp8 KV scales from a %d-token calibration prompt: K %.3g..%.3g, V %.3g..%.3g",
                n, min(float(k.min()) for k, _ in scales), max(float(k.max()) for k, _ in scales),
                min(float(v.min()) for _, v in scales), max(float(v.max()) for _, v in scales))
    return scales


def calibration_token_ids(model_dir: Path) -> list[int]:
    """CALIBRATION_TEXT in the model's own tokens."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model_dir)).encode(CALIBRATION_TEXT))
