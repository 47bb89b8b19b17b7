"""Offline throughput of one model in several weight formats, and vLLM, in one run.

    octavo bench throughput --model qwen2.5-coder-1.5b --workload mixed \
        --variant auto:gguf --variant bfloat16:none --peer vllm --peer-dtype bfloat16 ...

Each `--variant DTYPE:QUANTIZATION` is one octavo paged engine: DTYPE as `--dtype`, and
QUANTIZATION as the engine's `--quantization` (gguf: a GGUF file's blocks computed as stored;
none: every weight dequantized to the model dtype). All variants are built before any timing,
get the same KV budget in tokens and the same prompts, and their repeats are interleaved
(repeat r of every variant before repeat r+1 of any) so that load from other users of the
machine lands on all alike. vLLM, when asked for, runs after them in its own interpreter on
`--peer-hf-dir` (default: transformers' reading of the model) in `--peer-dtype`.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

from octavo.bench.common import BenchResult, PlotFn, md_table
from octavo.bench.options import BenchOptions

DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
VLLM_TIMEOUT_S = 7200  # an emulated bf16 peer on a CPU without bf16 takes its time


def parse_variant(text: str) -> tuple[str, str]:
    """`DTYPE[:QUANTIZATION]` (quantization defaults to auto); anything else is an error that
    names the flag and the accepted values."""
    dtype, _, quant = text.partition(":")
    quant = quant or "auto"
    if dtype not in DTYPES or quant not in QUANTIZATIONS:
        raise ValueError(f"--variant {text!r}: DTYPE[:QUANTIZATION] with DTYPE one of "
                         f"{', '.join(DTYPES)} and QUANTIZATION one of {', '.join(QUANTIZATIONS)}")
    return dtype, quant


def variant_label(dtype: str, quant: str, effective: str, method: str) -> str:
    """`auto (float32), gguf`: the dtype asked for (and computed in, where they differ) and
    the quantization asked for (and taken, where auto chose it)."""
    from octavo.bench.throughput import dtype_label

    return f"{dtype_label(dtype, effective)}, {dtype_label(quant, method)}"


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    from octavo.bench.engine_run import effective_dtype
    from octavo.bench.throughput import (
        MAX_MODEL_LEN,
        OctavoEngine,
        bench_workloads,
        interleaved,
        peer_kv_gib,
        peer_rows,
    )
    from octavo.bench.waste import KV_TOKENS
    from octavo.model.hf_reference import hf_reference_dir

    t0 = time.perf_counter()
    wls = bench_workloads(opts)
    repeats = opts.reps(1, 3)
    variants = [parse_variant(v) for v in opts.variants]
    if len(set(variants)) != len(variants):
        raise ValueError(f"--variant: each variant once, not {opts.variants}")
    engines: dict[str, OctavoEngine] = {}
    info: dict[str, dict[str, Any]] = {}
    for dtype, quant in variants:
        vopts = dataclasses.replace(
            opts, engine_overrides={**opts.engine_overrides, "quantization": quant})
        eff = effective_dtype(opts.model, dtype, vopts.engine_overrides)
        eng = OctavoEngine(vopts, dtype, "paged")
        path = eng.llm.engine.runner.kernel_path()
        label = variant_label(dtype, quant, eff, path["quantization"])
        engines[label] = eng
        info[label] = {"dtype": dtype, "effective_dtype": eff, "quantization": quant,
                       "weights_bytes": int(path["weights_bytes"]), "kernel_path": path}
    rows = []
    for r in interleaved(engines, wls, repeats, ""):  # keyed by label: "engine" is the label
        label = r.pop("engine")
        rows.append({**r, "engine": "octavo-paged", "variant": label,
                     **{k: info[label][k] for k in ("dtype", "effective_dtype", "quantization",
                                                    "weights_bytes")}})
    del engines, eng
    gc.collect()
    peer_dir = None
    if "vllm" in opts.peer:  # the HF directory vLLM reads
        peer_dir = opts.peer_hf_dir or str(hf_reference_dir(opts.model))
    if peer_dir is not None:
        for r in peer_rows(opts, opts.peer_dtype, wls, repeats, opts.peer_dtype,
                           model_dir=peer_dir, timeout_s=VLLM_TIMEOUT_S):
            rows.append({**r, "variant": f"{opts.peer_dtype}, HF directory",
                         "effective_dtype": opts.peer_dtype, "quantization": "none",
                         "weights_bytes": 0})
    for r in rows:
        same = [x for x in rows if x["workload"] == r["workload"]]
        r["x_first"] = r["output_tok_s"] / same[0]["output_tok_s"]
        vllm = [x for x in same if x["engine"].startswith("vllm")]
        r["x_vllm"] = r["output_tok_s"] / vllm[0]["output_tok_s"] if vllm else None
    md = [
        f"{opts.model or 'SmolLM2-135M-Instruct'}; octavo paged, KV budget {KV_TOKENS} tokens, "
        f"max_model_len {512 if opts.model else MAX_MODEL_LEN}, block size 16, prefix caching "
        f"off; {opts.threads} thread(s); "
        f"median of {repeats} repeats, interleaved between octavo's variants. Workloads: "
        + "; ".join(str(w.describe()) for w in wls),
        "",
        "octavo's kernel paths: " + "; ".join(
            f"{label}: " + ", ".join(f"{k} {v}" for k, v in i["kernel_path"].items())
            for label, i in info.items()),
        "",
        md_table(["workload", "engine", "weights, dtype", "weights MiB", "median s",
                  "out tok/s", "req/s", "x first", "x vLLM", "times s"],
                 [[r["workload"], r["engine"], r["variant"], r["weights_bytes"] / 2**20 if
                   r["weights_bytes"] else "-", r["median_s"], r["output_tok_s"], r["req_s"],
                   r["x_first"], "-" if r["x_vllm"] is None else r["x_vllm"],
                   " ".join(f"{t:.1f}" for t in r["times_s"])] for r in rows]),
    ]
    if peer_dir is not None:
        md += ["", f"vLLM read {peer_dir} in {opts.peer_dtype} "
               f"(max_model_len {MAX_MODEL_LEN}, {peer_kv_gib(opts, opts.peer_dtype)} GiB of "
               "KV cache, "
               "prefix caching off); its repeats run in its own process after octavo's."]
    config = {"workloads": [w.describe() for w in wls], "repeats": repeats,
              "variants": opts.variants, "kv_tokens": KV_TOKENS, "peer": opts.peer,
              "peer_dtype": opts.peer_dtype if peer_dir is not None else None,
              "kernel_path": {label: i["kernel_path"] for label, i in info.items()}}
    res = BenchResult("throughput", opts.command, config, {"variants": rows},
                      "\n".join(md), elapsed_s=time.perf_counter() - t0)
    from octavo.bench.throughput import plot

    return res, plot  # throughput's plot draws these rows too

