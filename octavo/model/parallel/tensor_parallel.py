"""Tensor parallelism (Megatron-LM's layout, as vLLM runs it): each rank holds a slice of every
layer and one all-reduce joins the slices after attention and one after the MLP.

- q/k/v and gate/up are column-parallel: a rank computes its heads (whole KV-head groups, each
  with its query heads) and its share of the MLP's intermediate units; no communication.
- o_proj and down_proj are row-parallel: a rank multiplies its slice of the input by its
  slice of the weight's columns, and `RowParallel` sums the partial results over the ranks
  (the bias, where there is one, is held by rank 0 only, so it is added once).
- the embedding and the LM head are vocab-parallel: a rank holds ceil(vocab / size) rows; the
  embedding looks up the ids in its range (zeros elsewhere) and all-reduces, the LM head's
  logits are all-gathered and trimmed to the vocabulary.
- the paged KV cache holds a rank's own KV heads, so it is sharded by head; the block tables
  (and so the whole paging state) are the same on every rank.

Heads and intermediate units need not divide evenly: SmolLM2-135M's 3 KV heads go 2 + 1 over two
ranks. Every rank needs at least one KV head. The slices are cut from the checkpoint at load
time (`ShardPlan.shard`, called by the model's loader on every tensor it puts): on the lazy
checkpoint tensors of layers/weights.py, so a rank reads only its own slice of each file.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from octavo.config import ModelConfig
from octavo.model.layers.weights import Value, cat, zeros, zeros_like
from octavo.model.parallel.shm_comm import ShmComm

# families whose layers are all Llama's Attention and gated MLP (the MoE families are not)
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


@dataclass(slots=True)
class CollectiveStats:
    """What the collectives of one rank cost so far: calls, seconds inside them (waiting for
    the slower ranks included) and bytes sent in."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def add(self, started: float, x: torch.Tensor) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - started
        self.bytes += x.numel() * x.element_size()


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's place in a tensor-parallel group; `group` is its torch ProcessGroup."""

    rank: int
    size: int
    group: Any = None
    stats: CollectiveStats = field(default_factory=CollectiveStats)
    # ranks on one machine: collectives through shared memory (shm_comm.py), gloo otherwise
    # and for tensors larger than its slots
    shm: ShmComm | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        if self.shm is not None and self.shm.fits(x):
            self.shm.all_reduce_(x)
        else:
            dist.all_reduce(x, group=self.group)
        self.stats.add(started, x)
        return x

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, c] on each rank -> [rows, size * c], rank order."""
        started = time.perf_counter()
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            parts = self.shm.all_gather(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        self.stats.add(started, x)
        return torch.cat(parts, dim=-1)


def split_sizes(n: int, parts: int) -> list[int]:
    """n units over `parts` ranks as evenly as possible, the larger shares first."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def shard_range(n: int, rank: int, parts: int) -> tuple[int, int]:
    sizes = split_sizes(n, parts)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def check_tp_config(config: ModelConfig, size: int) -> None:
    """Raise a ValueError naming the problem if `config` cannot run over `size` ranks."""
    if size == 1:
        return
    if config.model_type not in TP_MODEL_TYPES:
        raise ValueError(f"tensor_parallel_size={size}: model_type {config.model_type!r} does "
                         f"not run tensor-parallel yet (these do: {', '.join(TP_MODEL_TYPES)})")
    if config.num_kv_heads < size:
        raise ValueError(f"tensor_parallel_size={size} is more than the model's "
                         f"{config.num_kv_heads} KV heads (each rank needs one at least)")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"num_heads {config.num_heads} is not a multiple of num_kv_heads "
                         f"{config.num_kv_heads}")


class ShardPlan:
    """Which slice of the full model a rank holds, and how to cut it from a checkpoint."""

    def __init__(self, config: ModelConfig, rank: int, size: int) -> None:
        check_tp_config(config, size)
        self.full = config
        self.rank, self.size = rank, size
        self.group_size = config.num_heads // config.num_kv_heads  # query heads per KV head
        self.kv_heads = shard_range(config.num_kv_heads, rank, size)
        self.inter = shard_range(config.intermediate_size, rank, size)
        self.vocab_rows = -(-config.vocab_size // size)  # ceil: every rank the same rows
        self.vocab_start = min(rank * self.vocab_rows, config.vocab_size)
        self.vocab_end = min(self.vocab_start + self.vocab_rows, config.vocab_size)

    @property
    def local_config(self) -> ModelConfig:
        """The architecture of this rank's slice: what its layers and KV cache are built from."""
        kv = self.kv_heads[1] - self.kv_heads[0]
        return dataclasses.replace(
            self.full, num_kv_heads=kv, num_heads=kv * self.group_size,
            intermediate_size=self.inter[1] - self.inter[0], vocab_size=self.vocab_rows)

    def shard(self, name: str, value: Value) -> Value:
        """This rank's slice of the full tensor (or lazy checkpoint tensor) a model parameter
        `name` is loaded from."""
        leaf = name.rsplit(".", 2)
        what = ".".join(leaf[-2:])  # e.g. "qkv_proj.weight"
        d = self.full.head_dim
        if what in ("qkv_proj.weight", "qkv_proj.bias"):
            q_size = self.full.num_heads * d
            kv_size = self.full.num_kv_heads * d
            q, k, v = value.split([q_size, kv_size, kv_size], dim=0)
            lo, hi = self.kv_heads
            g = self.group_size
            return cat([q[lo * g * d : hi * g * d], k[lo * d : hi * d], v[lo * d : hi * d]])
        if what == "o_proj.weight":
            lo, hi = self.kv_heads
            g = self.group_size
            return value[:, lo * g * d : hi * g * d]
        if what in ("gate_up_proj.weight", "gate_up_proj.bias"):
            gate, up = value.chunk(2, dim=0)
            lo, hi = self.inter
            return cat([gate[lo:hi], up[lo:hi]])
        if what == "down_proj.weight":
            lo, hi = self.inter
            return value[:, lo:hi]
        if what in ("o_proj.bias", "down_proj.bias"):
            return value if self.rank == 0 else zeros_like(value)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            rows = value[self.vocab_start : self.vocab_end]
            pad = self.vocab_rows - rows.shape[0]
            if pad:
                rows = cat([rows, zeros((pad, rows.shape[1]), like=rows)])
            return rows
        if "experts" in name or "gate.weight" in name:
            raise ValueError(f"tensor parallelism cannot shard {name!r} (a MoE layer)")
        return value  # norms: every rank holds them whole


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over the ranks."""

    def __init__(self, linear: nn.Module, tp: TPGroup) -> None:
        super().__init__()
        self.linear = linear
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding; ids outside them look up zeros, then all-reduce."""

    def __init__(self, embedding: nn.Embedding, start: int, end: int, tp: TPGroup) -> None:
        super().__init__()
        self.embedding = embedding
        self.start, self.end = start, end
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        x = self.embedding(local).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(x)


class VocabParallelLMHead(nn.Module):
    """This rank's rows of the LM head; the logits of every rank gathered, padding cut off."""

    def __init__(self, lm_head: nn.Module, vocab_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_cols(self.lm_head(h))[:, : self.vocab_size]


def parallelize(model: nn.Module, plan: ShardPlan, tp: TPGroup) -> None:
    """Wrap a loaded shard's row-parallel linears, embedding and LM head in their collectives."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, tp)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, tp)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, plan.vocab_start,
                                                plan.vocab_end, tp)
    model.lm_head = VocabParallelLMHead(model.lm_head, plan.full.vocab_size, tp)
