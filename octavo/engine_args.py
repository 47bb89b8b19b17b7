"""EngineArgs: every engine option, once, with its default, type, help text and validation.

`LLM(**kwargs)` and the flags of `octavo serve | generate | chat | demo | bench` are generated
from the fields below, so an option exists everywhere as soon as it exists here, and the
defaults live nowhere else. Validation runs at construction, before any weight loads, and names
the option the way the caller spelled it: `block_size` from Python, `--block-size` from the
command line. A neutral module: stdlib only, so the CLI parses and fails fast without torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from octavo.config import SchedulerConfig, SpeculativeConfig
from octavo.options import (
    OptionError,
    add_flags,
    at_least,
    check_options,
    flag,
    option,
    options_from_flags,
)

SUPPORTED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class EngineArgsError(OptionError):
    """A bad engine option; `option` is its field name (the CLI shows it as a flag)."""


_opt = option
_at_least = at_least


def _fraction(v: float) -> str | None:
    return None if 0.0 < v <= 1.0 else f"must be in (0, 1], got {v}"


def _speculative(v: dict | None) -> str | None:
    if v is None:
        return None
    try:
        SpeculativeConfig.from_dict(v)
    except ValueError as e:
        return str(e)
    return None


def _redis_url(v: str | None) -> str | None:
    if v is None or v.startswith(("redis://", "rediss://", "unix://")):
        return None
    return f"must be a redis://, rediss:// or unix:// URL, got {v!r}"


def _device(v: str) -> str | None:
    return None if _DEVICE.match(v) else f"must be 'cpu', 'cuda' or 'cuda:N', got {v!r}"


@dataclass(frozen=True, slots=True)
class EngineArgs:
    # -- model ----------------------------------------------------------------------------
    model: str | None = _opt(
        None, "local HF Llama-family directory (default: the embedded SmolLM2-135M-Instruct)")
    dtype: str = _opt(
        "auto", "weights, activations and KV cache dtype; auto: the checkpoint's, with bf16 "
        "only on CPUs that compute it natively (else float32; see model/dtype_policy.py)",
        choices=SUPPORTED_DTYPES)
    device: str = _opt("cpu", "cpu, cuda or cuda:N", check=_device)
    seed: int = _opt(0, "seed of the global RNG (unseeded sampling)")
    max_model_len: int | None = _opt(
        None, "longest sequence, prompt plus output (default: what the model and the KV cache "
        "allow)", check=_at_least(1))
    # -- KV cache -------------------------------------------------------------------------
    block_size: int = _opt(16, "tokens per KV block", choices=SUPPORTED_BLOCK_SIZES)
    num_kv_blocks: int | None = _opt(
        None, "KV blocks to allocate (overrides the memory-based sizing)", check=_at_least(1))
    kv_cache_memory_bytes: int | None = _opt(
        None, "KV cache size in bytes (default: 1 GiB on CPU; on CUDA what "
        "gpu_memory_utilization leaves after the weights)", check=_at_least(1))
    gpu_memory_utilization: float = _opt(
        0.9, "share of the GPU's memory the engine may use, weights included", check=_fraction)
    swap_space: float | None = _opt(
        None, "host memory for swapped-out KV blocks, GiB (default with preemption_mode=swap: "
        "4, as vLLM, and at most as many blocks as the device has; else none)",
        check=_at_least(0))
    kv_cache_dtype: str = _opt(
        "auto", "how K/V are stored: auto (the model dtype), int8 (symmetric, an fp32 scale per "
        "token and KV head in the page), fp8 / fp8_e4m3 / fp8_e5m2 (float8 with a scale per "
        "layer and KV head: the checkpoint's k_scale/v_scale, else from a calibration prompt "
        "at start-up); 8-bit pages hold about twice the tokens of bf16 ones",
        choices=KV_CACHE_DTYPES)
    kv_smooth_keys: bool = _opt(
        True, "int8 / fp8 KV pages: keys centred on their per-channel mean from the "
        "calibration prompt and rotated by a Hadamard matrix (queries alike) before they are "
        "quantized; exact but for rounding, and it keeps a model's few large key channels "
        "from setting every scale (off: keys quantized as computed)")
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of identical prompt prefixes")
    num_state_slots: int | None = _opt(
        None, "models with recurrent layers: state slots, one per running sequence plus those "
        "holding prefix-cache snapshots (default: max_num_seqs, twice that with prefix "
        "caching, within half the KV cache memory)", check=_at_least(1))
    kv_offload_dir: str | None = _opt(
        None, "a directory for the KV tier below the pool: full prefix-cache blocks are "
        "written there in the background, and a prefix the pool no longer holds is loaded back "
        "instead of recomputed; it outlives the server, and several servers of the same model "
        "may share it (a block's record holds every tensor-parallel rank's shard, and is read "
        "back only at the tensor_parallel_size that wrote it)")
    kv_offload_url: str | None = _opt(
        None, "a remote KV tier instead of a directory, for servers on several machines: "
        "redis://host:port/db (Redis or Valkey; bound it with the server's maxmemory and "
        "maxmemory-policy allkeys-lru)", check=_redis_url)
    kv_offload_bytes: int | None = _opt(
        None, "the size bound of kv_offload_dir; the least recently used blocks go first "
        "(default: 16 GiB)", check=_at_least(1))
    kv_offload_write: str = _opt(
        "free", "when a block goes to the KV tier: free (when its last request lets go of it: "
        "a restart or another server finds it at once) or evict (only when the pool needs its "
        "memory: fewer writes)", choices=("free", "evict"))
    kv_allocator: str = _opt(
        "paged", "paged, or the contiguous reserve-up-front baseline (for benchmarks)",
        choices=("paged", "contiguous"))
    contiguous_reserve: str = _opt(
        "max_model_len", "what the contiguous baseline reserves per sequence",
        choices=("max_model_len", "request"))
    # -- scheduler ------------------------------------------------------------------------
    max_num_seqs: int = _opt(256, "sequences running at once", check=_at_least(1))
    max_num_batched_tokens: int = _opt(
        2048, "tokens per engine step; longer prompts are prefilled in chunks",
        check=_at_least(1))
    long_prefill_token_threshold: int = _opt(
        0, "a prompt takes at most this many tokens of one step's budget (vLLM's name; 0: the "
        "whole budget), so a long prefill cannot stretch the steps every decode waits for",
        check=_at_least(0))
    max_num_partial_prefills: int = _opt(
        0, "prompts prefilled in the same step at most (vLLM's name; 0: as many as the budget "
        "allows); the others wait, so the decodes' steps stay short", check=_at_least(0))
    preemption_mode: str = _opt("recompute", "what a preempted request gives up",
                                choices=("recompute", "swap"))
    scheduling_policy: str = _opt("fcfs", "fcfs, or priority (lower value first)",
                                  choices=("fcfs", "priority"))
    speculative_config: dict | None = _opt(
        None, "speculative decoding, vLLM's dict (JSON on the command line), e.g. "
        "{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}",
        check=_speculative)
    # -- parallelism ----------------------------------------------------------------------
    tensor_parallel_size: int = _opt(
        1, "ranks that each hold a slice of every layer (heads, MLP units, vocabulary) and "
        "all-reduce twice per layer", check=_at_least(1))
    distributed_executor_backend: str | None = _opt(
        None, "who runs the ranks: uni (this process; tensor_parallel_size 1), mp (a worker "
        "process per rank on this machine) or ray (Ray actors over a Ray cluster, joined "
        "through RAY_ADDRESS) (default: uni for one rank, mp for more)",
        choices=("uni", "mp", "ray"))
    # -- kernels --------------------------------------------------------------------------
    attention_backend: str = _opt(
        "auto", "auto, torch (gather + SDPA), cpu (octavo's compiled paged-attention "
        "kernels) or triton (octavo's Triton kernels; auto on CUDA where Triton is installed)",
        choices=("auto", "torch", "cpu", "triton"))
    linear_backend: str = _opt(
        "auto", "auto, torch or onednn (pre-packed oneDNN weights on CPU)",
        choices=("auto", "torch", "onednn"))
    fused_ops: str = _opt("auto", "auto, torch, cpu or triton (fused RMSNorm / RoPE / "
                          "SiLU-and-mul)", choices=("auto", "torch", "cpu", "triton"))
    quantization: str | None = _opt(
        "auto", "quantized weights: auto (a GGUF file's own blocks, gguf, for a model given "
        "as a GGUF file or an installed model's name, but for the embedded default model; "
        "none elsewhere), none (None from Python: every weight in the model dtype, a GGUF's "
        "dequantized), int8 (W8A8 at load: every linear layer, the LM head included, int8 "
        "weights with per-channel scales, activations quantized per token, int8 GEMMs through "
        "oneDNN), int4 (weight-only at load: 4-bit groups of --quantization-group-size with a "
        "float16 scale and min, widened in registers; the LM head in 8-bit blocks), gguf (a "
        "GGUF model's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights kept in their blocks and computed "
        "directly, the other types dequantized at load)",
        choices=("auto", "none", "int8", "int4", "gguf"))
    quantization_group_size: int = _opt(
        32, "int4: weights per scale and min (32, as llama.cpp's Q4 formats; 64 or 128)",
        choices=(32, 64, 128))
    enforce_eager: bool = _opt(
        False, "never replay decode steps from CUDA graphs (on CUDA with the Triton backend "
        "they are captured per batch-size bucket at start-up)")
    cpu_isa: str = _opt(
        "auto", "instruction set of the compiled CPU kernels: auto (the CPU's best), avx512, "
        "avx2 or portable", choices=("auto", "avx512", "avx2", "portable"))
    packed_gemv_rows: int | None = _opt(
        None, "steps of up to this many rows run octavo's GEMV on the oneDNN-packed weights "
        "(0: never, oneDNN's GEMM throughout; default: the kernel's own limit)",
        check=_at_least(0))
    decode_stack: bool = _opt(
        True, "run an all-decode step's layers in one C++ loop on CPU where the model allows "
        "(off: the Python layers, the same kernels in the same order)")
    logits_processors: tuple = _opt(
        (), "custom logits processors (octavo.model.sample.logits_processor.LogitsProcessor "
        "subclasses, or their names as pkg.module:Class; comma-separated on the command line)")

    def __post_init__(self) -> None:
        if isinstance(self.logits_processors, list):  # LLM(logits_processors=[...])
            object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        if self.quantization == "none":  # the command line's spelling of None
            object.__setattr__(self, "quantization", None)
        check_options(self, EngineArgsError)
        if self.speculative_config is not None and self.logits_processors:
            # a custom processor keeps per-sequence state a step of several positions breaks
            raise EngineArgsError("speculative_config", "cannot be combined with "
                                  "logits_processors")
        if self.quantization not in (None, "auto"):
            if not self.device.startswith("cpu"):
                raise EngineArgsError("quantization", f"{self.quantization!r} runs on CPU only "
                                      "(its kernels are octavo's and oneDNN's CPU ones)")
            if self.tensor_parallel_size > 1:
                raise EngineArgsError("quantization", "cannot be combined with "
                                      "tensor_parallel_size > 1 yet")
        self._check_kv_offload()
        if self.tensor_parallel_size > 1:
            if self.distributed_executor_backend == "uni":
                raise EngineArgsError("distributed_executor_backend", "uni runs one rank; "
                                      f"tensor_parallel_size={self.tensor_parallel_size} "
                                      "needs mp or ray")
            spec = self.speculative()
            if spec is not None and spec.method != "ngram":
                raise EngineArgsError("speculative_config", f"method {spec.method!r} does not "
                                      "run with tensor_parallel_size > 1 yet (ngram does)")

    def _check_kv_offload(self) -> None:
        name = ("kv_offload_dir" if self.kv_offload_dir is not None
                else "kv_offload_url" if self.kv_offload_url is not None else None)
        if name is None:
            if self.kv_offload_bytes is not None:
                raise EngineArgsError("kv_offload_bytes", "bounds a KV tier directory: give "
                                      "kv_offload_dir too")
            return
        if self.kv_offload_dir is not None and self.kv_offload_url is not None:
            raise EngineArgsError("kv_offload_url", "give a KV tier directory or a URL, not "
                                  "both")
        if self.kv_offload_url is not None and self.kv_offload_bytes is not None:
            raise EngineArgsError("kv_offload_bytes", "bounds a KV tier directory; a Redis or "
                                  "Valkey tier is bounded by the server's maxmemory")
        if not self.enable_prefix_caching or self.kv_allocator != "paged":
            raise EngineArgsError(name, "the KV tier holds prefix-cache blocks: it needs "
                                  "enable_prefix_caching and the paged KV cache")

    @property
    def executor_backend(self) -> str:
        """distributed_executor_backend as resolved: uni for one rank, else mp unless given."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    # -- derived configs ------------------------------------------------------------------
    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """`max_model_len` is the resolved one (what the KV cache and the model allow)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_model_len=max_model_len,
            preemption_mode=self.preemption_mode,
            scheduling_policy=self.scheduling_policy,
            speculative=self.speculative(),
        )

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config (validated at construction)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def replace(self, **changes: Any) -> EngineArgs:
        return from_kwargs(**{**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


OPTION_NAMES = tuple(f.name for f in fields(EngineArgs))
# options whose None the command line spells "none" (their default is something else)
_NONE_SPELLED = {f.name for f in fields(EngineArgs) if "none" in (f.metadata.get("choices") or ())}


def from_kwargs(**kwargs: Any) -> EngineArgs:
    """EngineArgs from Python keywords, with a clear error for a misspelt name."""
    unknown = [k for k in kwargs if k not in OPTION_NAMES]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"unknown engine option {name!r}{hint} (options: "
                        f"{', '.join(OPTION_NAMES)})")
    return EngineArgs(**kwargs)


# -- command line -----------------------------------------------------------------------------
def add_cli_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                 exclude: Iterable[str] = (), overrides_only: bool = False) -> None:
    """One flag per option. `overrides_only`: no defaults, so only the flags given show up in
    the namespace (for `octavo bench`, whose benchmarks choose their own engine settings)."""
    add_flags(parser, EngineArgs, exclude=exclude, overrides_only=overrides_only)


def from_cli_args(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from a parsed namespace; a bad value is reported with its flag."""
    return options_from_flags(EngineArgs, ns)


def to_cli_flags(options: dict[str, Any]) -> list[str]:
    """The command-line spelling of some options (for a subprocess such as `octavo serve`)."""
    out: list[str] = []
    for name, value in options.items():
        if name not in OPTION_NAMES:
            raise TypeError(f"unknown engine option {name!r}")
        if isinstance(value, bool):
            out.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif isinstance(value, dict):
            out += [flag(name), json.dumps(value)]
        elif isinstance(value, tuple):
            if value:
                out += [flag(name), ",".join(v if isinstance(v, str) else
                                             f"{v.__module__}:{v.__qualname__}" for v in value)]
        elif value is None and name in _NONE_SPELLED:  # None that is not the default
            out += [flag(name), "none"]
        elif value is not None:
            out += [flag(name), str(value)]
    return out


def cli_overrides(ns: argparse.Namespace, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The engine flags given on the command line (see add_cli_args(overrides_only=True)),
    less `exclude` (names the caller's own flags use)."""
    skip = set(exclude)
    return {n: getattr(ns, n) for n in OPTION_NAMES if n not in skip and hasattr(ns, n)}
