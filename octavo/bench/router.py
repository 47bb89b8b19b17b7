"""Data parallelism: the `prefix` workload through the router to 2 replicas, prefix-aware
routing vs round robin.

Each policy gets fresh replicas (`octavo serve` subprocesses on free loopback ports, each with
half the benchmark's threads) and a fresh `octavo router` subprocess in front. The workload's
groups share a 512-token prefix (plus a unique 64-token suffix each) and arrive in a shuffled
order, all at once (a deployment at capacity). Each replica's KV cache is sized to hold its
share of the prefixes under affinity routing (half the groups) plus the private blocks of
`max_num_seqs` running requests: round robin sends every group to both replicas, doubling
each replica's working set, so its least recently used prefixes are evicted before they are
used again, as in a real deployment whose cache is full.

Each policy runs the trace for `--repeats` rounds (default 3, 1 with --quick) on its
replicas, each round with fresh prefixes: one round's hit count swings with the order in which
concurrent requests happen to reach the replicas.

Reported: the replicas' own prefix-cache counters (`vllm:prefix_cache_hits_total`,
`..._queries_total`, summed over replicas), prefill tokens computed, requests per replica,
throughput and TTFT from the client, and the router's estimate of the hit tokens.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from matplotlib.figure import Figure

from octavo.bench import workloads
from octavo.bench.common import BenchResult, PlotFn, free_port, md_table, median
from octavo.bench.loadgen import run_load
from octavo.bench.options import BenchOptions
from octavo.bench.server_proc import ServerProcess

POLICIES = ("prefix", "round_robin")
BLOCK_SIZE = 16
NUM_REPLICAS = 2
GOAL = 1.8  # hit tokens with prefix-aware routing / with round robin
# the router's counters read around each round, by replica
COUNTED = ("octavo:router_requests_total", "octavo:router_prefix_match_tokens_total")


@dataclasses.dataclass(frozen=True)
class Setup:
    num_groups: int
    per_group: int
    prefix_len: int
    suffix_len: int
    output_len: int
    max_num_seqs: int
    max_model_len: int
    vocab: int

    @property
    def kv_blocks(self) -> int:
        """Half the groups' prefixes, plus each running request's own blocks (suffix,
        output, and the block a prefix not ending on a block boundary spills into)."""
        per_prefix = -(-self.prefix_len // BLOCK_SIZE)
        own = -(-(self.suffix_len + self.output_len) // BLOCK_SIZE) + 1
        return self.num_groups // NUM_REPLICAS * per_prefix + self.max_num_seqs * own


def setup(opts: BenchOptions) -> Setup:
    if opts.model is not None:  # the tiny test model: 512 positions, 256 ids
        return Setup(num_groups=4, per_group=opts.num_requests or 3, prefix_len=256,
                     suffix_len=32, output_len=4, max_num_seqs=4, max_model_len=512,
                     vocab=256)
    return Setup(num_groups=opts.pick(4, 8), per_group=opts.num_requests or opts.pick(4, 8),
                 prefix_len=512, suffix_len=64, output_len=opts.pick(4, 8),
                 max_num_seqs=4, max_model_len=1024, vocab=workloads.SMOLLM2_VOCAB)


def trace(s: Setup, seed: int) -> workloads.Workload:
    return workloads.prefix(num_groups=s.num_groups, per_group=s.per_group,
                            prefix_len=s.prefix_len, suffix_len=s.suffix_len,
                            output_len=s.output_len, vocab=s.vocab, seed=seed,
                            max_model_len=s.max_model_len)


class RouterProcess:
    """`octavo router` in a subprocess on a free loopback port, stopped with SIGTERM."""

    def __init__(self, opts: BenchOptions, replicas: list[str], policy: str, log: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "octavo.cli", "router", "--policy", policy,
               "--block-size", str(BLOCK_SIZE), "--host", "127.0.0.1",
               "--port", self.url.rsplit(":", 1)[1], "--uvicorn-log-level", "warning"]
        for url in replicas:
            cmd += ["--replica", url]
        if opts.model:
            cmd += ["--model", opts.model]
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=env)

    def wait_ready(self, num_replicas: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"octavo router exited: {self.log.read_text()[-2000:]}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200 and r.json()["healthy_replicas"] == num_replicas:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"octavo router not ready after {timeout_s} s")

    def per_label(self, name: str, label: str = "replica") -> dict[str, float]:
        """A counter of the router's /metrics by one label's value (other labels summed)."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def replica_flags(s: Setup) -> list[str]:
    return ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(s.kv_blocks),
            "--max-num-seqs", str(s.max_num_seqs), "--max-model-len", str(s.max_model_len),
            "--enable-prefix-caching"]


def run_policy(opts: BenchOptions, s: Setup, policy: str, repeats: int, tmp: Path
               ) -> list[dict]:
    """Fresh replicas and router for `policy`; `repeats` rounds of the trace, each with fresh
    prefixes (seed + round: a round never hits the blocks of the one before, whose stale
    blocks are the least recently used and go first). One dict per round."""
    threads = max(1, opts.threads // NUM_REPLICAS)
    replica_opts = dataclasses.replace(opts, threads=threads)
    replicas = [ServerProcess(replica_opts, tmp / f"{policy}-replica{i}.log", replica_flags(s))
                for i in range(NUM_REPLICAS)]
    router = None
    rounds = []
    try:  # the router loads its tokenizer while the replicas load the model
        router = RouterProcess(opts, [r.url for r in replicas], policy,
                               tmp / f"{policy}-router.log")
        for r in replicas:
            r.wait_ready()
        # warm each replica (its first forward pays one-time costs) directly, with prompts
        # shorter than a block: nothing enters a prefix cache or the router's index
        warm = workloads.mixed(2, output_len=2, min_prompt=4, max_prompt=BLOCK_SIZE - 1,
                               vocab=s.vocab, seed=10_000)
        for r in replicas:
            run_load(r.url, "bench", warm, float("inf"), timeout_s=300)
        router.wait_ready(NUM_REPLICAS)
        for rep in range(repeats):
            before = [r.wait_idle() for r in replicas]
            counts = [router.per_label(name) for name in COUNTED]
            reasons0 = router.per_label("octavo:router_requests_total", "reason")
            wl = trace(s, opts.seed + rep)
            load = run_load(router.url, "bench", wl, float("inf"), seed=opts.seed + rep,
                            timeout_s=opts.pick(600, 1800))
            after = [r.wait_idle() for r in replicas]
            routed, estimate = ({u: v - c0.get(u, 0.0) for u, v in router.per_label(n).items()}
                                for n, c0 in zip(COUNTED, counts, strict=True))
            reasons = {k: int(v - reasons0.get(k, 0.0)) for k, v in sorted(
                router.per_label("octavo:router_requests_total", "reason").items())}

            def delta(key: str, after=after, before=before) -> list[float]:
                return [a.get(key, 0.0) - b.get(key, 0.0)
                        for a, b in zip(after, before, strict=True)]

            hits = delta("vllm:prefix_cache_hits_total")
            queries = delta("vllm:prefix_cache_queries_total")
            rounds.append({
                "policy": policy, "round": rep, "hit_tokens": sum(hits),
                "query_tokens": sum(queries), "hit_tokens_per_replica": hits,
                "prefill_computed": sum(delta("vllm:prompt_tokens_total")),
                "preemptions": sum(delta("vllm:num_preemptions_total")),
                "requests_per_replica": [routed.get(r.url, 0.0) for r in replicas],
                "router_estimate_hit_tokens": sum(estimate.values()),
                "routing_reasons": {k: v for k, v in reasons.items() if v},
                "prompt_tokens": wl.prompt_tokens, **load,
            })
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()
    return rounds


def summary(policy: str, rounds: list[dict]) -> dict:
    """A policy's rounds: token counts summed, rates and latencies their medians."""
    total = {k: sum(r[k] for r in rounds) for k in (
        "hit_tokens", "query_tokens", "prefill_computed", "preemptions", "prompt_tokens",
        "router_estimate_hit_tokens", "requests", "completed", "short_outputs")}
    reasons: dict[str, int] = {}
    for r in rounds:
        for k, v in r["routing_reasons"].items():
            reasons[k] = reasons.get(k, 0) + v
    return {
        "policy": policy, **total, "hit_rate": total["hit_tokens"] / max(total["query_tokens"], 1),
        "hit_tokens_per_replica": [sum(x) for x in zip(*(r["hit_tokens_per_replica"]
                                                          for r in rounds), strict=True)],
        "requests_per_replica": [sum(x) for x in zip(*(r["requests_per_replica"]
                                                        for r in rounds), strict=True)],
        "routing_reasons": reasons,
        "errors": [e for r in rounds for e in r["errors"]],
        **{k: median([r[k] for r in rounds]) for k in (
            "req_s", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99")},
        "rounds_hit_tokens": [r["hit_tokens"] for r in rounds],
    }


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    t0 = time.perf_counter()
    s = setup(opts)
    repeats = opts.reps(1, 3)
    with tempfile.TemporaryDirectory() as tmp:
        raw = {policy: run_policy(opts, s, policy, repeats, Path(tmp)) for policy in POLICIES}
    rows = [summary(policy, rounds) for policy, rounds in raw.items()]
    by = {r["policy"]: r for r in rows}
    ratio = by["prefix"]["hit_tokens"] / max(by["round_robin"]["hit_tokens"], 1.0)
    per_round = [p["hit_tokens"] / max(q["hit_tokens"], 1.0)
                 for p, q in zip(raw["prefix"], raw["round_robin"], strict=True)]
    speedup = by["prefix"]["req_s"] / max(by["round_robin"]["req_s"], 1e-9)
    wl = trace(s, opts.seed)
    per_prefix = -(-s.prefix_len // BLOCK_SIZE)
    ideal = repeats * (s.per_group - 1) * s.num_groups * (s.prefix_len // BLOCK_SIZE
                                                          * BLOCK_SIZE)
    md = [
        f"{opts.model or 'SmolLM2-135M-Instruct'} {opts.dtypes[0]}, {NUM_REPLICAS} replicas "
        f"(`octavo serve`, {max(1, opts.threads // NUM_REPLICAS)} thread(s) each, block size "
        f"{BLOCK_SIZE}, max_num_seqs {s.max_num_seqs}, **{s.kv_blocks} KV blocks = "
        f"{s.kv_blocks * BLOCK_SIZE} tokens each**: {s.num_groups // NUM_REPLICAS} prefixes of "
        f"{per_prefix} blocks plus {s.max_num_seqs} running requests' own blocks) behind "
        f"`octavo router`; trace {wl.describe()}, all {len(wl)} requests sent at once in the "
        f"trace's shuffled order (streamed, ignore_eos); {repeats} round(s) per policy on the "
        "same replicas, each with fresh prefixes (seed + round). Hit tokens are the replicas' "
        "own `vllm:prefix_cache_hits_total`, summed over replicas and rounds; rates and "
        "TTFT are medians over rounds.",
        "",
        md_table(["policy", "hit tokens", "per round", "hit rate", "prefill computed",
                  "requests per replica", "req/s", "out tok/s", "TTFT p50 s", "TTFT p99 s",
                  "preemptions", "router's estimate"],
                 [[r["policy"], int(r["hit_tokens"]),
                   " ".join(str(int(x)) for x in r["rounds_hit_tokens"]),
                   f"{100 * r['hit_rate']:.1f}%", int(r["prefill_computed"]),
                   " / ".join(str(int(x)) for x in r["requests_per_replica"]), r["req_s"],
                   r["output_tok_s"], r["ttft_ms_p50"] / 1e3, r["ttft_ms_p99"] / 1e3,
                   int(r["preemptions"]), int(r["router_estimate_hit_tokens"])]
                  for r in rows]),
        "",
        f"Hit tokens, prefix-aware / round robin: **{ratio:.2f}x** (per round: "
        f"{', '.join(f'{x:.2f}x' for x in per_round)}; goal >= {GOAL}x: "
        f"{'met' if ratio >= GOAL else 'NOT met'}). Most possible with enough memory: "
        f"{ideal} (every request but the first of its group finds the prefix's full blocks). "
        f"Throughput, prefix-aware / round robin: {speedup:.2f}x. The router's choices under "
        f"the prefix policy: {by['prefix']['routing_reasons']} (prefix: the longest match; "
        "least_loaded: no replica matched, a group's first request; balance: the match was "
        "passed over for load).",
    ]
    errors = [e for r in rows for e in r["errors"]]
    if errors:
        md += ["", "Errors: " + "; ".join(errors[:6])]
    res = BenchResult("router", opts.command,
                      {"setup": dataclasses.asdict(s), "kv_blocks": s.kv_blocks,
                       "trace": wl.describe(), "replicas": NUM_REPLICAS, "rounds": repeats,
                       "threads_per_replica": max(1, opts.threads // NUM_REPLICAS),
                       "dtype": opts.dtypes[0]},
                      {"rows": rows, "rounds": raw, "hit_ratio": ratio,
                       "hit_ratio_per_round": per_round, "throughput_ratio": speedup,
                       "goal": GOAL, "goal_met": ratio >= GOAL, "ideal_hit_tokens": ideal},
                      "\n".join(md), elapsed_s=time.perf_counter() - t0)
    return res, plot


def plot(results: dict, fig: Figure) -> None:
    rows = results["rows"]
    labels = [r["policy"] for r in rows]
    ax = fig.add_subplot(1, 2, 1)
    bottom = [0.0] * len(rows)
    for i in range(len(rows[0]["hit_tokens_per_replica"])):
        vals = [r["hit_tokens_per_replica"][i] for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=f"replica {i}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.axhline(results["ideal_hit_tokens"], ls="--", color="0.3", lw=1, label="all prefixes hit")
    ax.set_ylabel("prefix-cache hit tokens (replicas' own counters)")
    ax.set_title(f"hit tokens: {results['hit_ratio']:.2f}x with prefix-aware routing")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    ax.bar(labels, [r["req_s"] for r in rows], color=["#4c72b0", "#8c8c8c"][:len(rows)])
    ax.set_ylabel("requests/s (all sent at once)")
    ax.set_title("throughput")
