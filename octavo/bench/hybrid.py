"""Decode cost against context: a tiny hybrid model (Gated DeltaNet + attention, Qwen3.5) and a
plain transformer of the same size (Qwen3), each at 512 and 8k tokens of context.

Both are random-weight models built here with transformers (no checkpoint of either family is
available offline) with the same hidden size, layers, heads and MLP; the hybrid's layers are
three Gated DeltaNet layers to each attention layer, as Qwen3.5's are. One sequence at a time: a
prompt of the context length, then greedy decoding of a fixed number of tokens (ignore_eos).
Decode tok/s is the decoded tokens over the time they took beyond the prefill: a run of 1 + N
output tokens minus a run of 1 (prefill and first token), median of the repeats. Prefix caching
is on, so after the warm-up every run finds the prompt cached (the hybrid: its KV blocks and its
state snapshot) and the long prefill is not paid again for each timing. A recurrent layer's
decode step costs the same at any context (its state is fixed in size), so the hybrid should
lose less speed from 512 to 8k than the plain model, whose every layer reads the whole KV cache.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from octavo.bench.common import BenchResult, md_table, median
from octavo.bench.engine_run import greedy_params, make_llm
from octavo.bench.options import BenchOptions

SIZE = dict(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=16384, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
HYBRID = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
              linear_value_head_dim=32, linear_conv_kernel_dim=4,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                               "partial_rotary_factor": 0.25})
MODELS = {"hybrid (qwen3_5, 6 DeltaNet + 2 attention)": ("Qwen3_5TextConfig",
                                                         "Qwen3_5ForCausalLM", HYBRID),
          "plain (qwen3, 8 attention)": ("Qwen3Config", "Qwen3ForCausalLM", {})}
CONTEXTS = (512, 8192)


def byte_tokenizer(path: Path) -> None:
    """A tokenizer whose 256 tokens are the bytes (the prompts are token ids: it is never used
    to encode, but the engine loads one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(chars))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=sorted(chars)[1],
                            eos_token=sorted(chars)[2]).save_pretrained(path)


def build(path: Path, config_cls: str, model_cls: str, extra: dict[str, Any]) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**SIZE, **extra)
    getattr(transformers, model_cls)(config).eval().save_pretrained(path)
    byte_tokenizer(path)
    return path


def timed(llm, prompt: list[int], tokens: int) -> float:
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], greedy_params(tokens), use_tqdm=False)
    return time.perf_counter() - t0


def run(opts: BenchOptions) -> tuple[BenchResult, Any]:
    t0 = time.perf_counter()
    repeats = opts.repeats or (1 if opts.quick else 3)
    decode = 16 if opts.quick else 64
    contexts = (512, 2048) if opts.quick else CONTEXTS
    rng = random.Random(opts.seed)
    prompts = {n: [rng.randrange(3, 256) for _ in range(n)] for n in contexts}
    rows, kernels = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config_cls, model_cls, extra) in MODELS.items():
            path = build(Path(tmp) / model_cls, config_cls, model_cls, extra)
            llm = make_llm(str(path), overrides=opts.engine_overrides,
                           max_model_len=max(contexts) + decode + 1,
                           enable_prefix_caching=True)
            path_info = llm.engine.runner.kernel_path()
            kernels[name] = {k: path_info.get(k) for k in ("isa", "attention", "fused_ops",
                                                              "linear", "decode_loop")}
            stats = llm.stats()
            for n in contexts:
                timed(llm, prompts[n], 2)  # warm-up
                samples = []
                for _ in range(repeats):
                    first = timed(llm, prompts[n], 1)
                    full = timed(llm, prompts[n], 1 + decode)
                    samples.append(decode / max(full - first, 1e-9))
                rows.append({"model": name, "context": n, "decode_tok_s": median(samples),
                             "runs": [round(x, 1) for x in samples],
                             "kv_bytes_per_token": stats.get("kv_bytes_per_token"),
                             "state_bytes_per_slot": stats.get("state_bytes_per_slot", 0)})
            del llm
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"] and x["context"] == contexts[0])
        r["x_short_context"] = r["decode_tok_s"] / base["decode_tok_s"]
    md = [f"fp32, {opts.threads} threads, one sequence, {decode} decoded tokens, median of "
          f"{repeats}; both models {SIZE['num_hidden_layers']} layers of hidden size "
          f"{SIZE['hidden_size']}. Kernel paths: "
          + "; ".join(f"{m}: `{k}`" for m, k in kernels.items()) + ".", "",
          md_table(["model", "context", "decode tok/s", f"x at {contexts[0]}",
                    "KV bytes / token", "state bytes / sequence", "runs"],
                   [[r["model"], r["context"], r["decode_tok_s"],
                     f"{r['x_short_context']:.2f}", r["kv_bytes_per_token"],
                     r["state_bytes_per_slot"], " / ".join(map(str, r["runs"]))]
                    for r in rows], 1)]
    result = BenchResult("hybrid", opts.command,
                         {"size": SIZE, "hybrid": HYBRID, "contexts": list(contexts),
                          "decode_tokens": decode, "repeats": repeats, "kernel_paths": kernels},
                         {"rows": rows}, "\n".join(md), elapsed_s=time.perf_counter() - t0)
    return result, plot


def plot(results: dict, fig: Figure) -> None:
    ax = fig.add_subplot(1, 1, 1)
    models = list(dict.fromkeys(r["model"] for r in results["rows"]))
    for i, model in enumerate(models):
        pts = [(r["context"], r["decode_tok_s"]) for r in results["rows"] if r["model"] == model]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=model)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title("decode speed against context: hybrid vs plain")
    ax.legend()
