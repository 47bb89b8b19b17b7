"""The KV tier: what a restart costs a long prefix with and without it, and what its writes
cost the `mixed` workload.

- restart: a server computes a long prompt (a prefix of 4096 tokens plus 16 of its own) and
  stops; a new server on the same tier directory gets the same prompt. Its time to first token
  (prefill plus one decode, max_tokens=1) against the first server's cold one, and the prompt
  tokens it took from the tier. Each repeat uses a fresh prompt and a fresh directory.
- load: `mixed` with prefix caching on, without a tier and with one (kv_offload_write=free:
  every full block of every request is written as the request finishes, the most writes the
  tier makes), interleaved repeats on fresh prompts (no repeat hits another's blocks, so the
  tier costs its writes and gives nothing back). Output tokens per second; a run with the tier
  lasts until its last write is on disk. Each repeat draws its own trace, so the tier's cost is
  the median over repeats of the ratio within a repeat (both engines ran the same trace).

--workload restart / load runs one part alone.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table, median
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.options import BenchOptions
from octavo.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _llm(opts: BenchOptions, max_model_len: int, **kw: Any):
    return make_llm(opts.model, overrides=opts.engine_overrides, dtype=opts.dtypes[0],
                    enable_prefix_caching=True, max_model_len=max_model_len, **kw)


def _ttft(llm, prompt: list[int]) -> float:
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN, use_tqdm=False)
    return time.perf_counter() - t


def restart(opts: BenchOptions, prefix_len: int, vocab: int, repeats: int) -> list[dict]:
    runs = []
    max_len = prefix_len + 64
    for rep in range(repeats):
        rng = random.Random(opts.seed * 1000 + rep)
        prompt = [rng.randrange(3, vocab) for _ in range(prefix_len + 16)]
        root = Path(tempfile.mkdtemp(prefix="octavo-kv-tier-"))
        try:
            first = _llm(opts, max_len, kv_offload_dir=str(root))
            cold = _ttft(first, prompt)
            written = first.engine.tier.flush(600)
            first.engine.shutdown()
            del first
            t = time.perf_counter()
            second = _llm(opts, max_len, kv_offload_dir=str(root))
            start_s = time.perf_counter() - t
            warm = _ttft(second, prompt)
            s = second.stats()
            runs.append({"cold_s": cold, "tier_s": warm, "start_s": start_s,
                         "flushed": written, "prompt_tokens": len(prompt),
                         "tier_hit_tokens": s["tier_hit_tokens"],
                         "tier_bytes_read": s["tier_bytes_read"],
                         "tier_read_s": s["tier_read_seconds"]})
            second.engine.shutdown()
            del second
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return runs


def model_shape(opts: BenchOptions) -> tuple[int, bool]:
    """The model's vocabulary size, and whether it is a tiny test model (under 2k positions)."""
    from octavo.config import ModelConfig
    from octavo.model.sources import resolve_model_dir

    cfg = ModelConfig.from_dir(resolve_model_dir(opts.model))
    return cfg.vocab_size, cfg.max_len[0] < 2048


def load(opts: BenchOptions, repeats: int, vocab: int, tiny: bool) -> dict[bool, list[dict]]:
    root = Path(tempfile.mkdtemp(prefix="octavo-kv-tier-"))
    raw: dict[bool, list[dict]] = {False: [], True: []}
    try:
        llms = {False: _llm(opts, 2048 if not tiny else 512),
                True: _llm(opts, 2048 if not tiny else 512, kv_offload_dir=str(root))}
        for rep in range(repeats):
            wl = trace(opts, rep, vocab, tiny)
            order = (False, True) if rep % 2 == 0 else (True, False)
            for on in order:
                llm = llms[on]
                before = llm.stats()
                r = run_workload(llm, wl, tag=f"r{rep}-")
                # the writes still queued count against the run (they would compete with
                # the next one), as if the run waited for them
                t = time.perf_counter()
                if llm.engine.tier is not None:
                    llm.engine.tier.flush(600)
                flush_s = time.perf_counter() - t
                elapsed = r.elapsed_s + flush_s
                after = llm.stats()
                raw[on].append({
                    "elapsed_s": elapsed, "output_tok_s": r.output_tokens / elapsed,
                    "flush_wait_s": flush_s,
                    "blocks_written": after.get("tier_blocks_written", 0)
                    - before.get("tier_blocks_written", 0),
                    "bytes_written": after.get("tier_bytes_written", 0)
                    - before.get("tier_bytes_written", 0),
                    "dropped": after.get("tier_blocks_write_dropped", 0)
                    - before.get("tier_blocks_write_dropped", 0)})
        for llm in llms.values():
            llm.engine.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return raw


def trace(opts: BenchOptions, rep: int, vocab: int, tiny: bool) -> workloads.Workload:
    return workloads.mixed(num_requests=opts.num_requests or opts.pick(16, 64),
                           output_len=opts.pick(32, 128), max_prompt=256 if tiny else 512,
                           vocab=vocab, seed=opts.seed * 1000 + 100 + rep)


PARTS = ("restart", "load")


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    parts = opts.parts("kv_tier", PARTS)
    vocab, tiny = model_shape(opts)
    prefix_len = 256 if tiny else opts.pick(1024, 4096)
    repeats = opts.reps(1, 3)
    name = opts.model or "SmolLM2-135M-Instruct"
    wl = trace(opts, 0, vocab, tiny)
    md = [f"{name} {opts.dtypes[0]}, block size 16, {repeats} repeat(s), medians.", ""]
    results: dict = {}
    if "restart" in parts:
        rs = restart(opts, prefix_len, vocab, repeats)
        cold, warm = median([r["cold_s"] for r in rs]), median([r["tier_s"] for r in rs])
        results.update(restart=rs, ttft_cold_s=cold, ttft_tier_s=warm, ttft_speedup=cold / warm)
        md += [
            f"Restart on a {prefix_len + 16}-token prompt ({prefix_len}-token prefix): time to "
            "first token (prefill + 1 token).",
            "",
            md_table(["run", "cold s", "after restart, from the tier s", "speedup",
                      "tier hit tokens", "tier MB read", "read+check s", "server start s"],
                     [[i, r["cold_s"], r["tier_s"], r["cold_s"] / r["tier_s"],
                       r["tier_hit_tokens"], r["tier_bytes_read"] / 1e6, r["tier_read_s"],
                       r["start_s"]] for i, r in enumerate(rs)]),
            "",
            f"TTFT after a restart: {warm:.3f} s from the tier vs {cold:.3f} s cold "
            f"({cold / warm:.1f}x).",
            ""]
    if "load" in parts:
        raw = load(opts, repeats, vocab, tiny)
        tps = {on: median([r["output_tok_s"] for r in runs]) for on, runs in raw.items()}
        # each repeat is its own trace (fresh prompts of other lengths): the tier's cost is
        # the ratio within a repeat, where both engines ran the same trace
        paired = [b["output_tok_s"] / a["output_tok_s"]
                  for a, b in zip(raw[False], raw[True], strict=True)]
        load_ratio = median(paired)
        results.update(load={str(k): v for k, v in raw.items()},
                       out_tok_s={"off": tps[False], "on": tps[True]}, paired_ratios=paired,
                       load_ratio=load_ratio)
        md += [
            f"`mixed` ({wl.describe()}), prefix caching on, interleaved: the tier's writes "
            "(kv_offload_write=free).",
            "",
            md_table(["tier", "median out tok/s", "out tok/s", "blocks written / run",
                      "MB written / run", "dropped"],
                     [["on" if on else "off", tps[on],
                       " ".join(f"{r['output_tok_s']:.1f}" for r in runs),
                       median([r["blocks_written"] for r in runs]),
                       median([r["bytes_written"] for r in runs]) / 1e6,
                       sum(r["dropped"] for r in runs)] for on, runs in raw.items()]),
            "",
            "Throughput with the tier's writes / without, median of the repeats' paired "
            f"ratios ({' '.join(f'{x:.3f}' for x in paired)}): {load_ratio:.3f} "
            f"({100 * (load_ratio - 1):+.1f}%); ratio of the medians "
            f"{tps[True] / tps[False]:.3f}. Waiting for the last writes: "
            f"{median([r['flush_wait_s'] for r in raw[True]]):.2f} s per run (median)."]
    res = BenchResult("kv_tier", opts.command,
                      {"prefix_len": prefix_len, "repeats": repeats, "dtype": opts.dtypes[0],
                       "trace": wl.describe(), "parts": parts},
                      results, "\n".join(md), elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(results: dict, fig: Figure) -> None:
    shown = [k for k in ("ttft_speedup", "load_ratio") if k in results]
    if "ttft_speedup" in results:
        ax = fig.add_subplot(1, len(shown), 1)
        ax.bar(["cold", "from the tier"], [results["ttft_cold_s"], results["ttft_tier_s"]],
               color=["#8c8c8c", "#4c72b0"])
        ax.set_ylabel("time to first token after a restart, s")
        ax.set_title(f"{results['ttft_speedup']:.1f}x faster from the tier")
    if "load_ratio" in results:
        ax = fig.add_subplot(1, len(shown), len(shown))
        tps = results["out_tok_s"]
        ax.bar(["no tier", "tier writes"], [tps["off"], tps["on"]],
               color=["#8c8c8c", "#4c72b0"])
        ax.set_ylabel("mixed: output tok/s (median)")
        ax.set_title(f"{100 * (results['load_ratio'] - 1):+.1f}% with the tier's writes")
