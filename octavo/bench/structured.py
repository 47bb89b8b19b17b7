"""Structured outputs' cost: a JSON-schema workload at batch 32 against the same work
unconstrained, in the same run.

The constrained run asks 32 requests (the six schemas of json_schemas.py in turn, temperature
1.0, seeded) for JSON; each one's output length is recorded. The unconstrained run then asks
the same prompts for exactly those lengths (ignore_eos), so both runs generate the same tokens
per request at the same batch: the difference is the grammar (masks computed on a thread
during the forward pass, applied in the sampler, tokens consumed by the matchers). Repeats
alternate the two; medians are reported, with every output validated by jsonschema.
"""

from __future__ import annotations

import json
import time

from matplotlib.figure import Figure

from octavo.bench.common import BenchResult, PlotFn, md_table, median
from octavo.bench.engine_run import make_llm
from octavo.bench.json_schemas import SCHEMAS
from octavo.bench.options import BenchOptions
from octavo.sampling_params import SamplingParams, StructuredOutputsParams

BATCH = 32
MAX_TOKENS = 400


def prompts(llm, n: int) -> list[tuple[str, str]]:
    """(schema name, chat prompt) pairs, the schemas in turn."""
    names = list(SCHEMAS)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        text = llm.engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write one example {name} record as JSON "
              f"(request {i})."}], tokenize=False, add_generation_prompt=True)
        out.append((name, text))
    return out


def validate(name: str, text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    dtype = opts.dtypes[0]
    n = opts.num_requests or opts.pick(16, BATCH)
    repeats = opts.reps(2, 5)
    llm = make_llm(opts.model, overrides=opts.engine_overrides, dtype=dtype,
                   max_num_seqs=BATCH, max_model_len=2048)
    batch = prompts(llm, n)
    texts = [p for _, p in batch]

    def constrained(rep: int) -> list[SamplingParams]:
        return [SamplingParams(temperature=1.0, seed=opts.seed + 1000 * rep + i,
                               max_tokens=MAX_TOKENS,
                               structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]))
                for i, (name, _) in enumerate(batch)]

    llm.generate(texts[:4], constrained(99)[:4], use_tqdm=False)  # warm: compile, tokenizer
    rows: dict[str, list[dict]] = {"json_schema": [], "unconstrained": []}
    valid = total = 0
    invalid: list[dict] = []
    for rep in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(texts, constrained(rep), use_tqdm=False)
        elapsed = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        for (name, _), o in zip(batch, outs, strict=True):
            c = o.outputs[0]
            if validate(name, c.text):
                valid += 1
            else:  # kept for the report: which schema, why it ended, how it ends
                invalid.append({"schema": name, "finish_reason": c.finish_reason,
                                "tokens": len(c.token_ids), "tail": c.text[-80:]})
        total += len(outs)
        rows["json_schema"].append({"elapsed_s": elapsed, "tokens": sum(lengths)})
        free = [SamplingParams(temperature=1.0, seed=opts.seed + 1000 * rep + i, max_tokens=k,
                               ignore_eos=True) for i, k in enumerate(lengths)]
        start = time.perf_counter()
        outs = llm.generate(texts, free, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rows["unconstrained"].append({"elapsed_s": elapsed,
                                      "tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
    summary = {}
    for kind, runs in rows.items():
        summary[kind] = {"median_tok_s": median([r["tokens"] / r["elapsed_s"] for r in runs]),
                         "tok_s": [r["tokens"] / r["elapsed_s"] for r in runs],
                         "tokens": [r["tokens"] for r in runs]}
    ratio = summary["json_schema"]["median_tok_s"] / summary["unconstrained"]["median_tok_s"]
    overhead = 1 - ratio
    md = [
        f"{opts.model or 'SmolLM2-135M-Instruct'} {dtype}, {n} requests at batch {BATCH} over "
        f"the {len(SCHEMAS)} schemas of octavo/bench/json_schemas.py (temperature 1.0, "
        f"seeded), median of {repeats} alternating repeats; the unconstrained run generates "
        "exactly the constrained run's output lengths.",
        "",
        md_table(["workload", "median output tok/s", "tok/s per repeat"],
                 [[kind, s["median_tok_s"], " ".join(f"{x:.0f}" for x in s["tok_s"])]
                  for kind, s in summary.items()]),
        "",
        f"Constrained / unconstrained throughput: {ratio:.3f} (overhead {100 * overhead:.1f}%, "
        f"goal <= 10%). Outputs that parse and validate: {valid}/{total}"
        + (": the others ended by " + ", ".join(
            f"{i['finish_reason']} after {i['tokens']} tokens ({i['schema']}, ...{i['tail']!r})"
            for i in invalid) if invalid else "."),
    ]
    res = BenchResult("structured", opts.command,
                      {"requests": n, "batch": BATCH, "repeats": repeats, "dtype": dtype,
                       "grammar_backend": "llguidance",
                       "kernel_path": llm.engine.runner.kernel_path()},
                      {"summary": summary, "ratio": ratio, "overhead": overhead,
                       "valid": valid, "total": total, "invalid": invalid},
                      "\n".join(md), elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(results: dict, fig: Figure) -> None:
    s = results["summary"]
    ax = fig.add_subplot(1, 1, 1)
    kinds = list(s)
    ax.bar(kinds, [s[k]["median_tok_s"] for k in kinds], color=["#4c72b0", "#8c8c8c"])
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title(f"JSON-schema decoding at batch {BATCH}: overhead "
                 f"{100 * results['overhead']:.1f}%")
