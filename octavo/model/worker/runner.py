"""The model runner: executes a StepPlan and samples, returning plain Python values.

It owns every piece of device state: the weights, the paged KV cache (sized here, after the
weights load), the attention backend, the RNG, and what it keeps of each sequence between steps
(InputBatch). It knows nothing of requests or scheduling; it executes exactly what the plan
says. Start-up: `ModelRunner(...)` loads the weights, `size_kv_blocks()` says how many blocks
fit, `init_kv_cache(n)` allocates them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs
from octavo.model.dtype_policy import DTYPES
from octavo.model.kernel_config import resolve_kernel_config
from octavo.model.layers.attention import get_backend
from octavo.model.layers.decoder import Attention
from octavo.model.layers.kv_cache import KVCache
from octavo.model.layers.kv_quant import KVFormat, KVQuant, kv_format
from octavo.model.layers.linear import PackedLinear
from octavo.model.layers.recurrent.state import StateCache
from octavo.model.loader import load_model
from octavo.model.parallel.tensor_parallel import ShardPlan, TPGroup
from octavo.model.quant.block_quant import BlockQuantLinear
from octavo.model.quant.quantization import Int8Linear, weight_bytes
from octavo.model.sample.logits_processor import LogitsProcessors
from octavo.model.sample.metadata import SamplingMetadata
from octavo.model.sample.sampler import Sampler, SamplerOutput, compute_logprobs
from octavo.model.sources import resolve_model_dir
from octavo.model.spec.draft_acceptance import accept_drafts
from octavo.model.spec.draft_model import DraftModelDrafter
from octavo.model.spec.self_draft import SelfDrafter
from octavo.model.worker.cache_sizing import KVBlockCounts, MemInfo, size_kv_blocks
from octavo.model.worker.cuda_graphs import DecodeGraphs, batch_buckets, graphs_off_because
from octavo.model.worker.decode_stack import build_decode_stack
from octavo.model.worker.device import bind_device
from octavo.model.worker.input_batch import InputBatch
from octavo.model.worker.kv_calibration import (
    LayerCalibration,
    calibrate_kv,
    calibration_token_ids,
    checkpoint_kv_scales,
)
from octavo.model.worker.profile_run import activation_peak, graph_pool_peak
from octavo.model.worker.sampling_rows import SamplingRows, grammar_rows, sampling_rows
from octavo.step_plan import RunnerOutput, StepPlan

__all__ = ["DTYPES", "ModelRunner", "load_model"]
logger = logging.getLogger(__name__)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows `rows`: t itself (no gather) where they are all its rows in order."""
    if rows == list(range(len(t))):
        return t
    return t[torch.tensor(rows, dtype=torch.long, device=t.device)]


@dataclass(slots=True)
class StepLogits:
    # per chunk that samples, in plan order: one row, or with drafts one more per draft
    sample: torch.Tensor
    # seq_id -> [num_tokens, vocab] for chunks that want prompt logprobs
    prompt: dict[int, torch.Tensor]
    # the plan as computed: with the drafts the runner proposed filled in
    plan: StepPlan
    # the bytes of the plan's tier_saves blocks, copied out before the step wrote anything
    saved_blocks: list[bytes] = field(default_factory=list)


class ModelRunner:
    """`tp`: this runner's rank in a tensor-parallel group (None: the whole model here). Every
    rank executes every plan; rank 0's RunnerOutput is the step's."""

    def __init__(self, args: EngineArgs, model_dir: Path, config: ModelConfig,
                 tp: TPGroup | None = None) -> None:
        self.args = args
        self.model_dir = model_dir
        self.config = config
        self.tp = tp
        # what this rank's layers and KV cache hold (its heads and MLP units under TP)
        self.local_config = (ShardPlan(config, tp.rank, tp.size).local_config
                             if tp is not None and tp.size > 1 else config)
        self.device = bind_device(args.device)  # current before anything allocates
        # every `auto` kernel choice, resolved once (model/kernel_config.py)
        self.kernels, self.dtype_choice = resolve_kernel_config(
            args, config, self.device, tp.size if tp is not None else 1)
        isa = self.kernels.isa
        self.isa = isa or "none"
        self.dtype = self.dtype_choice.dtype
        # how K/V are stored (kv_cache_dtype; kv_quant.py)
        self.kv_format: KVFormat = kv_format(args.kv_cache_dtype, self.dtype)
        self.block_size = args.block_size
        torch.manual_seed(args.seed)
        max_positions = args.max_model_len or config.max_position_embeddings
        self.max_positions = max_positions
        self.graphs: DecodeGraphs | None = None  # set by init_kv_cache where they apply
        self.model = load_model(model_dir, config, self.dtype, self.device, max_positions,
                                args.linear_backend, self.kernels.fused_ops, isa, tp,
                                args.quantization, args.quantization_group_size,
                                args.packed_gemv_rows)
        self.backend = get_backend(self.kernels.attention, self.device, isa)
        why = graphs_off_because(self.model, self.device, self.dtype, self.backend.name,
                                 tp.size if tp is not None else 1, args.enforce_eager)
        # decided once: size_kv_blocks and init_kv_cache read it
        self.use_cuda_graphs = self.kernels.cuda_graphs and why is None
        if self.device.type == "cuda":
            logger.info("CUDA graphs for decode: %s", "on" if self.use_cuda_graphs else
                        f"off, decode steps run eagerly ({why or 'not asked for'})")
        groups = config.kv_groups
        self.batch = InputBatch(args.block_size, self.device, groups.windows, groups.has_state)
        # recurrent layers: their state tensors per slot (None: a model without them)
        self.state_shapes = self.model.state_shapes(self.dtype) if groups.has_state else None
        self.kv_counts: KVBlockCounts | None = None  # as size_kv_blocks sized it
        self.sampler = Sampler()
        self.logits_processors = LogitsProcessors(args.logits_processors, args, self.device)
        self.kv_cache: KVCache | None = None
        self.drafter = self._make_drafter(max_positions, isa)
        logger.info("kernels: %s (dtype: %s)", self.kernel_path(), self.dtype_choice.reason)

    def _make_drafter(self, max_positions: int, isa: str | None
                      ) -> SelfDrafter | DraftModelDrafter | None:
        """What proposes drafts in the runner (speculative decoding by a model), or None."""
        spec = self.args.speculative()
        if spec is None:
            return None
        if spec.method == "self_draft":
            return SelfDrafter(self.model, spec.num_draft_layers)
        if spec.method != "draft_model":
            return None  # n-gram: the scheduler proposes
        assert spec.model is not None
        draft_dir = resolve_model_dir(spec.model)
        draft_config = ModelConfig.from_dir(draft_dir)
        draft = load_model(draft_dir, draft_config, self.dtype, self.device, max_positions,
                           self.args.linear_backend, self.kernels.fused_ops, isa,
                           packed_gemv_rows=self.args.packed_gemv_rows)
        return DraftModelDrafter(draft, draft_config, self.model, self.config)

    def kernel_path(self) -> dict[str, str]:
        """Which kernels this runner took (benchmarks record it next to the CPU's flags):
        the ISA of octavo's compiled ops (cpu_isa.py; "none" where none run), the dtype asked
        for and the one computed in, whether prefill attention takes the CPU's bf16 dot
        products, and up to how many rows oneDNN-packed linear layers run octavo's GEMV."""
        modules = list(self.model.modules())
        kinds = [name for name, cls in (("onednn", PackedLinear), ("int8", Int8Linear),
                                        ("blocks", BlockQuantLinear))
                 if any(isinstance(m, cls) for m in modules)]
        linear = "+".join(kinds) or "torch"
        ops = next((m.ops for m in modules if getattr(m, "ops", None) is not None), None)
        fused = "torch" if ops is None else "triton" if ops.isa() == "triton" else "cpu"
        compiled = fused == "cpu" or hasattr(self.backend, "kernel")
        kernel = getattr(self.backend, "kernel", None)
        bf16_dot = (self.dtype == torch.bfloat16 and hasattr(kernel, "prefill_bf16_dot")
                    and kernel.prefill_bf16_dot())
        gemv = max((m.gemv_rows for m in modules if isinstance(m, PackedLinear)), default=0)
        amx = any(isinstance(m, PackedLinear) and m.gemv_rows and m.gemv_block == 32
                  for m in modules) and ops is not None and ops.packed_gemv_has_amx()
        return {**self.kernels.as_dict(), "device": str(self.device),
                "dtype": self.dtype_choice.name,
                "dtype_requested": self.args.dtype,
                "isa": self.isa if compiled else "none",
                "attention": type(self.backend).__name__, "linear": linear, "fused_ops": fused,
                "prefill_bf16_dot": bool(bf16_dot),
                "decode_gemv": (f"packed_gemv <= {gemv} rows{' (AMX tiles)' if amx else ''}"
                                if gemv else "off"),
                "decode_loop": "c++" if self.model.decode_stack is not None else "python",
                "cuda_graphs": "off" if self.graphs is None else
                f"decode batches <= {self.graphs.buckets[-1]}",
                **self.kv_report(), **self.weights_report()}

    def kv_report(self) -> dict[str, int | str]:
        """How K/V are stored: the dtype, and the bytes one token takes in every layer that
        owns KV pages (K and V, scales included, this rank's heads; shared-KV, recurrent and
        MLP-only layers add nothing)."""
        name, cfg = self.kv_format.name, self.local_config
        row = self.kv_format.row_bytes(cfg.head_dim)
        return {"kv_cache_dtype": str(self.dtype).removeprefix("torch.") if name == "auto"
                else name,
                "kv_bytes_per_token": 2 * cfg.num_kv_layers * cfg.num_kv_heads * row}

    def weights_report(self) -> dict[str, int | str]:
        """The weights' bytes in memory, and what quantization saved (0 without); for a model
        with recurrent layers, the bytes of one sequence's state slot (whatever its length)."""
        report = self.model.quant_report
        return {"quantization": report.method if report is not None else "none",
                "weights_bytes": weight_bytes(self.model),
                "quantization_saved_bytes": report.saved_bytes if report is not None else 0,
                "state_bytes_per_slot": (StateCache.bytes_per_slot(self.state_shapes)
                                         if self.state_shapes else 0)}

    # ---- start-up -------------------------------------------------------------------------
    def size_kv_blocks(self, mem_get_info: MemInfo | None = None) -> KVBlockCounts:
        """Blocks for the device and the host; on CUDA from the memory left after the weights."""
        extra = 0
        if isinstance(self.drafter, DraftModelDrafter):  # its cache has the target's blocks
            extra = KVCache.bytes_per_block(self.drafter.config, self.block_size, self.dtype)
        state = StateCache.bytes_per_slot(self.state_shapes) if self.state_shapes else 0
        self.kv_counts = size_kv_blocks(self.args, self.local_config, self.dtype, self.device,
                                        mem_get_info, extra_block_bytes=extra,
                                        activation_peak=self.profile_run,
                                        graph_pool=self.graph_pool_run
                                        if self._wants_cuda_graphs() else None,
                                        state_slot_bytes=state, fmt=self.kv_format)
        return self.kv_counts

    def profile_run(self) -> int:
        """The largest step's activation peak on CUDA (profile_run.py; 0 elsewhere)."""
        return activation_peak(self.model, self.backend, self.args, self.local_config,
                               self.max_positions, self.dtype, self.device)

    def graph_pool_run(self) -> int:
        """What the decode CUDA graphs' memory pool will hold (profile_run.py; 0 off CUDA)."""
        return graph_pool_peak(self.model, self.backend, self.local_config,
                               batch_buckets(self.args.max_num_seqs)[-1], self.max_positions,
                               self.block_size, self.dtype, self.device)

    def init_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """The KV cache, and the recurrent layers' state slots as size_kv_blocks sized them."""
        scales_id = self._quantize_kv() if self.kv_format.quantized else ""
        self.kv_cache = KVCache(self.local_config, num_blocks, self.block_size, self.dtype,
                                self.device, num_host_blocks, self.kv_format, scales_id)
        if self.state_shapes is not None:
            counts = self.kv_counts or self.size_kv_blocks()
            self.kv_cache.state = StateCache(self.state_shapes, counts.num_state_slots,
                                             self.device, counts.num_host_state_slots)
        report = self.kv_report()
        logger.info("KV cache: %d blocks of %d tokens, %s, %d bytes per token (%.1f MiB)",
                    num_blocks, self.block_size, report["kv_cache_dtype"],
                    report["kv_bytes_per_token"],
                    self.kv_cache.device_cache.numel() * self.kv_cache.device_cache.element_size()
                    / 2**20)
        if self.backend.name == "triton":
            from octavo.model.kernels.triton.cache_ops import copy_blocks

            self.kv_cache.block_copier = copy_blocks
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks, self.block_size, self.dtype, self.device)
        if self.device.type == "cpu" and (self.tp is None or self.tp.size == 1):
            self.model.decode_stack = build_decode_stack(self.model, self.backend,
                                                         self.kv_cache.groups, self.dtype,
                                                         self.kernels.decode_stack)
        if self._wants_cuda_graphs():
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.backend, self.device,
                                       self.args.max_num_seqs, self.max_positions,
                                       self.config.kv_groups.windows)
            self.graphs.capture_all()

    def _quantize_kv(self) -> str:
        """Every attention layer writes and reads quantized pages from now on. fp8 layers get
        their scales from the checkpoint or a calibration prompt (kv_calibration.py), and, with
        `kv_smooth_keys`, int8 and fp8 layers get their key smoothing from the same prompt
        (kv_smoothing.py). Returns a digest of everything that decides the stored bytes beyond
        the format ("" for int8 without smoothing, whose scales are in the pages)."""
        fmt = self.kv_format
        # every module that writes KV pages carries a kv_quant slot (decoder.Attention and the
        # hybrid families' own attention layers)
        layers = [m for m in self.model.modules() if hasattr(m, "kv_quant")]
        cfg = self.local_config
        owns = cfg.num_kv_layers == cfg.num_layers
        if fmt.is_fp8 and not owns:
            raise ValueError(
                f"kv_cache_dtype={fmt.name!r}: fp8 pages need a scale per layer, computed only "
                f"for models whose every layer owns its KV pages; {cfg.model_type} has "
                f"{cfg.num_layers - cfg.num_kv_layers} recurrent, shared-KV or MLP-only layers "
                "(kv_cache_dtype='int8' keeps its scales in the pages and works here)")
        checkpoint = (checkpoint_kv_scales(self.model_dir, cfg.num_layers, cfg.num_kv_heads)
                      if fmt.is_fp8 else None)
        # the smoothing is applied by decoder.Attention, in models whose every layer is one
        # (checkpoint scales describe the keys as computed, so they keep them unsmoothed)
        smooth = (self.args.kv_smooth_keys and owns and checkpoint is None
                  and all(type(m) is Attention for m in layers))
        if checkpoint is not None:
            calib = [LayerCalibration(k, v) for k, v in checkpoint]
        elif fmt.is_fp8 or smooth:
            ids = calibration_token_ids(self.model_dir)[: self.max_positions]
            calib = calibrate_kv(self.model, cfg, self.backend, ids, self.block_size,
                                 self.dtype, self.device, smooth)
        else:
            for attn in layers:
                attn.kv_quant = KVQuant(fmt)
            return ""
        if len(calib) != len(layers):
            raise ValueError(f"{len(calib)} KV calibrations for {len(layers)} attention layers")

        def dev(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device)

        digest = hashlib.blake2b(digest_size=8)
        digest.update(b"smooth" if smooth else b"plain")
        for attn, c in zip(layers, calib, strict=True):
            attn.kv_quant = KVQuant(fmt, dev(c.k_scale) if fmt.is_fp8 else None,
                                    dev(c.v_scale) if fmt.is_fp8 else None,
                                    dev(c.k_offset), dev(c.rotation))
            parts = (c.k_scale, c.v_scale) if fmt.is_fp8 else ()
            for t in (*parts, c.k_offset, c.rotation):
                if t is not None:
                    digest.update(t.detach().float().cpu().numpy().tobytes())
        logger.info("%s KV pages: %s%s", fmt.name,
                    "per-head scales from the checkpoint" if checkpoint is not None
                    else "per-head scales from a calibration prompt" if fmt.is_fp8
                    else "scales per token in the pages",
                    "; keys smoothed (centred and rotated, kv_smoothing.py)" if smooth else "")
        return digest.hexdigest()

    def _wants_cuda_graphs(self) -> bool:
        """CUDA graphs for decode (cuda_graphs.graphs_off_because, decided at start-up)."""
        return self.use_cuda_graphs

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        logits = self.forward(plan)
        out = self._sample(logits.plan, logits)
        out.saved_blocks = logits.saved_blocks
        return out

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> StepLogits:
        """Apply the plan's sequence changes and KV copies, then run the model; the logits of
        every sampling chunk's last token and of every prompt-logprobs chunk's tokens."""
        assert self.kv_cache is not None, "init_kv_cache first"
        self.batch.apply(plan)
        for seq_id in plan.finished_seq_ids:
            self.logits_processors.forget(seq_id)
        if self.drafter is not None:
            for seq_id in plan.finished_seq_ids + [n.seq_id for n in plan.new_seqs]:
                self.drafter.forget(seq_id)
        kv = self.kv_cache
        # the KV tier's saves first: this step may reuse their blocks (kv_manager.py's order)
        saved = [kv.read_block(b) for b in plan.tier_saves]
        kv.swap_out(plan.swap_out)
        kv.swap_in(plan.swap_in)
        for block_id, data in plan.tier_loads:
            kv.write_block(block_id, data)
        kv.copy_blocks(plan.block_copies)
        if plan.state_transfers:
            kv.state.run(plan.state_transfers)
        if not plan.chunks:
            empty = torch.empty(0, self.config.vocab_size, device=self.device)
            return StepLogits(sample=empty, prompt={}, plan=plan, saved_blocks=saved)
        if self.drafter is not None and any(c.num_draft_tokens for c in plan.chunks):
            drafts = self.drafter.propose(plan.chunks, self.batch, self.kv_cache, self.backend)
            plan = replace(plan, chunks=[replace(c, draft_token_ids=drafts[c.seq_id])
                                         if c.seq_id in drafts else c for c in plan.chunks])
        inputs = self.batch.prepare(plan.chunks, plan.state_snapshots)
        row_starts: dict[int, int] = {}
        row = 0
        for idx in inputs.order:
            row_starts[idx] = row
            row += plan.chunks[idx].num_query_tokens
        # Rows to project to the vocabulary: the last token of every sampling chunk (and each of
        # its drafts), plus every token of chunks that want prompt logprobs.
        wanted: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[int, int, int]] = []
        for idx, chunk in enumerate(plan.chunks):
            n, start = len(chunk.token_ids), row_starts[idx]
            if chunk.prompt_logprobs:
                prompt_rows.append((chunk.seq_id, len(wanted), n))
                wanted.extend(range(start, start + n))
            if chunk.sample_seq_ids:
                if chunk.prompt_logprobs:
                    sample_rows.append(len(wanted) - 1)
                else:
                    sample_rows.append(len(wanted))
                    wanted.append(start + n - 1)
                for j in range(chunk.num_draft_tokens):
                    sample_rows.append(len(wanted))
                    wanted.append(start + n + j)
        logit_idx = torch.tensor(wanted, dtype=torch.long, device=self.device)
        bucket = self.graphs.bucket_for(inputs) if self.graphs is not None else None
        if bucket is not None:  # a decode-only step: replayed from its bucket's graph
            logits = self.graphs.run(inputs, bucket)[logit_idx]
        else:
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_cache,
                                inputs.metas, self.backend, logit_idx)
        sampled = take_rows(logits, sample_rows)
        return StepLogits(sample=sampled,
                          prompt={sid: logits[s : s + n] for sid, s, n in prompt_rows},
                          plan=plan, saved_blocks=saved)

    def _sample(self, plan: StepPlan, logits: StepLogits) -> RunnerOutput:
        """Sample every sampling chunk's sequences. A chunk with drafts samples each of its
        positions as if the drafts before it were the sequence's outputs (their penalties,
        bans and seeded draws are those a plain decode would have at that position), then
        keeps the drafts its samples agree with and the first sample that disagrees. For a
        draft that is a single token, this is rejection sampling: the token at each position
        has the target distribution, and a seeded request gets the tokens it gets without
        speculation."""
        out = RunnerOutput()
        rows = sampling_rows(plan, self.batch.seqs)
        if rows.seq_ids:
            result = self._run_sampler(plan, logits, rows)
            for seq_id, token, lp in zip(rows.seq_ids, result.sampled_token_ids,
                                         result.logprobs, strict=True):
                out.sampled_token_ids[seq_id] = [token]
                if lp is not None:
                    out.logprobs[seq_id] = [lp]
            self._keep_accepted_drafts(rows, result, out)
        self._prompt_logprobs(plan, logits, out)
        return out

    def _run_sampler(self, plan: StepPlan, logits: StepLogits,
                     rows: SamplingRows) -> SamplerOutput:
        """The sampler over the sampling rows, custom logits processors included."""
        states = [self.batch.seqs[s] for s in rows.seq_ids]
        meta = SamplingMetadata.from_params(
            [s.params for s in states], rows.histories,
            [s.num_prompt_tokens for s in states], self.config.vocab_size,
            indices=[s.index for s in states], device=self.device,
            grammar=grammar_rows(plan, rows),
        )
        sample = take_rows(logits.sample, rows.rows)
        procs = self.logits_processors
        if not procs:
            return self.sampler(sample, meta, None)
        procs.update(rows.seq_ids, [s.params for s in states],
                     [s.token_ids[: s.num_prompt_tokens] for s in states],
                     [s.token_ids[s.num_prompt_tokens:] for s in states])
        result = self.sampler(sample, meta, lambda x: procs.apply(x, meta.all_greedy))
        procs.record(rows.seq_ids, result.sampled_token_ids)
        return result

    def _keep_accepted_drafts(self, rows: SamplingRows, result: SamplerOutput,
                              out: RunnerOutput) -> None:
        """Per chunk with drafts: the drafts its samples agree with, then the first sample
        that disagrees (model/spec/draft_acceptance.py)."""
        tokens_of, logprobs_of = result.sampled_token_ids, result.logprobs
        for chunk, first in rows.spec:
            seq_id, drafts = chunk.seq_id, chunk.draft_token_ids
            kept = accept_drafts(drafts, tokens_of[first : first + len(drafts) + 1])
            out.sampled_token_ids[seq_id] = kept
            if logprobs_of[first] is not None:
                out.logprobs[seq_id] = logprobs_of[first : first + len(kept)]
            # the runner knows the tokens whose K/V it wrote: the accepted drafts
            self.batch.seqs[seq_id].token_ids.extend(drafts[: len(kept) - 1])
            if self.drafter is not None:
                self.drafter.accepted(seq_id, chunk.context_len - 1, len(kept) - 1)

    def _prompt_logprobs(self, plan: StepPlan, logits: StepLogits, out: RunnerOutput) -> None:
        for chunk in plan.chunks:
            if chunk.prompt_logprobs:
                state = self.batch.seqs[chunk.seq_id]
                # row t of the chunk predicts prompt token start + t + 1
                end = min(chunk.context_len, state.num_prompt_tokens - 1)
                targets = state.token_ids[chunk.start_pos + 1 : end + 1]
                k = state.params.prompt_logprobs or 0
                out.prompt_logprobs[chunk.seq_id] = (
                    compute_logprobs(logits.prompt[chunk.seq_id][: len(targets)], targets, k)
                    if targets else []
                )
