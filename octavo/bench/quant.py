"""`octavo bench quant`: quantized weights against the fp32 model, same run, same threads.

Quality (the embedded model, or --model):
- greedy agreement over 200 tokens on 20 prompts: each prompt's fp32 greedy continuation is fed
  back through the quantized model (teacher forcing) and its top-1 token compared with fp32's
  at each of the 200 positions; also the mean length of the identical prefix when both models
  generate freely;
- the mean KL divergence KL(p_fp32 || p_quant) of the next-token distributions at every
  position of a fixed text.

Schemes: int8 (W8A8), int4 (weight-only, groups of --quantization-group-size) and gguf (the
GGUF file's own Q4_1/Q8_0 blocks; skipped for a model given as an HF directory). The fp32
baseline of the embedded model is its GGUF dequantized at load, so gguf differs from it only
by the int8 activations of its kernels.

Speed: single stream (llama-bench's pp256/tg128: prefill tok/s of a 256-token prompt, then
generation tok/s of 128 new tokens) and offline throughput on `mixed`, fp32 against each scheme,
medians of repeats, the CPU's flags and the kernel path recorded.
"""

from __future__ import annotations

import gc
import random
from dataclasses import replace
from typing import Any

import torch
from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, md_table, median
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.options import BenchOptions
from octavo.llm import LLM
from octavo.sampling_params import SamplingParams
from octavo.step_plan import NewSeq, SeqChunk, StepPlan

SCHEMES = ("int8", "int4", "gguf")  # gguf: when the model came from a GGUF file
PROMPTS = [
    "The history of the printing press begins", "Photosynthesis is the process by which",
    "Write a short poem about the sea.", "def quicksort(arr):", "The three laws of motion are",
    "Explain what a hash table is.", "Once upon a time, in a small village,",
    "The capital cities of Europe include", "To make bread at home, first",
    "The difference between a virus and a bacterium is", "List five prime numbers:",
    "In economics, inflation means", "The Moon orbits the Earth because",
    "A good way to learn a new language is", "SELECT name FROM users WHERE",
    "The water cycle consists of", "Dear hiring manager,", "The French Revolution started in",
    "Machine learning models are trained by", "Here is a recipe for tomato soup:",
]
FIXED_TEXT = (
    "The library stood at the end of a narrow street, its stone steps worn smooth by two "
    "centuries of readers. Inside, the air smelled of paper and dust, and the light fell in "
    "long bars across the reading tables. Most visitors came for the maps: charts of coasts "
    "that had since moved, rivers that had changed their course, and cities whose names were "
    "now spelled differently. The librarian, who had worked there for forty years, kept a "
    "ledger of every request. She could tell you which map had been asked for most often "
    "(a survey of the harbour from 1851) and which had never been asked for at all. When the "
    "city proposed to move the collection to a modern building with climate control and "
    "digital catalogues, she did not object. She only asked that the reading tables come "
    "too, because, she said, people think better at a table that other people have thought "
    "at before them. The tables were moved on a Sunday in March, one at a time, on a cart "
    "pulled by two volunteers, and the maps followed in boxes numbered by hand."
)
GREEDY_TOKENS = 200


def sequence_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] fp32 logits at every position (position t predicts token t+1),
    from one prefill of the whole sequence through the engine's runner."""
    runner = llm.engine.executor.runner
    assert runner is not None
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    n = -(-len(tokens) // runner.block_size)
    # one block table per KV cache group (local and global layers), on distinct blocks
    tables = [list(range(g * n, (g + 1) * n)) for g in range(len(runner.batch.windows))]
    plan = StepPlan([SeqChunk(0, list(tokens), 0, (), True)],
                    [NewSeq(0, list(tokens), len(tokens), 0, params, tables[0], tables[1:])])
    logits = runner.forward(plan).prompt[0].float()
    runner.forward(StepPlan([], [], finished_seq_ids=[0]))
    return logits


def quality(base: LLM, quant: LLM, tokenizer) -> dict[str, Any]:
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                            detokenize=False)
    ref = [o.outputs[0].token_ids for o in base.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    free = [o.outputs[0].token_ids for o in quant.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    agree, prefixes = [], []
    for p, r, f in zip(prompts, ref, free, strict=True):
        seq = p + r
        top1 = sequence_logits(quant, seq)[len(p) - 1 : len(seq) - 1].argmax(-1)
        agree.append((top1 == torch.tensor(r)).float().mean().item())
        prefixes.append(next((i for i, (a, b) in enumerate(zip(r, f, strict=True)) if a != b),
                             len(r)))
    text = tokenizer.encode(FIXED_TEXT)
    p_log = sequence_logits(base, text).log_softmax(-1)
    q_log = sequence_logits(quant, text).log_softmax(-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return {"teacher_forced_top1_agreement": sum(agree) / len(agree),
            "per_prompt_agreement": [round(a, 3) for a in agree],
            "mean_identical_prefix_tokens": sum(prefixes) / len(prefixes),
            "mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "kl_text_tokens": len(text)}


def speed(llm: LLM, opts: BenchOptions, repeats: int) -> dict[str, Any]:
    vocab = workloads.SMOLLM2_VOCAB if not opts.model else 256
    prompt_len, new = 256, opts.pick(32, 128)
    prefill, decode = [], []
    for rep in range(repeats + 1):  # the first is a warm-up
        rng = random.Random(opts.seed + rep)
        gen = tuple(rng.randrange(vocab) for _ in range(prompt_len))
        r1 = run_workload(llm, workloads.Workload("pp", (workloads.BenchRequest(gen, 1),),
                                                  2048), tag=f"p{rep}-")
        r = run_workload(llm, workloads.Workload("tg", (workloads.BenchRequest(gen, new),),
                                                 2048), tag=f"t{rep}-")
        if rep:
            prefill.append(prompt_len / r1.elapsed_s)
            decode.append((new - 1) / (r.elapsed_s - r1.elapsed_s))
    wl = workloads.mixed(opts.num_requests or opts.pick(8, 64), output_len=opts.pick(16, 128),
                         max_prompt=opts.pick(128, 512), vocab=vocab, seed=opts.seed)
    run_workload(llm, replace(wl, requests=wl.requests[:2]), tag="warm-")
    mixed = [run_workload(llm, wl, tag=f"m{rep}-").output_tok_s for rep in range(repeats)]
    return {"pp256_tok_s": median(prefill), "tg_tok_s": median(decode), "tg_tokens": new,
            "mixed_output_tok_s": median(mixed), "mixed_runs": [round(x, 1) for x in mixed],
            "mixed": wl.describe()}


def run(opts: BenchOptions) -> tuple[BenchResult, Any]:
    repeats = opts.reps(1, 3)
    results: dict[str, Any] = {}
    base = make_llm(opts.model, overrides=opts.engine_overrides, quantization=None)
    tokenizer = base.get_tokenizer()
    results["fp32"] = {**speed(base, opts, repeats),
                       "kernel_path": base.engine.kernel_path(),
                       "weights_bytes": base.stats()["weights_bytes"]}
    skipped = {}
    for scheme in SCHEMES:
        try:
            quant = make_llm(opts.model, overrides=opts.engine_overrides, quantization=scheme)
        except ValueError as e:  # gguf on a model that is not a GGUF file
            skipped[scheme] = str(e)
            continue
        results[scheme] = {**speed(quant, opts, repeats), **quality(base, quant, tokenizer),
                           "kernel_path": quant.engine.kernel_path(),
                           "weights_bytes": quant.stats()["weights_bytes"]}
        del quant
        gc.collect()
    fp32 = results["fp32"]
    rows = []
    for name, r in results.items():
        rows.append([name, r["weights_bytes"] / 2**20, r["pp256_tok_s"], r["tg_tok_s"],
                     r["tg_tok_s"] / fp32["tg_tok_s"], r["mixed_output_tok_s"],
                     r["mixed_output_tok_s"] / fp32["mixed_output_tok_s"],
                     r.get("teacher_forced_top1_agreement", 1.0) * 100,
                     r.get("mean_identical_prefix_tokens", GREEDY_TOKENS),
                     r.get("mean_kl", 0.0)])
    markdown = md_table(
        ["weights", "MiB", "pp256 tok/s", f"tg{fp32['tg_tokens']} tok/s", "tg x fp32",
         "mixed out tok/s", "mixed x fp32", "top-1 agreement % (teacher-forced, 20 x 200)",
         "identical prefix (tokens of 200)", "mean KL (fixed text)"], rows, digits=3)
    config = {"repeats": repeats, "threads": torch.get_num_threads(), "schemes": SCHEMES,
              "skipped": skipped,
              "prompts": len(PROMPTS), "greedy_tokens": GREEDY_TOKENS}
    return BenchResult("quant", opts.command, config, results, markdown), plot


def plot(results: dict[str, Any], fig: Figure) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    names = list(results)
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [results[n]["tg_tok_s"] for n in names], 0.4,
            label="single stream generation")
    ax1.bar([i + 0.2 for i in x], [results[n]["mixed_output_tok_s"] / 10 for n in names], 0.4,
            label="mixed offline / 10")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("output tokens/s")
    ax1.legend()
    ax2.bar(list(x), [results[n]["weights_bytes"] / 2**20 for n in names])
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("weights in memory (MiB)")
