"""The per-layer parameters of quantized KV pages (kv_quant.py), decided once at start-up: the
scales of fp8 pages, and the key smoothing (kv_smoothing.py) of int8 and fp8 pages.

Where the checkpoint carries them (vLLM's fp8 checkpoints: `model.layers.N.self_attn.k_scale`
and `v_scale`, one per tensor, or the older single `kv_scale`) they are used as they are.
Otherwise they come from a calibration prompt, as vLLM's `calculate_kv_scales` does: one
forward pass of CALIBRATION_TEXT with the KV cache in the model dtype records, per layer and KV
head, the largest |K| and |V|, and the scale is that over vLLM's ranges (K / 200, V / 100 for
e4m3's maximum of 448: 2.2x and 4.5x of headroom for keys and values larger than the prompt's,
which fp8's exponent pays for with little precision). The same pass gives the key smoothing its
per-channel key means, and the fp8 scales are then taken from the smoothed keys and values.
Checkpoint scales describe K and V as computed, so with them nothing is smoothed. The pass sees
only this rank's KV heads, so under tensor parallelism scales and means are sharded with the
heads by construction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata
from octavo.model.layers.kv_cache import KVCache
from octavo.model.layers.kv_smoothing import hadamard, rotatable, smooth_qkv
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


@dataclass(frozen=True, slots=True)
class LayerCalibration:
    """One layer's KV quantization parameters (kv_quant.KVQuant's): the fp8 scales ([num_kv_heads]
    float32 each; set from the keys as stored, i.e. after smoothing) and the key smoothing
    (kv_smoothing.py; None where off)."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_offset: torch.Tensor | None = None
    rotation: torch.Tensor | None = None


class _Recorder(AttentionBackend):
    """The backend, recording each layer's calibration from the K and V it is given."""

    name = "calibration"

    def __init__(self, inner: AttentionBackend, smooth: bool) -> None:
        self.inner = inner
        self.smooth = smooth
        self.layers: list[LayerCalibration] = []

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window=None, softcap=None, kv=None):
        offset = rotation = None
        if self.smooth:
            # centring moves every score of a query alike, which a soft cap does not allow.
            # Any offset is exact; the mean is the best one, rounded to float16 so that a run
            # whose sums differ in their last bits (another thread count) most often gets the
            # same offsets, and so the same cache id (KV tier records)
            offset = k.float().mean(0).half().float() if softcap is None else None
            rotation = hadamard(k.shape[-1]).to(k.device) if rotatable(k.shape[-1]) else None
        _, ks, vs = smooth_qkv(q, k.float(), v.float(), offset, rotation)
        self.layers.append(LayerCalibration(
            (ks.abs().amax(dim=(0, 2)) / K_RANGE).clamp_min(1e-8),
            (vs.abs().amax(dim=(0, 2)) / V_RANGE).clamp_min(1e-8), offset, rotation))
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)


@torch.inference_mode()
def calibrate_kv(model: nn.Module, config: ModelConfig, backend: AttentionBackend,
                 token_ids: list[int], block_size: int, dtype: torch.dtype,
                 device: torch.device, smooth: bool) -> list[LayerCalibration]:
    """Every layer's calibration from one forward pass of `token_ids` (the layers must not
    quantize their KV yet): key smoothing where `smooth`, and the fp8 scales of the keys as
    smoothed. `config`: what this rank holds, so the KV heads are this rank's."""
    n = len(token_ids)
    blocks = -(-n // block_size)
    cache = KVCache(config, blocks, block_size, dtype, device)
    metas = [prefill_meta([n], blocks, block_size, device) for _ in config.kv_groups.windows]
    recorder = _Recorder(backend, smooth)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    model(ids, torch.arange(n, device=device), cache, metas, recorder,
          torch.tensor([n - 1], device=device))
    if len(recorder.layers) != config.num_layers:
        raise RuntimeError(f"calibration saw {len(recorder.layers)} attention calls for "
                           f"{config.num_layers} layers")
    ks = [c.k_scale for c in recorder.layers]
    vs = [c.v_scale for c in recorder.layers]
    logger.info("KV calibration on a %d-token prompt (keys %s): fp8 scales K %.3g..%.3g, "
                "V %.3g..%.3g", n, "smoothed" if smooth else "as computed",
                min(float(k.min()) for k in ks), max(float(k.max()) for k in ks),
                min(float(v.min()) for v in vs), max(float(v.max()) for v in vs))
    return recorder.layers


def calibration_token_ids(model_dir: Path) -> list[int]:
    """CALIBRATION_TEXT in the model's own tokens."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model_dir)).encode(CALIBRATION_TEXT))
