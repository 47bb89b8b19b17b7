"""Speculative decoding (n-gram prompt lookup): output tok/s with and without it.

Cases, each run with every way in turn inside each repeat (interleaved, medians reported):

- **grounded**, single stream: chat requests whose answer copies its input (a Python function
  from the standard library, to be repeated with a comment above each line), greedy, up to 256
  tokens, stopping at EOS. The input-grounded case n-gram drafting is for.
- **mixed**, single stream: the random-token `mixed` prompts, greedy, 128 tokens (ignore_eos).
- **mixed, sampled**, single stream: the same at temperature 1 (seeded): outputs that rarely
  repeat, so drafts are rare and mostly wrong; the cost model must keep the loss away.
- **mixed, batch**: every `mixed` request at once (the throughput setting), greedy: a draft
  token costs nearly a whole token of compute there, so the cost model must hold drafting back.

Ways: `off` (no speculation), `ngram` (the cost model on, the default) and, where the cost
model matters, `ngram, no cost model` (every draft found is sent); on `grounded` also
`self_draft` (the model's first quarter of layers and its LM head drafting 4 tokens, with the
cost model), for a model with no smaller sibling. Single-stream requests run
one after another; output tok/s counts every output token over the wall time (prefill
included), decode tok/s the tokens after the first over the time after the first. Greedy and
seeded outputs must be identical across the ways; the table says whether they were.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table, median
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.options import BenchOptions
from octavo.sampling_params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
SELF_DRAFT = {"method": "self_draft", "num_speculative_tokens": 4}
WAYS = {"off": None, "ngram": SPEC, "ngram, no cost model": {**SPEC, "cost_model": False},
        "self_draft": SELF_DRAFT}
GOAL_GROUNDED = 2.0  # x off, single stream
GOAL_NO_LOSS = 0.97  # x off where speculation cannot help


def grounded_sources(count: int, max_chars: int) -> list[str]:
    """Source of standard-library functions (fixed for a Python version): the input."""
    import difflib
    import json
    import random
    import shlex
    import statistics
    import string
    import textwrap

    funcs = [textwrap.dedent, textwrap.indent, shlex.quote, statistics.median,
             difflib.get_close_matches, string.capwords, random.Random.shuffle, json.dump]
    out = []
    for f in funcs[:count]:
        lines = [line for line in inspect.getsource(f).splitlines() if line.strip()]
        out.append("\n".join(lines)[:max_chars])
    return out


def grounded_prompts(llm, count: int, max_chars: int) -> list[list[int]]:
    prompts = []
    for src in grounded_sources(count, max_chars):
        messages = [{"role": "user", "content": (
            f"Here is a Python function:\n\n```python\n{src}\n```\n\nRewrite it with a short "
            "comment above each line. Keep the code unchanged.")}]
        prompts.append(llm.apply_chat_template(messages))
    return prompts


def single_stream(llm, prompts: list[list[int]], params: list[SamplingParams]
                  ) -> dict[str, Any]:
    """Requests one after another; totals and each output's tokens."""
    tokens, decode_tokens, decode_s = 0, 0, 0.0
    outputs = []
    t0 = time.perf_counter()
    for prompt, p in zip(prompts, params, strict=True):
        out = llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0]
        ids = out.outputs[0].token_ids
        outputs.append(list(ids))
        tokens += len(ids)
        decode_tokens += len(ids) - 1
        decode_s += out.metrics["finished_time"] - out.metrics["first_token_time"]
    elapsed = time.perf_counter() - t0
    return {"output_tok_s": tokens / elapsed, "decode_tok_s": decode_tokens / decode_s,
            "tokens": tokens, "outputs": outputs}


def spec_counts(llm, before: dict[str, float]) -> dict[str, float]:
    s = llm.stats()
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens")
    return {k: s.get(k, 0) - before.get(k, 0) for k in keys}


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    repeats = opts.reps(1, 3)
    dtype = opts.dtypes[0]
    tiny = opts.model is not None
    vocab = 256 if tiny else workloads.SMOLLM2_VOCAB
    max_len = 512 if tiny else 2048
    llms = {way: make_llm(opts.model, dtype=dtype, overrides=opts.engine_overrides,
                          max_model_len=max_len, speculative_config=cfg)
            for way, cfg in WAYS.items()}
    first = llms["off"]
    n_single = opts.num_requests or opts.pick(2, 8)
    out_len = opts.pick(24, 128)
    mixed = workloads.mixed(n_single, output_len=out_len, max_prompt=120 if tiny else 512,
                            vocab=vocab, seed=opts.seed)
    mixed_prompts = [list(r.prompt_token_ids) for r in mixed.requests]
    batch = workloads.mixed(opts.num_requests or opts.pick(8, 64), output_len=out_len,
                            max_prompt=120 if tiny else 512, vocab=vocab, seed=opts.seed)
    greedy = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True,
                            detokenize=False)
    cases: dict[str, dict[str, Any]] = {
        "grounded": {"prompts": grounded_prompts(first, n_single, 300 if tiny else 1500),
                     "params": [SamplingParams(temperature=0, max_tokens=opts.pick(48, 256),
                                               detokenize=False)] * n_single,
                     "ways": ("off", "ngram", "self_draft"), "goal": GOAL_GROUNDED},
        "mixed": {"prompts": mixed_prompts, "params": [greedy] * n_single,
                  "ways": ("off", "ngram", "ngram, no cost model"), "goal": GOAL_NO_LOSS},
        "mixed, sampled": {
            "prompts": mixed_prompts,
            "params": [SamplingParams(temperature=1.0, seed=opts.seed + i, max_tokens=out_len,
                                      ignore_eos=True, detokenize=False)
                       for i in range(n_single)],
            "ways": ("off", "ngram", "ngram, no cost model"), "goal": GOAL_NO_LOSS},
        "mixed, batch": {"workload": batch, "ways": ("off", "ngram", "ngram, no cost model"),
                         "goal": GOAL_NO_LOSS},
    }
    warm = cases["grounded"]
    for llm in llms.values():
        single_stream(llm, warm["prompts"][:1], warm["params"][:1])
    samples: dict[str, dict[str, list[dict]]] = {c: {w: [] for w in spec["ways"]}
                                                 for c, spec in cases.items()}
    same: dict[str, bool] = {c: True for c in cases}
    for rep in range(repeats):
        for case, spec in cases.items():
            reference = None
            for way in spec["ways"]:
                llm = llms[way]
                before = llm.stats()
                if "workload" in spec:
                    r = run_workload(llm, spec["workload"], tag=f"{rep}-{way}-")
                    sample = {"output_tok_s": r.output_tok_s, "decode_tok_s": None,
                              "tokens": r.output_tokens}
                else:
                    res = single_stream(llm, spec["prompts"], spec["params"])
                    outputs = res.pop("outputs")
                    if reference is None:
                        reference = outputs
                    same[case] = same[case] and outputs == reference
                    sample = res
                sample.update(spec_counts(llm, before))
                samples[case][way].append(sample)
    rows = []
    for case, spec in cases.items():
        off = median([s["output_tok_s"] for s in samples[case]["off"]])
        for way in spec["ways"]:
            xs = samples[case][way]
            drafted = sum(s["spec_decode_num_draft_tokens"] for s in xs)
            accepted = sum(s["spec_decode_num_accepted_tokens"] for s in xs)
            decode = [s["decode_tok_s"] for s in xs if s["decode_tok_s"] is not None]
            row = {"case": case, "way": way,
                   "output_tok_s": median([s["output_tok_s"] for s in xs]),
                   "decode_tok_s": median(decode) if decode else None,
                   "draft_tokens_per_rep": drafted / len(xs),
                   "acceptance": accepted / drafted if drafted else None,
                   "runs": [round(s["output_tok_s"], 1) for s in xs]}
            row["x_off"] = row["output_tok_s"] / off
            row["goal"] = spec["goal"] if way == "ngram" else None
            rows.append(row)
    kernel = first.engine.runner.kernel_path()
    md = [
        f"{dtype}, {opts.threads} threads, prefix caching off, median of {repeats} "
        f"interleaved repeats. Speculation: `{SPEC}`; self_draft: `{SELF_DRAFT}`. "
        f"Kernel path: `{kernel}`.",
        "",
        md_table(["case", "way", "output tok/s", "x off", "decode tok/s", "draft tokens",
                  "accepted", "goal", "runs"],
                 [[r["case"], r["way"], r["output_tok_s"], f"{r['x_off']:.2f}",
                   "" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}",
                   f"{r['draft_tokens_per_rep']:.0f}",
                   "" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
                   "" if r["goal"] is None else f">= {r['goal']}x",
                   " / ".join(map(str, r["runs"]))] for r in rows], 1),
        "",
        "Same tokens with and without speculation (greedy and seeded, single stream): "
        + ", ".join(f"{c}: {'yes' if ok else 'NO'}" for c, ok in same.items()
                    if "workload" not in cases[c]) + ".",
    ]
    result = BenchResult(
        "spec_decode", opts.command,
        {"dtype": dtype, "threads": opts.threads, "repeats": repeats, "speculative": SPEC,
         "self_draft": SELF_DRAFT,
         "single_stream_requests": n_single, "output_len": out_len,
         "mixed": mixed.describe(), "batch": batch.describe(), "kernel_path": kernel},
        {"rows": rows, "samples": samples, "same_tokens": same},
        "\n".join(md), elapsed_s=time.perf_counter() - t0)
    return result, plot


def plot(results: dict, fig: Figure) -> None:
    rows = results["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    ways = list(dict.fromkeys(r["way"] for r in rows))
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(ways)
    for j, way in enumerate(ways):
        xs, ys = [], []
        for i, case in enumerate(cases):
            for r in rows:
                if r["case"] == case and r["way"] == way:
                    xs.append(i + (j - (len(ways) - 1) / 2) * width)
                    ys.append(r["x_off"])
        ax.bar(xs, ys, width, label=way, color=f"C{j}")
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="0.4", lw=1)
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("output tok/s, x no speculation (median)")
    ax.set_title("n-gram speculative decoding")
    ax.legend(loc="upper right")
