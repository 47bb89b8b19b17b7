"""Decode steps replayed from captured CUDA graphs (vLLM's CUDA graphs for decode).

A decode step of B sequences launches a few hundred small kernels; on a GPU their launch cost
is comparable to the work. `DecodeGraphs` captures the model's forward once per batch-size
bucket (1, 2, 4, 8, then every 8 up to `max_num_seqs`, at most 256) over persistent input
buffers: token ids, positions, and per KV cache group the slot mapping, the block tables
(max_model_len / block_size wide), the context lengths and, for sliding groups, the position of
each table's first entry. A step copies its inputs into the buffers, pads its batch up to the
bucket and replays the bucket's graph; the padded rows write nothing (slot -1, which the
Triton KV write skips), read one key and are never sampled. Every graph writes its logits into
one shared buffer, so their common memory pool holds only the intermediate tensors of the
largest bucket's forward (profile_run.graph_pool_peak sizes it before the KV cache). Steps
with prefill chunks or drafts, and batches above the largest bucket, run eagerly.
`enforce_eager` turns graphs off.

The graphs need the Triton backend (its KV write skips slot -1 and nothing in its decode path
synchronises with the host), one rank, and MoE layers that route on the device (moe.py's
`graph_safe`); `graphs_off_because` decides it once at start-up and the runner logs why.
`capture` is the capturing strategy: `cuda_capture` on a GPU; the tests pass `eager_capture`
on CPU, which replays the same forward over the same buffers eagerly, so the buffer, padding
and bucket logic is checked there too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from octavo.model.layers.attention.base import AttentionBackend, AttentionMetadata
from octavo.model.layers.kv_cache import KVCache
from octavo.model.layers.moe import graph_safe
from octavo.model.worker.input_batch import ModelInputs

logger = logging.getLogger(__name__)

MAX_BUCKET = 256
# a capture returns (replay, output): replay() recomputes output in place from the buffers
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """vLLM's sizes: 1, 2, 4, 8, then every 8, up to max_num_seqs (at most 256)."""
    top = min(max_num_seqs, MAX_BUCKET)
    sizes = [b for b in (1, 2, 4) if b < top] + list(range(8, top + 1, 8))
    if not sizes or sizes[-1] < top:
        sizes.append(top)
    return sizes


def graphs_off_because(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                       backend: str, tp_size: int, enforce_eager: bool) -> str | None:
    """Why decode steps of `model` run eagerly rather than from CUDA graphs, or None."""
    if device.type != "cuda":
        return "not on CUDA"
    if enforce_eager:
        return "enforce_eager"
    if backend != "triton":
        return f"attention_backend {backend} (graphs need Triton's, whose KV write skips slot -1)"
    if tp_size > 1:
        return "tensor parallelism"
    if not graph_safe(model, device, dtype):
        return (f"the MoE layers' per-expert matmuls read their group sizes on the host "
                f"(torch's grouped_mm does not run for {dtype} on {device.type} here)")
    return None


def cuda_capture(fn: Callable[[], torch.Tensor], pool=None
                 ) -> tuple[Callable[[], None], torch.Tensor]:
    """Warm `fn` up on a side stream (Triton compiles, allocators settle), then capture it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """The same contract without a GPU: replay() reruns fn over the buffers into `out`."""
    out = fn()
    return (lambda: out.copy_(fn())), out


@dataclass(slots=True)
class _GroupBuffers:
    slots: torch.Tensor  # [max_batch] long
    tables: torch.Tensor  # [max_batch, width] long
    lens: torch.Tensor  # [max_batch] long
    first: torch.Tensor | None  # [max_batch] long (sliding groups)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device, max_num_seqs: int, max_model_len: int,
                 windows: tuple[int | None, ...], capture: Capture | None = None) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.buckets = batch_buckets(max_num_seqs)
        top = self.buckets[-1]
        self.width = -(-max_model_len // kv_cache.block_size)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(top, **long)
        self.positions = torch.zeros(top, **long)
        self.rows = torch.arange(top, **long)
        # every bucket's logits land here: a graph's own output would stay in the pool for as
        # long as the graph lives, one [bucket, vocab] fp32 tensor per bucket (760 MB at 256
        # sequences of a 49k vocabulary); copied out, the pool holds the largest step's peak
        self.logits = torch.empty(top, model.config.vocab_size, dtype=torch.float32,
                                  device=device)
        self.groups = [_GroupBuffers(torch.full((top,), -1, **long),
                                     torch.zeros(top, self.width, **long),
                                     torch.ones(top, **long),
                                     torch.zeros(top, **long) if w is not None else None)
                       for w in windows]
        if capture is None:  # one memory pool for every bucket's graph
            capture = functools.partial(cuda_capture, pool=torch.cuda.graph_pool_handle())
        self.capture = capture
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.replays = 0

    def capture_all(self) -> None:
        """Largest bucket first (later captures reuse its memory pool on CUDA)."""
        for size in reversed(self.buckets):
            self.graphs[size] = self.capture(self._forward_fn(size))
        logger.info("CUDA graphs: decode batches %s captured", self.buckets)

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        metas = [AttentionMetadata(slot_mapping=g.slots[:size], num_decodes=size,
                                   decode_block_tables=g.tables[:size],
                                   decode_context_lens=g.lens[:size], prefills=[],
                                   decode_first_pos=None if g.first is None else g.first[:size])
                 for g in self.groups]
        ids, pos, rows = self.input_ids[:size], self.positions[:size], self.rows[:size]

        out = self.logits[:size]

        def forward() -> torch.Tensor:
            out.copy_(self.model(ids, pos, self.kv_cache, metas, self.backend, rows))
            return out
        return forward

    def bucket_for(self, inputs: ModelInputs) -> int | None:
        """The bucket a step replays in, or None: it runs eagerly (prefills, drafts, too
        many sequences, or a table wider than the buffers)."""
        meta = inputs.meta
        batch = inputs.input_ids.shape[0]
        if meta.prefills or meta.num_decodes != batch or batch > self.buckets[-1]:
            return None
        if any(m.decode_block_tables is not None and m.decode_block_tables.shape[1] > self.width
               for m in inputs.metas):
            return None
        return next(b for b in self.buckets if b >= batch)

    def run(self, inputs: ModelInputs, size: int) -> torch.Tensor:
        """Logits of every row of a decode-only step [B, vocab], through bucket `size`."""
        batch = inputs.input_ids.shape[0]
        self.input_ids[:batch].copy_(inputs.input_ids)
        self.positions[:batch].copy_(inputs.positions)
        for g, meta in zip(self.groups, inputs.metas, strict=True):
            assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
            width = meta.decode_block_tables.shape[1]
            g.slots[:batch].copy_(meta.slot_mapping)
            g.slots[batch:size].fill_(-1)  # padded rows write nothing
            g.tables[:batch, :width].copy_(meta.decode_block_tables)
            g.lens[:batch].copy_(meta.decode_context_lens)
            g.lens[batch:size].fill_(1)
            if g.first is not None:
                assert meta.decode_first_pos is not None
                g.first[:batch].copy_(meta.decode_first_pos)
                g.first[batch:size].fill_(0)
        replay, out = self.graphs[size]
        replay()
        self.replays += 1
        return out[:batch]
