"""Every CPU kernel path on this machine: the same work through each ISA build (cpu_isa.py).

The machines this project runs on change (AVX-512 with native bf16 one day, AVX2 only the
next), so this benchmark runs octavo on each build this CPU can run, forcing the lower ones
(`cpu_isa=avx2`, `portable`) on a better CPU:

1. **decode attention**: the compiled paged-decode kernel of each build against torch's gather +
   SDPA, batch 32 x 512 tokens of context, the model's head shape, fp32 and bf16; and as in a
   whole decode step, where the K/V come from memory, not cache: 64 sequences of 40-640
   tokens, every layer with its own cache, blocks shuffled through the pool (GB/s of K/V read);
   **prefill attention**: one layer's attention over every prefill chunk of a step (K/V write
   included), the compiled paged-prefill kernel of each build (one call) against the torch
   backend (one SDPA per chunk, gathering the blocks of chunks that start past 0), for two
   steps: `prompts` (8 prompts of 32-512 tokens from position 0 and 2 chunked-prefill
   continuations of 256 tokens after 256 cached) and `verify` (64 sequences, each verifying
   4 speculative drafts: 5 query tokens after 200-700 cached); bf16 on a CPU with AVX-512
   bf16 dot products twice, on them and widened to fp32 as on a CPU without them;
   **decode linears** (decode_linears.py): one decode step's linear layers, octavo's
   packed_gemv against oneDNN on the same packed weights, 1 to 64 rows;
2. **single stream** (llama-bench's pp/tg shape: a 256-token prompt, 128 new tokens, greedy):
   prefill and generation tok/s, and a decode step split into the model's forward and the
   engine's own overhead (scheduling, batch preparation, sampling, output processing); on the
   best build once more with packed_gemv off (oneDNN for every linear layer); fp32, and where
   the CPU computes bf16 natively, bf16 on the best build with packed_gemv on and off;
3. **offline `mixed`**: output tok/s of the paged engine for each build, in fp32, `auto`, and
   bf16 asked for; on a path without native bf16 (`avx2`, `portable`) bf16 computes in fp32
   (model/dtype_policy.py), so that row shows what an AVX2 machine's user gets.

oneDNN (the linears) and torch's own kernels pick their ISA themselves from the CPU; forcing
octavo's path does not change theirs, so the lower rows measure octavo's kernels and the dtype
policy, not a whole AVX2 machine.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, md_table, median
from octavo.bench.decode_linears import decode_linear_rows
from octavo.bench.engine_run import effective_dtype, make_llm, run_workload
from octavo.bench.options import BenchOptions
from octavo.config import ModelConfig
from octavo.model.kernels.cpu_isa import native_bf16, supported_isas
from octavo.model.layers.attention import get_backend
from octavo.model.layers.attention.base import AttentionMetadata, PrefillChunk
from octavo.model.layers.attention.cpu_backend import CpuPagedAttentionBackend
from octavo.model.sources import resolve_model_dir

DECODE_BATCH, DECODE_CTX, BLOCK = 32, 512, 16


def decode_attention_rows(cfg: ModelConfig, repeats: int, ctx: int) -> list[dict]:
    heads, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    nb = -(-ctx // BLOCK)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.randn(DECODE_BATCH * nb + 1, BLOCK, kvh, hd, generator=gen).to(dtype)
        v = torch.randn_like(k)
        q = torch.randn(DECODE_BATCH, heads, hd, generator=gen).to(dtype)
        tables = torch.randperm(DECODE_BATCH * nb, generator=gen).view(DECODE_BATCH, nb)
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), DECODE_BATCH, tables,
                                 torch.full((DECODE_BATCH,), ctx), [])
        paths = [("torch", None), *(("cpu", isa) for isa in supported_isas())]
        for name, isa in paths:
            backend = get_backend(name, torch.device("cpu"), isa)
            ms = call_ms(backend._decode, (q, k, v, meta, hd**-0.5), repeats, 10)
            rows.append({"dtype": str(dtype).removeprefix("torch."),
                         "path": "torch (gather + SDPA)" if isa is None else f"kernel {isa}",
                         "ms": ms})
    return with_x_torch(rows, ("dtype",))


def decode_step_rows(cfg: ModelConfig, repeats: int, batch: int, layers: int) -> list[dict]:
    """Decode attention of a whole step: `layers` calls, each on its own cache (as many blocks
    as the batch needs, shuffled), so that K/V are read from memory as in a real step (one
    layer's cache alone stays in cache between calls and hides how the kernel streams)."""
    heads, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randint(40, 641, (batch,), generator=gen)
    nblocks = [-(-int(n) // BLOCK) for n in ctx]
    total = sum(nblocks)
    perm = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(batch, max(nblocks), dtype=torch.long)
    for b, nb in enumerate(nblocks):
        tables[b, :nb] = torch.tensor(perm[:nb])
        perm = perm[nb:]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        caches = [(torch.randn(total, BLOCK, kvh, hd, generator=gen).to(dtype),
                   torch.randn(total, BLOCK, kvh, hd, generator=gen).to(dtype))
                  for _ in range(layers)]
        q = torch.randn(batch, heads, hd, generator=gen).to(dtype)
        kv_bytes = 2 * int(ctx.sum()) * kvh * hd * dtype.itemsize * layers
        for isa in supported_isas():
            kernel = get_backend("cpu", torch.device("cpu"), isa).kernel
            ms = call_ms(_decode_step, (kernel, q, caches, tables, ctx, hd**-0.5), repeats, 3)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "path": f"kernel {isa}",
                         "batch": batch, "layers": layers, "ms": ms,
                         "kv_gb_s": kv_bytes / ms / 1e6})
        del caches
    return rows


def _decode_step(kernel, q, caches, tables, ctx, scale: float) -> None:
    for k, v in caches:
        kernel.paged_decode(q, k, v, tables, ctx, scale)


def call_ms(fn, args: tuple, repeats: int, calls: int) -> float:
    """Median over `repeats` of the mean ms of `calls` calls of `fn(*args)`, after one warm-up
    call."""
    with torch.inference_mode():
        fn(*args)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            times.append((time.perf_counter() - t) / calls)
    return 1e3 * median(times)


def with_x_torch(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Each row's speed-up over the torch row that agrees with it on `keys`."""
    for r in rows:
        base = next(x for x in rows if all(x[k] == r[k] for k in keys)
                    and x["path"].startswith("torch"))
        r["x_torch"] = base["ms"] / r["ms"]
    return rows


PREFILL_STEPS = {  # (cached tokens, new tokens) per chunk
    "prompts": [(0, n) for n in (32, 96, 160, 224, 288, 352, 416, 512)] + [(256, 256)] * 2,
    "verify": [(200 + 500 * i // 63, 5) for i in range(64)],
}


def prefill_paths(dtype: torch.dtype) -> list[tuple[str, Any]]:
    """(label, attention backend) for every prefill path of `dtype` this CPU runs: torch's
    SDPA per chunk, each ISA build's kernel, and for bf16 on a CPU with bf16 dot products that
    kernel both on them and widened to fp32 (as on a CPU without them)."""
    paths: list[tuple[str, Any]] = [("torch (SDPA per chunk)",
                                     get_backend("torch", torch.device("cpu")))]
    for isa in supported_isas():
        backend = get_backend("cpu", torch.device("cpu"), isa)
        if dtype == torch.bfloat16 and backend.kernel.prefill_bf16_dot():
            paths += [(f"kernel {isa} (bf16 dot products)", backend),
                      (f"kernel {isa} (widened to fp32)",
                       CpuPagedAttentionBackend(backend.kernel, bf16_dot=False))]
        else:
            paths.append((f"kernel {isa}", backend))
    return paths


def prefill_attention_rows(cfg: ModelConfig, repeats: int) -> list[dict]:
    heads, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    rows = []
    paths = {dtype: prefill_paths(dtype) for dtype in (torch.float32, torch.bfloat16)}
    for step, chunks in PREFILL_STEPS.items():
        nblocks = [-(-(c + n) // BLOCK) for c, n in chunks]
        perm = torch.randperm(sum(nblocks), generator=gen).tolist()
        prefills, slots, row = [], [], 0
        for (cached, new), nb in zip(chunks, nblocks, strict=True):
            table, perm = perm[:nb], perm[nb:]
            slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + new)]
            prefills.append(PrefillChunk(row, row + new, cached, torch.tensor(table)))
            row += new
        for dtype, dtype_paths in paths.items():
            k_cache = torch.randn(sum(nblocks), BLOCK, kvh, hd, generator=gen).to(dtype)
            v_cache = torch.randn_like(k_cache)
            qkv = torch.randn(row, heads + 2 * kvh, hd, generator=gen).to(dtype)
            q, k, v = qkv.split([heads, kvh, kvh], dim=1)  # strided views, as in the model
            for label, backend in dtype_paths:
                meta = AttentionMetadata(torch.tensor(slots), 0, None, None, prefills)
                ms = call_ms(backend.forward, (q, k, v, k_cache, v_cache, meta, hd**-0.5),
                             repeats, 5)
                rows.append({"step": step, "chunks": len(chunks), "query_tokens": row,
                             "dtype": str(dtype).removeprefix("torch."), "path": label,
                             "ms": ms})
    return with_x_torch(rows, ("step", "dtype"))


def timed_forward(llm) -> list[float]:
    """Wrap the model's forward to add up its time (the rest of a step is engine overhead)."""
    model = llm.engine.runner.model
    total = [0.0]
    inner = model.forward

    def forward(*args: Any, **kwargs: Any):
        t = time.perf_counter()
        out = inner(*args, **kwargs)
        total[0] += time.perf_counter() - t
        return out

    model.forward = forward
    return total


def single_stream_rows(opts: BenchOptions, isas: list[str], repeats: int) -> list[dict]:
    vocab = 256 if opts.model else workloads.SMOLLM2_VOCAB
    prompt_len, new = (100, 64) if opts.model else (256, opts.pick(32, 128))
    rows = []
    runs = [(isa, True, "float32") for isa in isas] + [(isas[0], False, "float32")]
    if native_bf16(isas[0]):
        runs += [(isas[0], True, "bfloat16"), (isas[0], False, "bfloat16")]
    for isa, gemv, dtype in runs:
        overrides = {**opts.engine_overrides, "cpu_isa": isa}
        if not gemv:
            overrides["packed_gemv_rows"] = 0
        llm = make_llm(opts.model, overrides=overrides, dtype=dtype,
                       max_model_len=512 if opts.model else 2048)
        forward_s = timed_forward(llm)
        prefill, decode, fwd, steps = [], [], [], []
        for rep in range(repeats + 1):  # the first is a warm-up
            rng = random.Random(opts.seed + rep)
            gen = tuple(rng.randrange(vocab) for _ in range(prompt_len))
            one = workloads.Workload("pp", (workloads.BenchRequest(gen, 1),), 2048)
            r1 = run_workload(llm, one, tag=f"p{rep}-")
            full = workloads.Workload("tg", (workloads.BenchRequest(gen, new),), 2048)
            forward_s[0] = 0.0
            r = run_workload(llm, full, tag=f"t{rep}-")
            if rep == 0:
                continue
            # decode = the whole run minus its prefill (measured alone just before)
            decode_s = r.elapsed_s - r1.elapsed_s
            prefill.append(prompt_len / r1.elapsed_s)
            decode.append((new - 1) / decode_s)
            fwd.append(forward_s[0] / r.steps)
            steps.append(r.step_s / r.steps)
        step_ms, fwd_ms = 1e3 * median(steps), 1e3 * median(fwd)
        path = llm.engine.runner.kernel_path()
        rows.append({"isa": isa, "dtype": dtype, "decode_linears": path["decode_gemv"],
                     "prompt": prompt_len,
                     "new_tokens": new,
                     "prefill_tok_s": median(prefill), "decode_tok_s": median(decode),
                     "step_ms": step_ms, "forward_ms": fwd_ms, "overhead_ms": step_ms - fwd_ms,
                     "kernel_path": path})
    return rows


def mixed_rows(opts: BenchOptions, isas: list[str], repeats: int) -> list[dict]:
    vocab = 256 if opts.model else workloads.SMOLLM2_VOCAB
    wl = workloads.mixed(opts.num_requests or opts.pick(8, 32), output_len=opts.pick(16, 64),
                         max_prompt=120 if opts.model else opts.pick(128, 512), vocab=vocab,
                         seed=opts.seed)
    rows = []
    for isa in isas:
        overrides = {**opts.engine_overrides, "cpu_isa": isa}
        for dtype in ("float32", "auto", "bfloat16"):
            llm = make_llm(opts.model, overrides=overrides, dtype=dtype,
                           max_model_len=512 if opts.model else 2048)
            run_workload(llm, workloads.Workload("warm", wl.requests[:2], 2048).capped(2),
                         tag="w")
            times = [run_workload(llm, wl, tag=f"r{i}-").elapsed_s for i in range(repeats)]
            t = median(times)
            rows.append({"isa": isa, "dtype": dtype,
                         "computes_in": effective_dtype(opts.model, dtype, overrides),
                         "median_s": t, "output_tok_s": wl.output_tokens / t,
                         "times_s": times})
            del llm
    for r in rows:
        base = next(x for x in rows if x["isa"] == r["isa"] and x["dtype"] == "float32")
        r["x_fp32"] = r["output_tok_s"] / base["output_tok_s"]
    return rows


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    repeats = opts.reps(1, 3)
    cfg = ModelConfig.from_dir(resolve_model_dir(opts.model))
    isas = supported_isas()
    attn = decode_attention_rows(cfg, repeats, opts.pick(128, DECODE_CTX))
    step_attn = decode_step_rows(cfg, repeats, opts.pick(8, 64), opts.pick(2, cfg.num_layers))
    prefill = prefill_attention_rows(cfg, repeats)
    linears = decode_linear_rows(cfg, isas, repeats, opts.pick(2, cfg.num_layers))
    single = single_stream_rows(opts, isas, repeats)
    mixed = mixed_rows(opts, isas, repeats)
    md = [
        f"{opts.model or 'SmolLM2-135M-Instruct'}; {opts.threads} thread(s); median of "
        f"{repeats}; ISA builds this CPU runs: {', '.join(isas)}.",
        "",
        f"Decode attention, batch {DECODE_BATCH} x {opts.pick(128, DECODE_CTX)} tokens, "
        f"block {BLOCK}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads x {cfg.head_dim}:",
        "",
        md_table(["dtype", "path", "ms / call", "x torch"],
                 [[r["dtype"], r["path"], r["ms"], r["x_torch"]] for r in attn], 3),
        "",
        f"Decode attention of a whole step: {opts.pick(8, 64)} sequences of 40-640 tokens, "
        f"{opts.pick(2, cfg.num_layers)} layers each with its own cache (K/V read from memory):",
        "",
        md_table(["dtype", "path", "ms / step", "K/V GB/s"],
                 [[r["dtype"], r["path"], r["ms"], r["kv_gb_s"]] for r in step_attn], 3),
        "",
        "Prefill attention, one layer, every prefill chunk of a step (K/V write included); "
        "`prompts`: 8 prompts of 32-512 tokens + 2 continuations of 256 after 256 cached; "
        "`verify`: 64 sequences x 5 query tokens after 200-700 cached:",
        "",
        md_table(["step", "chunks", "query tokens", "dtype", "path", "ms / call", "x torch"],
                 [[r["step"], r["chunks"], r["query_tokens"], r["dtype"], r["path"], r["ms"],
                   r["x_torch"]] for r in prefill], 3),
        "",
        f"Decode-sized linear layers: ms of one step's {opts.pick(2, cfg.num_layers)} "
        "layers' linears and the LM head (weights from memory), oneDNN against octavo's "
        "packed_gemv on the same packed weights; the engine gives packed_gemv the rows marked:",
        "",
        md_table(["isa", "dtype", "kernel", "rows", "oneDNN ms", "packed_gemv ms", "x oneDNN",
                  "engine takes it"],
                 [[r["isa"], r["dtype"], r["kernel"], r["rows"], r["onednn_ms"],
                   r["packed_gemv_ms"], r["x_onednn"], "yes" if r["engine_takes"] else "no"]
                  for r in linears], 3),
        "",
        "Single stream (prompt then greedy generation; a step split into the model's "
        "forward and the engine's overhead):",
        "",
        md_table(["isa", "dtype", "decode linears", "prompt", "new", "prefill tok/s",
                  "generation tok/s", "ms / step", "forward ms", "overhead ms"],
                 [[r["isa"], r["dtype"], r["decode_linears"], r["prompt"], r["new_tokens"],
                   r["prefill_tok_s"], r["decode_tok_s"], r["step_ms"], r["forward_ms"],
                   r["overhead_ms"]] for r in single]),
        "",
        "Offline `mixed`, paged engine, per ISA build and dtype asked for:",
        "",
        md_table(["isa", "dtype asked", "computes in", "median s", "out tok/s", "x fp32",
                  "times s"],
                 [[r["isa"], r["dtype"], r["computes_in"], r["median_s"], r["output_tok_s"],
                   r["x_fp32"], " ".join(f"{t:.1f}" for t in r["times_s"])] for r in mixed]),
    ]
    config = {"repeats": repeats, "isas": isas, "threads": opts.threads}
    res = BenchResult("cpu", opts.command, config,
                      {"decode_attention": attn, "decode_step_attention": step_attn,
                       "prefill_attention": prefill, "decode_linears": linears,
                       "single_stream": single, "mixed": mixed},
                      "\n".join(md), elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(results: dict, fig: Figure) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    attn = results["decode_attention"]
    labels = [f"{r['path'].replace('torch (gather + SDPA)', 'torch')}\n{r['dtype']}"
              for r in attn]
    ax1.bar(range(len(attn)), [r["ms"] for r in attn], color="#4c72b0")
    ax1.set_xticks(range(len(attn)), labels, fontsize=7)
    ax1.set_ylabel("ms per decode-attention call (lower is better)")
    ax1.set_title("decode attention per path")
    mixed = results["mixed"]
    ax2.bar(range(len(mixed)), [r["output_tok_s"] for r in mixed], color="#55a868")
    ax2.set_xticks(range(len(mixed)),
                   [f"{r['isa']}\n{r['dtype']}\n({r['computes_in']})" for r in mixed],
                   fontsize=6)
    ax2.set_ylabel("output tok/s (higher is better)")
    ax2.set_title("offline mixed per ISA build and dtype")
