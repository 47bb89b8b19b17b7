"""octavo against llama.cpp on the same GGUF file: single-stream speed and resident memory.

Speed: llama-bench's tests on both, at each thread count, medians of --repeats after a warm-up
(llama-bench's own mean of them), in --rounds alternating rounds whose medians are compared:
pp (a random prompt of --prompt tokens prefilled alone), tg (--gen tokens generated one at a
time from an empty context: llama-bench's tg128, which octavo runs as a one-token prompt and
its continuation, every token counted) and tg at depth (the same --gen tokens after a --prompt
token context: llama-bench's `-d`; octavo counts the tokens after the prefill). octavo runs
through `LLM` with the file's blocks kept (its default for a GGUF file), llama.cpp through
`llama-bench -o json`. Memory: the resident set of `octavo serve` and of
`llama-server` on the same file, after start-up, with the same context (--ctx) and one
sequence's KV cache (octavo: --max-model-len ctx and ctx / 16 blocks of 16 tokens for each KV
cache group: one, or one per window pattern of a sliding-window model).

    PYTHONPATH=. python scripts/gguf_vs_llama_cpp.py qwen2.5-coder-1.5b \
        --llama-bin /path/to/llama.cpp/build/bin --threads 1 2 --out docs/bench

--llama-config gives llama.cpp several configurations, each extra arguments of llama-bench
and, after a ';', of llama-server (e.g. '' '--repack 0;--no-repack': with and without its
repacked weight layouts, whose speed depends on the CPU); each test is then compared with the
fastest of them in each round, the resident set with the smallest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from octavo.bench.common import free_port


def cpu_flags() -> list[str]:
    want = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "fma"}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return sorted(want & set(line.split(":", 1)[1].split()))
    return []


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def octavo_speed(model: str, threads: int, prompt: int, gen: int, repeats: int,
                 pp_only: bool = False) -> dict:
    import torch

    from octavo import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=model, max_model_len=prompt + gen + 16, enable_prefix_caching=False)
    vocab = llm.engine.runner.config.vocab_size
    pp, tg, tg_deep = [], [], []
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)

    def timed(ids: list[int], params: SamplingParams) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - t

    for rep in range(repeats + 1):  # the first is a warm-up
        rng = random.Random(rep)
        ids = [rng.randrange(100, min(vocab, 30000)) for _ in range(prompt)]
        # tg: from an empty context, as llama-bench's tg runs: a one-token prompt's step and
        # the gen - 1 decode steps after it, gen model calls of one token each
        start_s = None if pp_only else timed(ids[:1], full)
        prefill_s = timed(ids, one)
        total_s = None if pp_only else timed(ids, full)
        if rep:
            pp.append(prompt / prefill_s)
            if start_s is not None and total_s is not None:
                tg.append(gen / start_s)
                tg_deep.append((gen - 1) / (total_s - prefill_s))
    path = llm.engine.runner.kernel_path()
    stats = llm.stats()
    out = {"pp_tok_s": statistics.median(pp), "weights_bytes": stats.get("weights_bytes"),
           "kernel_path": path}
    if not pp_only:
        out |= {"tg_tok_s": statistics.median(tg),
                f"tg_d{prompt}_tok_s": statistics.median(tg_deep)}
    return out


def llama_bench(bin_dir: Path, gguf: Path, threads: int, prompt: int, gen: int,
                repeats: int, extra: list[str], pp_only: bool = False) -> dict:
    def run(*tests: str) -> list[dict]:
        out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), *tests, "-t",
                              str(threads), "-r", str(repeats), "-o", "json", *extra],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    rows = run("-p", str(prompt), "-n", "0" if pp_only else str(gen))
    pp = next(r for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
    if pp_only:
        return {"pp_tok_s": pp["avg_ts"],
                "build": f"{rows[0].get('build_commit', '?')} ({rows[0].get('build_number', '?')})"}
    tg = next(r for r in rows if r["n_gen"] == gen and r["n_prompt"] == 0)
    # tg at depth: the same generation after a `prompt`-token context (llama-bench's -d)
    tg_deep = next(r for r in run("-p", "0", "-n", str(gen), "-d", str(prompt))
                   if r["n_gen"] == gen and r.get("n_depth") == prompt)
    return {"pp_tok_s": pp["avg_ts"], "tg_tok_s": tg["avg_ts"],
            f"tg_d{prompt}_tok_s": tg_deep["avg_ts"],
            "build": f"{rows[0].get('build_commit', '?')} ({rows[0].get('build_number', '?')})"}


def rss_after_start(cmd: list[str], port: int, timeout: float = 1800) -> dict:
    log = Path(f"/tmp/rss_{port}.log")
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                env=os.environ.copy())
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited ({proc.returncode}); see {log}")
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"{cmd[0]} did not start in time")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        time.sleep(2)
        out = {}
        with open(f"/proc/{proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key + "_MiB"] = int(value.split()[0]) / 1024
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an installed model's name or a GGUF file")
    parser.add_argument("--llama-bin", type=Path, required=True,
                        help="the directory holding llama-bench and llama-server")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of llama-bench and octavo per thread count")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--llama-config", nargs="+", default=[""],
                        help="extra arguments of llama-bench[;of llama-server], one string per "
                             "configuration (e.g. '' '--repack 0;--no-repack'): each runs in "
                             "every round, and each test compares with the fastest of them")
    parser.add_argument("--pp-only", action="store_true",
                        help="prompt processing only (no tg tests, no memory)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from octavo.model.sources import gguf_source, resolve_model_dir

    gguf = Path(args.model) if str(args.model).endswith(".gguf") \
        else gguf_source(resolve_model_dir(args.model))
    result: dict = {"model": args.model, "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
                    "cpu": cpu_name(), "flags": cpu_flags(), "cores": os.cpu_count(),
                    "llama_configs": args.llama_config, "load_avg_before": os.getloadavg(),
                    "speed": []}
    tests = ("pp",) if args.pp_only else ("pp", "tg", f"tg_d{args.prompt}")
    configs = {cfg: shlex.split(cfg.partition(";")[0]) for cfg in args.llama_config}
    server_args = {cfg: shlex.split(cfg.partition(";")[2]) for cfg in args.llama_config}
    for t in args.threads:
        # the machine's load drifts: the two run in alternating rounds, medians over rounds;
        # in each round llama.cpp's value of a test is its fastest configuration's
        lls, ocs, per_cfg = [], [], {cfg: [] for cfg in configs}
        for _ in range(args.rounds):
            for cfg, extra in configs.items():
                per_cfg[cfg].append(llama_bench(args.llama_bin, gguf, t, args.prompt, args.gen,
                                                args.repeats, extra, args.pp_only))
            lls.append({key: max(per_cfg[cfg][-1][key] for cfg in configs)
                        for key in per_cfg[args.llama_config[0]][-1] if key.endswith("_tok_s")})
            lls[-1]["build"] = per_cfg[args.llama_config[0]][-1]["build"]
            ocs.append(octavo_speed(args.model, t, args.prompt, args.gen, args.repeats,
                                    args.pp_only))
        ll, oc = dict(lls[0]), dict(ocs[0])
        row: dict = {"threads": t, "octavo": oc, "llama.cpp": ll}
        for test in tests:
            key = f"{test}_tok_s"
            ll[key] = statistics.median(r[key] for r in lls)
            oc[key] = statistics.median(r[key] for r in ocs)
            row[f"{test}_ratio"] = oc[key] / ll[key]
            row[f"{test}_rounds"] = {"octavo": [r[key] for r in ocs],
                                     "llama.cpp": [r[key] for r in lls]}
            if len(configs) > 1:
                row[f"{test}_rounds"]["llama.cpp_by_config"] = {
                    cfg: [r[key] for r in rs] for cfg, rs in per_cfg.items()}
        result["speed"].append(row)
        print(json.dumps(row, default=str), flush=True)
    if not (args.skip_memory or args.pp_only):
        from octavo.config import ModelConfig

        # the engine gives every KV cache group (a sliding-window model has several) a block
        # for each token it holds, so max_model_len needs ctx / 16 blocks per group
        groups = len(ModelConfig.from_dir(resolve_model_dir(args.model)).kv_groups.windows)
        port = free_port()
        oc = rss_after_start([sys.executable, "-m", "octavo.cli", "serve", "--model", args.model,
                              "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                              str(args.ctx), "--num-kv-blocks", str(args.ctx // 16 * groups),
                              "--max-num-seqs", "1"], port)
        # llama-server in each configuration; the ratio is against the smallest
        by_cfg = {}
        for cfg, extra in server_args.items():
            port = free_port()
            by_cfg[cfg] = rss_after_start(
                [str(args.llama_bin / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
                 "--port", str(port), "-c", str(args.ctx), "-np", "1", "-t",
                 str(args.threads[-1]), *extra], port)
        ll = min(by_cfg.values(), key=lambda r: r["VmRSS_MiB"])
        result["memory"] = {"octavo": oc, "llama-server": ll,
                            "rss_ratio": oc["VmRSS_MiB"] / ll["VmRSS_MiB"]}
        if len(configs) > 1:
            result["memory"]["llama-server_by_config"] = by_cfg
        print(json.dumps(result["memory"]), flush=True)
    result["load_avg_after"] = os.getloadavg()
    if args.out:
        name = Path(str(args.model)).name.removesuffix(".gguf")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"gguf-vs-llamacpp-{name}{'-pp' if args.pp_only else ''}.json").write_text(
            json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
