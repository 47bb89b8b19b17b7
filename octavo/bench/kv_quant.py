"""`octavo bench kvquant`: quantized KV pages (kv_cache_dtype int8 / fp8) against the model
dtype's pages, same model, same run, same threads.

Quality (the embedded model, or --model): 20 prompts, each with the `auto` engine's greedy
continuation of 128 tokens; prompt and continuation go through each engine in one prefill
(teacher forcing: every position attends to the K/V as that engine stores them), and at each of
the 20 x 128 positions the next-token distribution is compared with `auto`'s: top-1 agreement
and the mean KL(p_auto || p_quant). The issue's bars: top-1 >= 99% for int8, >= 97% for
fp8_e4m3. --quick: 4 prompts x 32 tokens, int8 and fp8_e4m3.

The control row, `auto + noise`: `auto` pages, with every K and V value the attention layers
hand the backend multiplied by (1 + 1e-6 n), n ~ N(0, 1) seeded, far below any 8-bit rounding.
It is the floor of the measure on the model's path: where the weights' matmuls quantize their
activations per block (GGUF blocks, int8 weights), any change of the input, however small,
rounds some activations the other way, and the logits move by an activation rounding step
whatever the change's size; the formats' rows are read against it. (With the weights in the
model dtype, `--quantization none`, the path is continuous and the control agrees fully.)

Speed: long-context decode, where a step is bound by reading K/V: one sequence at an 8k context
and 16 sequences at 2k (--quick: one at 512, auto and int8), random token prompts. One
engine per KV format prefills the same prompts, then their decode steps are timed in 3 windows
of WINDOW_STEPS steps after a warm-up window, interleaved between the engines; tok/s is the
median window's, counting the tokens its steps produced (every sequence has room to run to
the last window, and the fewest running in any window is recorded). The CPU's flags and each
engine's kernel path are recorded.

--workload picks parts: `quality`, `1x8k` (one sequence, long context), `16x2k` (16
sequences); all three by default (a 1.5B model's 16 x 2k prefill takes a long while on 2 cores).
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

import torch
from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, md_table, median
from octavo.bench.engine_run import greedy_params, make_llm
from octavo.bench.options import BenchOptions
from octavo.bench.quant import PROMPTS, sequence_logits
from octavo.engine_args import EngineArgs
from octavo.llm import LLM
from octavo.sampling_params import SamplingParams

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
SPEED_FORMATS = ("auto", "int8", "fp8_e4m3")
CONTINUATION = 128
WINDOW_STEPS, WINDOWS = 16, 3
BARS = {"int8": 0.99, "fp8_e4m3": 0.97}
CONTROL, NOISE = "auto + noise", 1e-6


def perturb_kv(llm: LLM, eps: float, seed: int = 0) -> LLM:
    """The control engine: its attention backend sees every K and V value times
    (1 + eps * n), n ~ N(0, 1) from a seeded generator; the pages keep the model dtype."""
    backend = llm.engine.executor.runner.backend
    forward, gen = backend.forward, torch.Generator().manual_seed(seed)

    def noisy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any
              ) -> torch.Tensor:
        k = k * (1 + eps * torch.randn(k.shape, generator=gen).to(k.device, k.dtype))
        v = v * (1 + eps * torch.randn(v.shape, generator=gen).to(v.device, v.dtype))
        return forward(q, k, v, *args, **kw)

    backend.forward = noisy
    return llm


def continuation_logprobs(llm: LLM, refs: list[list[int]], prompts: list[list[int]]
                          ) -> list[torch.Tensor]:
    """Per prompt, [len(continuation), vocab] log-probabilities at the positions that predict
    the continuation, from one prefill of prompt + continuation (teacher forcing)."""
    out = []
    for p, r in zip(prompts, refs, strict=True):
        span = slice(len(p) - 1, len(p) + len(r) - 1)
        out.append(sequence_logits(llm, p + r)[span].log_softmax(-1))
    return out


def quality(base: list[torch.Tensor], quant: LLM, refs: list[list[int]],
            prompts: list[list[int]]) -> dict[str, Any]:
    """`quant` against the `auto` engine's log-probabilities `base` (continuation_logprobs)."""
    agree, kls = [], []
    for a, b in zip(base, continuation_logprobs(quant, refs, prompts), strict=True):
        agree.append((a.argmax(-1) == b.argmax(-1)).float())
        kls.append((a.exp() * (a - b)).sum(-1))
    top1, kl = torch.cat(agree), torch.cat(kls)
    return {"top1_agreement": top1.mean().item(), "mean_kl": kl.mean().item(),
            "max_kl": kl.max().item(), "positions": top1.numel()}


def model_max_len(model: str | None) -> int:
    from octavo.config import ModelConfig
    from octavo.model.sources import resolve_model_dir

    return ModelConfig.from_dir(resolve_model_dir(model)).max_len[0]


def decode_speeds(opts: BenchOptions, formats: tuple[str, ...], num_seqs: int, context: int
                  ) -> list[dict[str, Any]]:
    """Decode tok/s of `num_seqs` sequences whose prompts are `context` tokens long, one engine
    per KV format, all prefilled first, then their timed windows interleaved (window w of every
    engine before window w + 1 of any), so that a machine whose speed drifts favours none."""
    vocab = workloads.SMOLLM2_VOCAB if not opts.model else 256
    # the sequences prefilled first decode while the later ones prefill, a token a step, and
    # a step gives the prefills at least the budget less the decodes: room for those tokens,
    # so that every sequence still runs in the last timed window
    budget = int(opts.engine_overrides.get("max_num_batched_tokens",
                                           EngineArgs().max_num_batched_tokens))
    early = -(-num_seqs * context // max(1, budget - num_seqs)) + num_seqs
    steps = WINDOW_STEPS * (WINDOWS + 1) + early
    context = min(context, model_max_len(opts.model) - steps - 2)  # a small --model
    total = context + steps + 2
    blocks = num_seqs * -(-total // 16) + 4
    rng = random.Random(opts.seed)
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(num_seqs)]
    runs = []
    for name in formats:
        llm = make_llm(opts.model, overrides=opts.engine_overrides, dtype=opts.dtypes[0],
                       kv_cache_dtype=name, num_kv_blocks=blocks, max_model_len=total,
                       max_num_seqs=max(num_seqs, 1))
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"s{i}", {"prompt_token_ids": prompt}, greedy_params(steps + 2))
        started: set[str] = set()
        t0 = time.perf_counter()
        while len(started) < num_seqs:  # every prompt prefilled: the next steps are decodes
            for out in engine.step():
                if out.outputs[0].token_ids:
                    started.add(out.request_id)
        runs.append({"llm": llm, "kv_cache_dtype": name, "rates": [],
                     "prefill_s": time.perf_counter() - t0})
    for w in range(WINDOWS + 1):
        for r in runs:
            engine = r["llm"].engine
            made = 0  # the tokens the window's steps produced (a finished sequence adds none)
            t = time.perf_counter()
            for _ in range(WINDOW_STEPS):
                made += sum(1 for out in engine.step() if out.outputs[0].token_ids)
            if w:  # the first window warms up
                r["rates"].append(made / (time.perf_counter() - t))
                r["running"] = min(r.get("running", num_seqs), made // WINDOW_STEPS)
    results = []
    for r in runs:
        llm = r.pop("llm")
        for i in range(num_seqs):
            llm.engine.abort_request(f"s{i}")
        results.append({"kv_cache_dtype": r["kv_cache_dtype"], "num_seqs": num_seqs,
                        "context": context, "decode_tok_s": median(r["rates"]),
                        "windows_tok_s": [round(x, 2) for x in r["rates"]],
                        "min_running": r["running"],
                        "prefill_s": r["prefill_s"],
                        "kv_bytes_per_token": llm.stats()["kv_bytes_per_token"],
                        "kernel_path": llm.engine.kernel_path()})
        del llm
    gc.collect()
    return results


PARTS = ("quality", "1x8k", "16x2k")


def quality_part(opts: BenchOptions, texts: list[str], continuation: int) -> dict[str, Any]:
    # room for every prompt and its continuation at once, not the default 1 GiB per engine
    sized = dict(dtype=opts.dtypes[0], num_kv_blocks=len(texts) * -(-(64 + continuation) // 16))
    base = make_llm(opts.model, overrides=opts.engine_overrides, **sized)
    tokenizer = base.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in texts]
    params = SamplingParams(temperature=0, max_tokens=continuation, ignore_eos=True,
                            detokenize=False)
    refs = [o.outputs[0].token_ids for o in base.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    path = base.engine.kernel_path()
    out: dict[str, Any] = {"quality": {}, "model_dtype": path["dtype"], "kernel_path": path,
                           "auto_kv_bytes_per_token": base.stats()["kv_bytes_per_token"]}
    # one engine at a time: a 1.5B model's fp32 weights (--quantization none) twice over
    # would not fit beside the log-probabilities on a small machine
    base_logprobs = continuation_logprobs(base, refs, prompts)
    del base
    gc.collect()
    for name in (CONTROL, *FORMATS[:opts.pick(2, len(FORMATS))]):
        quant = (perturb_kv(make_llm(opts.model, overrides=opts.engine_overrides, **sized),
                            NOISE) if name == CONTROL else
                 make_llm(opts.model, overrides=opts.engine_overrides, kv_cache_dtype=name,
                          **sized))
        out["quality"][name] = {**quality(base_logprobs, quant, refs, prompts),
                                "kv_bytes_per_token": quant.stats()["kv_bytes_per_token"]}
        del quant
        gc.collect()
    return out


def run(opts: BenchOptions) -> tuple[BenchResult, Any]:
    t0 = time.perf_counter()
    parts = opts.parts("kvquant", PARTS)
    continuation = opts.pick(32, CONTINUATION)
    texts = PROMPTS[:opts.pick(4, len(PROMPTS))]
    results: dict[str, Any] = {"quality": {}, "speed": []}
    if "quality" in parts:
        results.update(quality_part(opts, texts, continuation))
    cases = ([(1, opts.pick(512, 8128))] if "1x8k" in parts else []) + (
        [(16, 2000)] if "16x2k" in parts and not opts.quick else [])
    for num_seqs, context in cases:
        results["speed"] += decode_speeds(opts, SPEED_FORMATS[:opts.pick(2, 3)], num_seqs,
                                          context)
    md = [md_table(
        ["kv_cache_dtype", "bytes/token", "x auto",
         f"top-1 agreement % ({len(texts)} x {continuation})", "bar",
         "mean KL", "max KL"],
        [[n, r["kv_bytes_per_token"], results.get("auto_kv_bytes_per_token", 0) /
          r["kv_bytes_per_token"], r["top1_agreement"] * 100,
          f">= {BARS[n] * 100:.0f}%: {'met' if r['top1_agreement'] >= BARS[n] else 'NOT met'}"
          if n in BARS else "-", r["mean_kl"], r["max_kl"]]
         for n, r in results["quality"].items()], digits=4), ""]
    if CONTROL in results["quality"]:
        md += [f"`{CONTROL}`: `auto` pages with every K and V value times (1 + {NOISE:g} n), the "
               "measure's floor on this model's path (a format's row at it is as close to "
               "`auto` as the path can show).", ""]
    rows = []
    for r in results["speed"]:
        base_rate = next(s["decode_tok_s"] for s in results["speed"]
                         if s["kv_cache_dtype"] == "auto" and s["num_seqs"] == r["num_seqs"])
        rows.append([f"{r['num_seqs']} x {r['context']}", r["kv_cache_dtype"],
                     r["kv_bytes_per_token"], r["decode_tok_s"],
                     r["decode_tok_s"] / base_rate, ", ".join(map(str, r["windows_tok_s"])),
                     r["min_running"], r["prefill_s"]])
    md.append(md_table(["sequences x context", "kv_cache_dtype", "bytes/token",
                        "decode tok/s (median)", "x auto", "windows",
                        "fewest running in a window", "prefill s"], rows, digits=3))
    config = {"prompts": len(texts), "continuation": continuation,
              "window_steps": WINDOW_STEPS, "windows": WINDOWS,
              "threads": torch.get_num_threads(), "model": opts.model or "SmolLM2-135M"}
    return (BenchResult("kvquant", opts.command, config, results, "\n".join(md),
                        elapsed_s=time.perf_counter() - t0), plot)


def plot(results: dict[str, Any], fig: Figure) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    names = list(results["quality"])
    ax1.bar(names, [results["quality"][n]["top1_agreement"] * 100 for n in names])
    ax1.set_ylim(90, 100)
    ax1.set_ylabel("top-1 agreement with auto KV (%)")
    labels = [f"{r['num_seqs']}x{r['context']}\n{r['kv_cache_dtype']}" for r in results["speed"]]
    ax2.bar(labels, [r["decode_tok_s"] for r in results["speed"]])
    ax2.set_ylabel("decode tok/s")
    ax2.tick_params(axis="x", labelsize=7)
