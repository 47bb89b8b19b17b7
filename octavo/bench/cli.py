"""`octavo bench NAME [--quick] [--out DIR]`: run one benchmark (or `all`) and write its files.

Each benchmark module has `run(BenchOptions) -> (BenchResult, plot)`; this module only parses
flags, runs them in order, writes JSON / markdown / PNG and prints where they went. Modules are
imported when run, so the model-free benchmarks never pay for torch-heavy imports they skip.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time
from pathlib import Path

from octavo import engine_args
from octavo.bench.options import BenchOptions

# engine options the benchmarks set themselves (or take from their own flags)
BENCH_OWNED = ("model", "dtype", "seed", "kv_allocator", "contiguous_reserve")

BENCHMARKS = {
    "waste": "octavo.bench.waste",
    "concurrency": "octavo.bench.concurrency",
    "throughput": "octavo.bench.throughput",
    "serving": "octavo.bench.serving",
    "serve-peers": "octavo.bench.serve_peers",
    "prefix": "octavo.bench.prefix",
    "sharing": "octavo.bench.sharing",
    "paging": "octavo.bench.paging_overhead",
    "reliability": "octavo.bench.reliability",
    "structured": "octavo.bench.structured",
    "cpu": "octavo.bench.cpu_paths",
    "saturation": "octavo.bench.saturation",
    "spec": "octavo.bench.spec_decode",
    "kvmap": "octavo.bench.kv_map",
    "tp": "octavo.bench.tensor_parallel",
    "router": "octavo.bench.router",
    "gpu": "octavo.bench.gpu",
    "quant": "octavo.bench.quant",
    "kvquant": "octavo.bench.kv_quant",
    "kquant": "octavo.bench.kquant",
    "kv_tier": "octavo.bench.kv_tier",
    "hybrid": "octavo.bench.hybrid",
}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=[*BENCHMARKS, "all"])
    p.add_argument("--quick", action="store_true",
                   help="small variant (each under two minutes): smoke tests and CI")
    p.add_argument("--out", default="bench_results", help="directory for JSON, PNG and .md")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (median reported)")
    p.add_argument("--model", default=None,
                   help="HF Llama directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", action="append", choices=["auto", "float32", "bfloat16"],
                   default=None, help="repeatable; default float32 (throughput full runs: "
                   "float32, bfloat16 and auto)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--workload", action="append", default=None,
                   help="repeatable; run only these of the benchmark's workloads (throughput: "
                   "mixed, sharegpt)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw OUT/NAME.png from OUT/NAME.json (no benchmark runs)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch / OpenMP threads for every engine (default: all cores, as a "
                   "user runs it; on a shared machine OpenMP's spinning barriers can make that "
                   "slower than 1)")
    p.add_argument("--variant", action="append", default=[], metavar="DTYPE[:QUANTIZATION]",
                   help="repeatable (throughput): one octavo paged engine per variant, e.g. "
                   "auto:gguf and bfloat16:none for a GGUF model's blocks against its weights "
                   "dequantized, timed in one run (instead of the --dtype engines)")
    p.add_argument("--peer", action="append", choices=["vllm"], default=[],
                   help="also measure this peer engine (throughput)")
    p.add_argument("--peer-python", default=None,
                   help="interpreter of the peer's separate venv, e.g. /tmp/vllm-venv/bin/python")
    s = p.add_argument_group("serve-peers", "octavo serve against llama-server and vLLM's server")
    s.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    s.add_argument("--llama-slots", type=int, default=16, help="llama-server's -np")
    s.add_argument("--llama-args", default="",
                   help="more llama-server flags, one shell-quoted string, e.g. "
                   "--llama-args='--no-cache-idle-slots'")
    s.add_argument("--peer-gguf", default=None,
                   help="the model's GGUF for llama-server (default: the embedded model's)")
    s.add_argument("--peer-hf-dir", default=None,
                   help="the model's HF directory for vLLM (default: the one octavo loads; "
                   "also throughput --variant's)")
    s.add_argument("--peer-dtype", default="bfloat16",
                   help="vLLM's --dtype (also throughput --variant's)")
    s.add_argument("--kv-budget-mib", type=int, default=None,
                   help="KV cache bytes every server gets (MiB; default 256, --quick 4)")
    s.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="SLO: TTFT p90 limit")
    s.add_argument("--slo-tpot-ms", type=float, default=150.0, help="SLO: TPOT p90 limit")
    s.add_argument("--rates", type=float, nargs="+", default=None,
                   help="offered request rates (req/s), rising")
    s.add_argument("--cpus", default=None,
                   help="CPU list every server is pinned to with taskset, e.g. 0-1")
    s.add_argument("--servers", nargs="+", default=[],
                   help="run only these of octavo, llama-server, vllm (default: all three)")
    g = p.add_argument_group(
        "engine overrides", "applied to every octavo engine a benchmark builds, over the "
        "benchmark's own settings (model, dtype and seed are the flags above; the allocators "
        "are what the benchmarks compare)")
    engine_args.add_cli_args(g, exclude=BENCH_OWNED, overrides_only=True)


def options(args: argparse.Namespace, argv: list[str]) -> BenchOptions:
    command = "octavo bench " + shlex.join(argv)
    dtypes = args.dtype or (["float32", "bfloat16", "auto"] if args.name == "throughput"
                            and not args.quick else ["float32"])
    return BenchOptions(quick=args.quick, out=Path(args.out), seed=args.seed,
                        repeats=args.repeats, model=args.model, dtypes=dtypes,
                        num_requests=args.num_requests, workloads=args.workload or [],
                        peer=args.peer, variants=args.variant,
                        peer_python=args.peer_python, threads=args.threads, command=command,
                        llama_server=args.llama_server, llama_slots=args.llama_slots,
                        llama_args=shlex.split(args.llama_args),
                        peer_gguf=args.peer_gguf, peer_hf_dir=args.peer_hf_dir,
                        peer_dtype=args.peer_dtype, kv_budget_mib=args.kv_budget_mib,
                        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                        rates=args.rates or [], cpus=args.cpus, servers=args.servers,
                        engine_overrides=engine_args.cli_overrides(args, BENCH_OWNED))


def run_one(name: str, opts: BenchOptions, replot: bool = False) -> None:
    module = importlib.import_module(BENCHMARKS[name])
    if name == "throughput" and opts.variants and not replot:  # several weight formats
        module = importlib.import_module("octavo.bench.throughput_variants")
    if replot:
        from octavo.bench.common import replot as redraw

        print(f"== {name}: {redraw(opts.out / f'{name}.json', module.plot)}")
        return
    t0 = time.perf_counter()
    result, plot = module.run(opts)
    paths = result.write(opts.out, plot)
    print(f"== {name} ({time.perf_counter() - t0:.0f} s): " + ", ".join(map(str, paths)))
    print(result.markdown, flush=True)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="octavo bench", description=__doc__)
        add_bench_args(parser)
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
    else:  # from `octavo bench ...`: sys.argv is [prog, "bench", ...]
        argv = list(sys.argv[2:])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for the server / peer subprocesses
    import torch

    torch.set_num_threads(args.threads)
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    if args.name == "all" and not torch.cuda.is_available():
        names.remove("gpu")  # needs a CUDA device; scripts/gpu_check.sh runs it
    for name in names:
        run_one(name, options(argparse.Namespace(**{**vars(args), "name": name}), argv),
                args.replot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
