"""vLLM's profile run: how much memory the engine's steps take on CUDA beyond the weights and
the KV cache, measured before the cache exists, so that gpu_memory_utilization can set it aside
(cache_sizing.py).

- `activation_peak`: the largest step the scheduler can plan, max_num_batched_tokens prompt
  tokens in sequences of up to max_model_len, with everything that step can hold at once: the
  logits of every one of its tokens (a chunk that wants prompt logprobs projects each token to
  the vocabulary, not only its last) and their log-softmax, and the sampler's largest
  temporaries over max_num_seqs rows (the float32 copy it edits, probabilities, their sort for
  top-p / top-k);
- `graph_pool_peak`: what the decode CUDA graphs (cuda_graphs.py) keep for as long as they
  live: their memory pool, which holds the intermediate tensors of the largest bucket's forward
  (every bucket shares it, the largest captured first), i.e. the activation peak of a decode
  step of that many sequences over block tables as wide as the graphs' buffers, plus the
  fp32 logits buffer every bucket writes into.

Both run through the model over a throw-away cache just big enough for them; on CPU they run
all the same and measure nothing (0), which is how the tests check them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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


def _decode_meta(batch: int, width: int, windowed: bool,
                 device: torch.device) -> AttentionMetadata:
    """`batch` decodes of one token at position 0, tables `width` wide (all in block 0)."""
    long = dict(dtype=torch.long, device=device)
    return AttentionMetadata(torch.zeros(batch, **long), batch,
                             torch.zeros(batch, width, **long), torch.ones(batch, **long), [],
                             torch.zeros(batch, **long) if windowed else None)


def sampler_temporaries(logits: torch.Tensor, rows: int) -> None:
    """Allocate what sampling `rows` of `logits` and scoring every row's prompt logprobs hold
    at their largest (sampler.py and compute_logprobs, one after the other as the runner runs
    them)."""
    x = logits[:rows].to(torch.float32, copy=True)  # bias, penalties, bans edit a copy
    x.softmax(-1).sort(dim=-1, descending=True)  # top-p / top-k
    del x
    lps = logits.log_softmax(-1)  # prompt logprobs of every row
    (lps > lps[:, :1]).sum(dim=-1)  # the chosen tokens' ranks


def measured(device: torch.device, run: Callable[[], None]) -> int:
    """Bytes `run` allocated at its peak beyond what was allocated before (0 off CUDA)."""
    if device.type != "cuda":
        run()
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return peak


def release(device: torch.device) -> None:
    """Hand the allocator's cached blocks back to the driver: the KV budget reads the device's
    free memory next, and the profile run's freed memory is not in use."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def activation_peak(model: nn.Module, backend: AttentionBackend, args: EngineArgs,
                    config: ModelConfig, max_positions: int, dtype: torch.dtype,
                    device: torch.device) -> int:
    """Bytes the largest step took at its peak on CUDA (0 elsewhere). `config`: what this
    rank's layers hold (its heads under tensor parallelism)."""
    bs = args.block_size
    tokens = max(1, args.max_num_batched_tokens)
    seq_len = min(tokens, max_positions)
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    per_seq = -(-seq_len // bs)

    def inputs() -> Callable[[], None]:  # built before measuring; freed with the step
        cache = KVCache(config, per_seq * len(lens), bs, dtype, device)
        metas = [prefill_meta(lens, per_seq, bs, device) for _ in config.kv_groups.windows]
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        rows = torch.arange(tokens, device=device)  # prompt logprobs: every token's logits

        def step() -> None:
            logits = model(ids, positions, cache, metas, backend, rows)
            sampler_temporaries(logits, min(tokens, args.max_num_seqs))
        return step

    peak = measured(device, inputs())
    release(device)
    logger.info("profile run: %d tokens in %d sequences, activation peak %.1f MiB (logits of "
                "every token, sampler temporaries included)", tokens, len(lens), peak / 2**20)
    return peak


@torch.inference_mode()
def graph_pool_peak(model: nn.Module, backend: AttentionBackend, config: ModelConfig,
                    batch: int, max_positions: int, block_size: int, dtype: torch.dtype,
                    device: torch.device) -> int:
    """Bytes the decode graphs' memory pool will hold on CUDA (0 elsewhere): the peak of a
    decode step of `batch` sequences (the largest bucket) over tables covering
    `max_positions`, as the graphs' buffers do."""
    width = -(-max_positions // block_size)

    def inputs() -> Callable[[], None]:  # built before measuring; freed with the step
        cache = KVCache(config, 1, block_size, dtype, device)
        metas = [_decode_meta(batch, width, w is not None, device)
                 for w in config.kv_groups.windows]
        ids = torch.zeros(batch, dtype=torch.long, device=device)
        rows = torch.arange(batch, device=device)

        def step() -> None:
            model(ids, torch.zeros_like(ids), cache, metas, backend, rows)
        return step

    peak = measured(device, inputs())
    release(device)
    if device.type != "cuda":
        return 0
    logits = batch * config.vocab_size * 4
    logger.info("CUDA graphs: a decode step of %d sequences peaks at %.1f MiB, their logits "
                "buffer takes %.1f MiB", batch, peak / 2**20, logits / 2**20)
    return peak + logits
