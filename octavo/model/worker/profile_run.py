"""vLLM's profile run: how much memory the largest step's activations take on CUDA, measured
before the KV cache exists, so that gpu_memory_utilization can set it aside (cache_sizing.py).

The step is the largest the scheduler can plan: max_num_batched_tokens prompt tokens in
sequences of up to max_model_len, logits for up to max_num_seqs rows and the sampler's largest
temporaries, run through the model over a throw-away cache just big enough for it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk
from octavo.model.layers.kv_cache import KVCache

logger = logging.getLogger(__name__)


def prefill_meta(lens: list[int], per_seq: int, block_size: int,
                  device: torch.device) -> AttentionMetadata:
    """Sequence i's prompt from position 0 in blocks i * per_seq ... (i + 1) * per_seq - 1."""
    prefills, slots, row = [], [], 0
    for i, n in enumerate(lens):
        table = torch.arange(i * per_seq, (i + 1) * per_seq, device=device)
        slots.append(i * per_seq * block_size + torch.arange(n, device=device))
        prefills.append(PrefillChunk(row, row + n, 0, table))
        row += n
    return AttentionMetadata(torch.cat(slots), 0, None, None, prefills)


@torch.inference_mode()
def activation_peak(model: nn.Module, backend: AttentionBackend, args: EngineArgs,
                    config: ModelConfig, max_positions: int, dtype: torch.dtype,
                    device: torch.device) -> int:
    """Bytes the largest step's activations took at their peak on CUDA (0 elsewhere: the run
    happens all the same, which is how the CPU tests check it). `config`: what this rank's
    layers hold (its heads under tensor parallelism)."""
    bs = args.block_size
    cuda = device.type == "cuda"
    tokens = max(1, args.max_num_batched_tokens)
    seq_len = min(tokens, max_positions)
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    per_seq = -(-seq_len // bs)
    cache = KVCache(config, per_seq * len(lens), bs, dtype, device)
    metas = [prefill_meta(lens, per_seq, bs, device) for _ in config.kv_groups.windows]
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    rows = torch.arange(min(tokens, args.max_num_seqs), device=device)
    base = 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    logits = model(ids, positions, cache, metas, backend, rows)
    # the sampler's largest temporaries: fp32 probabilities, sorted for top-p/top-k
    logits.softmax(-1).sort(dim=-1, descending=True)
    peak = 0
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    del cache, logits
    if cuda:
        torch.cuda.empty_cache()
    logger.info("profile run: %d tokens in %d sequences, activation peak %.1f MiB", tokens,
                len(lens), peak / 2**20)
    return peak
