"""The model runner: turns a StepPlan into tensors, moves KV blocks, runs the model.

It owns the model weights, the paged KV cache and the attention backend. It knows nothing of
requests or scheduling; it executes exactly what the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from octavo.config import ModelConfig
from octavo.model.attention import get_backend
from octavo.model.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk
from octavo.model.cpu_ops import select_cpu_ops
from octavo.model.kv_cache import KVCache
from octavo.model.linear import pack_linears
from octavo.model.llama import LlamaForCausalLM, RotaryEmbedding
from octavo.step_plan import StepPlan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} is not supported (cpu or cuda)")
    return d


def load_model(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
    max_positions: int, linear_backend: str | None = None, fused_ops: str | None = None,
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    model = model.to_empty(device=device)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    model.load_hf_state_dict(tensors)
    model.rotary = RotaryEmbedding(config, max_positions).to(device)
    model = model.to(dtype=dtype)
    model.rotary.to(torch.float32)  # tables stay fp32; cast per step like transformers
    pack_linears(model, linear_backend)
    model.use_cpu_ops(select_cpu_ops("fused_ops", fused_ops, device, "OCTAVO_FUSED_OPS"))
    return model.eval()


@dataclass(slots=True)
class StepOutput:
    # one row per chunk with sample=True, in plan order
    logits: torch.Tensor
    # per chunk with all_logits=True (plan order): [num_tokens, vocab] float32
    all_logits: list[torch.Tensor]


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        num_host_blocks: int = 0,
        backend: AttentionBackend | str | None = None,
        linear_backend: str | None = None,
        fused_ops: str | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.model = load_model(model_dir, config, dtype, device, max_model_len,
                                linear_backend, fused_ops)
        self.kv_cache = KVCache(config, num_blocks, block_size, dtype, device, num_host_blocks)
        if not isinstance(backend, AttentionBackend):
            backend = get_backend(backend, device)
        self.backend = backend

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        self.kv_cache.copy_blocks(plan.block_copies)
        if not plan.chunks:
            empty = torch.empty(0, self.config.vocab_size, device=self.device)
            return StepOutput(logits=empty, all_logits=[])
        input_ids, positions, meta, order = self._prepare(plan)
        # Rows to project to the vocabulary: last token of every sampling chunk, plus every token
        # of chunks that ask for prompt logprobs.
        row_starts: dict[int, int] = {}
        row = 0
        for idx in order:
            row_starts[idx] = row
            row += len(plan.chunks[idx].token_ids)
        wanted: list[int] = []
        sample_rows: list[int] = []
        all_rows: list[tuple[int, int]] = []
        for idx, chunk in enumerate(plan.chunks):
            n = len(chunk.token_ids)
            start = row_starts[idx]
            if chunk.all_logits:
                all_rows.append((len(wanted), n))
                wanted.extend(range(start, start + n))
            if chunk.sample:
                sample_rows.append(len(wanted) - 1 if chunk.all_logits else len(wanted))
                if not chunk.all_logits:
                    wanted.append(start + n - 1)
        logit_idx = torch.tensor(wanted, dtype=torch.long, device=self.device)
        logits = self.model(input_ids, positions, self.kv_cache, meta, self.backend, logit_idx)
        sampled = logits[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
        return StepOutput(logits=sampled, all_logits=[logits[s : s + n] for s, n in all_rows])

    def _prepare(self, plan: StepPlan):
        """Flatten the plan, decodes first (vLLM's convention), into model inputs."""
        bs = self.block_size
        decode_idx = [i for i, c in enumerate(plan.chunks) if len(c.token_ids) == 1]
        prefill_idx = [i for i, c in enumerate(plan.chunks) if len(c.token_ids) > 1]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for i in decode_idx:
            c = plan.chunks[i]
            pos = c.start_pos
            tokens.append(c.token_ids[0])
            positions.append(pos)
            slots.append(c.block_table[pos // bs] * bs + pos % bs)
        decode_tables = decode_lens = None
        if decode_idx:
            lens = [plan.chunks[i].context_len for i in decode_idx]
            width = -(-max(lens) // bs)
            table_rows = [
                (plan.chunks[i].block_table[:width] + [0] * width)[:width] for i in decode_idx
            ]
            decode_tables = torch.tensor(table_rows, dtype=torch.long, device=self.device)
            decode_lens = torch.tensor(lens, dtype=torch.long, device=self.device)
        prefills: list[PrefillChunk] = []
        prefill_slots: list[torch.Tensor] = []
        row = len(decode_idx)
        for i in prefill_idx:
            c = plan.chunks[i]
            n = len(c.token_ids)
            nblocks = -(-c.context_len // bs)
            table = torch.tensor(c.block_table[:nblocks], dtype=torch.long)
            pos = torch.arange(c.start_pos, c.context_len)
            prefill_slots.append(table[pos // bs] * bs + pos % bs)
            tokens.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.context_len))
            prefills.append(PrefillChunk(row, row + n, c.start_pos, table.to(self.device)))
            row += n
        slot_mapping = torch.cat([torch.tensor(slots, dtype=torch.long), *prefill_slots])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            num_decodes=len(decode_idx),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=prefills,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return input_ids, pos_t, meta, decode_idx + prefill_idx
