"""Many users on one CPU server: octavo against llama-server and vLLM under an SLO.

`octavo bench serve-peers` starts each server alone (peer_servers.py) on the same CPUs, with
the same threads and the same KV cache budget in bytes, and drives it with the same seeded
open-loop traffic (traffic.py: chat, a ~1,000-token system prompt shared by every request plus
a ShareGPT-shaped user turn; agent, multi-turn sessions resending their growing history) at a
rising series of rates, streamed (slo_client.py). Every rate gets user turns and sessions of
its own behind the same system prompts, so a prefix cache never serves one rate's prompts
from the run before; the system prompts are computed once before the timed runs. Per server,
workload and rate it reports goodput under the SLO (TTFT p90 <= 2 s and TPOT p90 <= 150 ms
unless the flags say otherwise), output tok/s, TTFT / TPOT / ITL percentiles, the peak of
streams producing tokens at once, the server's peak resident memory and, where the server
reports cached prompt tokens, the prefix cache hit rate. `max_sustained_rate` (req/s) is
recorded per server and workload under its name (`octavo`, `llama-server`, `vllm`). A
server's rate series stops after two rates in a row that it did not sustain: higher ones
cannot be sustained either and would only queue.

After each workload octavo's /metrics must show no KV block in use (every block back in the
pool); the number is recorded.
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure

from octavo.bench import peer_servers, traffic
from octavo.bench.common import BenchResult, PlotFn, md_table
from octavo.bench.options import BenchOptions, chosen
from octavo.bench.server_proc import ServerProcess
from octavo.bench.slo_client import SLO, max_sustained_rate, run_traffic, summarize

SERVERS = ("octavo", "llama-server", "vllm")
QUICK_RATES = (4.0,)
FULL_RATES = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0)


class RSSPeak:
    """Samples a server's process-tree RSS on a thread, keeping the peak (kB)."""

    def __init__(self, pid: int, period_s: float = 0.25) -> None:
        self.pid, self.period_s, self.peak_kb = pid, period_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, peer_servers.tree_rss_kb(self.pid))
            self._stop.wait(self.period_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kb


def traffics(opts: BenchOptions, vocab: int, max_model_len: int,
             turn_seed: int | None = None) -> list[traffic.Traffic]:
    """The workloads; `turn_seed` draws fresh user turns and sessions behind the same system
    prompts (each offered rate gets its own, so no rate's prompts are cached by the one
    before)."""
    names = opts.workloads or ["chat", "agent"]
    unknown = set(names) - {"chat", "agent"}
    if unknown:
        raise ValueError(f"serve-peers workloads are chat and agent, not {sorted(unknown)}")
    out = []
    if "chat" in names:
        out.append(traffic.chat(
            opts.num_requests or opts.pick(6, 48), system_len=opts.pick(48, 1000),
            mean_in=opts.pick(16, 161), mean_out=opts.pick(8, 96), max_out=opts.pick(16, 192),
            max_model_len=max_model_len, vocab=vocab, seed=opts.seed, turn_seed=turn_seed))
    if "agent" in names:
        n = opts.num_requests or opts.pick(6, 48)
        turns = opts.pick(2, 4)
        out.append(traffic.agent(
            max(1, n // turns), turns=turns, system_len=opts.pick(48, 1000),
            first_len=opts.pick(16, 200), mean_tool=opts.pick(16, 150),
            mean_out=opts.pick(8, 64), max_out=opts.pick(16, 128),
            mean_think_s=opts.pick(0, 1) * 0.5, max_model_len=max_model_len, vocab=vocab,
            seed=opts.seed + 1, turn_seed=None if turn_seed is None else turn_seed + 1))
    return out


def _warm(url: str, vocab: int) -> None:
    """Two short requests, so first-call costs (thread pools, graph building) are not timed."""
    t = traffic.chat(2, system_len=16, mean_in=8, mean_out=4, max_out=4, max_model_len=64,
                     vocab=vocab, seed=12345)
    run_traffic(url, peer_servers.SERVED_NAME, t, math.inf, timeout_s=300)


def _warm_system(url: str, load: traffic.Traffic, copies: int) -> None:
    """The workload's shared system prompt (one output token), as a server in service has it
    cached already: the timed runs measure the steady state, not the first request's cold
    1,000 tokens (a 1.5B model takes many seconds for those on 2 cores). `copies` requests at
    once: a server whose prompt cache is per slot (llama-server) gets one per slot, as every
    slot of a server in service has held the system prompt; a shared prefix cache needs one.
    (llama-server's defaults with a unified KV cache save each idle slot to its RAM prompt
    cache and clear the slot when a task starts; that cache keeps one copy of a prompt, and a
    restore takes it out. `--no-cache-idle-slots` leaves every slot its own copy.)"""
    n = load.params.get("system_len", 0)
    if n and load.sessions:
        system = load.sessions[0][0].prompt_token_ids[:n]
        warm = traffic.Traffic("warm-system",
                               tuple((traffic.Turn(system, 1),) for _ in range(copies)),
                               load.max_model_len)
        run_traffic(url, peer_servers.SERVED_NAME, warm, math.inf, timeout_s=900 * copies)


def drive(name: str, server: peer_servers.Server, opts: BenchOptions,
          loads_by_rate: list[list[traffic.Traffic]], rates: list[float], slo: SLO, vocab: int,
          idle: Callable[[], dict] | None = None, prompt_caches: int = 1) -> list[dict]:
    """Run every workload at each rate against a ready server; one row per (workload, rate).
    loads_by_rate[i]: the workloads offered at rates[i] (fresh turns per rate);
    prompt_caches: how many separate prompt caches the server keeps (_warm_system)."""
    rows: list[dict] = []
    _warm(server.url, vocab)
    for w in range(len(loads_by_rate[0])):
        _warm_system(server.url, loads_by_rate[0][w], prompt_caches)
        misses = 0
        for i, rate in enumerate(rates):
            load = loads_by_rate[i][w]
            rss = RSSPeak(server.proc.pid)
            timings, duration = run_traffic(server.url, peer_servers.SERVED_NAME, load, rate,
                                            seed=opts.seed + i, timeout_s=opts.pick(120, 900))
            row = {"server": name, "workload": load.name,
                   **summarize(timings, duration, rate, slo), "peak_rss_mib": 0.0}
            row["peak_rss_mib"] = rss.stop() / 1024
            if idle is not None:
                m = idle()
                row["kv_blocks_used_after"] = m.get("octavo:kv_blocks_used", 0)
                hits, queries = m.get("vllm:prefix_cache_hits_total"), m.get(
                    "vllm:prefix_cache_queries_total")
                row["server_prefix_hits"] = [hits, queries]
            rows.append(row)
            print(f"  {name} {load.name} @ {rate} req/s: goodput {row['goodput_req_s']:.2f}, "
                  f"TTFT p90 {row['ttft_ms_p90']:.0f} ms, TPOT p90 {row['tpot_ms_p90']:.0f} ms"
                  f"{'' if row['sustained'] else ' (not sustained)'}", flush=True)
            misses = 0 if row["sustained"] else misses + 1
            if misses == 2:
                break
    return rows


def octavo_flags(opts: BenchOptions, kv_bytes: int, max_model_len: int) -> list[str]:
    flags = ["--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(max_model_len),
             "--enable-prefix-caching"]
    if opts.model is None and "quantization" not in opts.engine_overrides:
        # the embedded model is a Q4_1 GGUF, llama-server's input: octavo computes in its
        # blocks too
        flags += ["--quantization", "gguf"]
    return flags


def run(opts: BenchOptions) -> tuple[BenchResult, PlotFn]:
    from octavo.config import ModelConfig
    from octavo.model.sources import find_embedded_gguf, resolve_model_dir

    t0 = time.perf_counter()
    model_dir = resolve_model_dir(opts.model)
    cfg = ModelConfig.from_dir(model_dir)
    vocab = cfg.vocab_size
    max_model_len = opts.pick(256, 4096)
    kv_bytes = (opts.kv_budget_mib or opts.pick(4, 256)) * 2**20
    slo = SLO(opts.slo_ttft_ms / 1e3, opts.slo_tpot_ms / 1e3)
    rates = opts.rates or list(QUICK_RATES if opts.quick else FULL_RATES)
    loads_by_rate = [traffics(opts, vocab, max_model_len, turn_seed=opts.seed + 1000 * (i + 1))
                     for i in range(len(rates))]
    loads = loads_by_rate[0]
    skipped: dict[str, str] = {}
    rows: list[dict] = []
    rss_idle: dict[str, float] = {}
    wanted = chosen("--servers", opts.servers, SERVERS)
    for name in SERVERS:
        if name not in wanted:
            skipped[name] = "not run: left out by --servers"
    gguf = opts.peer_gguf or (None if opts.model else str(find_embedded_gguf()))
    with tempfile.TemporaryDirectory() as tmp:
        # octavo
        if "octavo" in wanted:
            server = ServerProcess(opts, Path(tmp) / "octavo.log",
                                   octavo_flags(opts, kv_bytes, max_model_len))
            try:
                server.wait_ready(opts.pick(180, 900))
                rss_idle["octavo"] = peer_servers.tree_rss_kb(server.proc.pid) / 1024
                rows += drive("octavo", server, opts, loads_by_rate, rates, slo, vocab,
                              server.wait_idle)
            finally:
                server.stop()
        # llama-server
        if "llama-server" not in wanted:
            pass  # recorded in `skipped` above
        elif not opts.llama_server or not Path(opts.llama_server).exists():
            skipped["llama-server"] = ("skipped: no llama-server binary (--llama-server PATH)"
                                       if not opts.llama_server else
                                       f"skipped: {opts.llama_server} does not exist")
        elif gguf is None:
            skipped["llama-server"] = "skipped: no GGUF of the model (--peer-gguf FILE)"
        else:
            bpt = peer_servers.llama_kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads,
                                                        cfg.head_dim)
            peer = peer_servers.start_llama_server(
                opts.llama_server, gguf, kv_bytes=kv_bytes, bytes_per_token=bpt,
                slots=opts.llama_slots, threads=opts.threads, cpus=opts.cpus,
                extra=opts.llama_args,
                log=Path(tmp) / "llama.log")
            rows += _run_peer("llama-server", peer, opts, loads_by_rate, rates, slo, vocab, skipped,
                              rss_idle)
        # vLLM
        if "vllm" not in wanted:
            pass  # recorded in `skipped` above
        elif (why := peer_servers.vllm_available(opts.peer_python)) is not None:
            skipped["vllm"] = f"skipped: {why}"
        else:
            peer = peer_servers.start_vllm(
                str(opts.peer_python), opts.peer_hf_dir or str(model_dir), kv_bytes=kv_bytes,
                max_model_len=max_model_len, dtype=opts.peer_dtype, threads=opts.threads,
                cpus=opts.cpus, log=Path(tmp) / "vllm.log", seed=opts.seed)
            rows += _run_peer("vllm", peer, opts, loads_by_rate, rates, slo, vocab, skipped,
                              rss_idle)
    best = {s: {load.name: max_sustained_rate(
        [r for r in rows if r["server"] == s and r["workload"] == load.name])
        for load in loads} for s in SERVERS if s not in skipped}
    config = {
        "rates": rates, "kv_budget_bytes": kv_bytes, "max_model_len": max_model_len,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "quantile": slo.quantile},
        "threads": opts.threads, "cpus": opts.cpus, "llama_slots": opts.llama_slots,
        "llama_args": opts.llama_args,
        "model": opts.model or "SmolLM2-135M-Instruct", "dtype": opts.dtypes[0],
        "engine_overrides": opts.engine_overrides, "peer_gguf": gguf,
        "peer_hf_dir": opts.peer_hf_dir, "peer_dtype": opts.peer_dtype,
        # the first rate's workloads (every rate draws its turns afresh behind the same
        # system prompts)
        "workloads": [load.describe() for load in loads],
    }
    results = {"rows": rows, "max_sustained_rate": best, "skipped": skipped,
               "idle_rss_mib": rss_idle}
    again = default_slo_rates(rows, slo, best)
    if again is not None:
        results["max_sustained_rate_default_slo"] = again
    return BenchResult("serve-peers", opts.command, config, results,
                       markdown(config, results), elapsed_s=time.perf_counter() - t0), plot


def default_slo_rates(rows: list[dict], slo: SLO, best: dict[str, dict[str, float]]
                      ) -> dict[str, dict[str, float]] | None:
    """Each server's highest sustained rate per workload under the default SLO, judged again
    from the rows, when the run's SLO was looser in both limits (it then ran every rate the
    default would have: a series stops after two misses); None otherwise."""
    default = SLO()
    if slo == default or slo.ttft_s < default.ttft_s or slo.tpot_s < default.tpot_s:
        return None
    return {s: {w: max_sustained_rate(
        [r for r in rows if r["server"] == s and r["workload"] == w], default) for w in by}
        for s, by in best.items()}


def _run_peer(name: str, peer: peer_servers.Launched, opts: BenchOptions,
              loads_by_rate: list[list[traffic.Traffic]], rates: list[float], slo: SLO,
              vocab: int,
              skipped: dict[str, str], rss_idle: dict[str, float]) -> list[dict]:
    try:
        try:
            peer.wait_ready(opts.pick(180, 900))
        except RuntimeError as e:
            skipped[name] = f"failed to start: {e}"
            return []
        rss_idle[name] = peer_servers.tree_rss_kb(peer.proc.pid) / 1024
        # llama-server keeps one prompt cache per slot
        caches = opts.llama_slots if name == "llama-server" else 1
        return drive(name, peer, opts, loads_by_rate, rates, slo, vocab, prompt_caches=caches)
    finally:
        peer.stop()


def markdown(config: dict, results: dict) -> str:
    rows = results["rows"]
    slo = config["slo"]
    md = [
        f"Model {config['model']}; KV budget {config['kv_budget_bytes'] / 2**20:.0f} MiB for "
        f"every server; max_model_len {config['max_model_len']}; {config['threads']} threads"
        f"{', CPUs ' + config['cpus'] if config['cpus'] else ''}; SLO: TTFT "
        f"p{slo['quantile']:.0f} <= {slo['ttft_s']:g} s and TPOT p{slo['quantile']:.0f} <= "
        f"{slo['tpot_s'] * 1e3:g} ms. Open-loop Poisson sessions, streamed token-id prompts "
        "with ignore_eos; one seeded run per rate. Workloads: "
        + "; ".join(f"{w['name']}: {w['requests']} requests in {w['sessions']} sessions, "
                    f"mean prompt {w['mean_prompt_len']}, mean output {w['mean_output_len']}"
                    for w in config["workloads"]) + ".",
        "",
        md_table(["server", "workload", "rate req/s", "done", "goodput req/s", "out tok/s",
                  "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "ITL p50/p99 ms",
                  "peak running", "peak RSS MiB", "prefix hits", "SLO met"],
                 [[r["server"], r["workload"], r["rate"], f"{r['completed']}/{r['requests']}",
                   r["goodput_req_s"], r["output_tok_s"],
                   f"{r['ttft_ms_p50']:.0f}/{r['ttft_ms_p90']:.0f}/{r['ttft_ms_p99']:.0f}",
                   f"{r['tpot_ms_p50']:.0f}/{r['tpot_ms_p90']:.0f}/{r['tpot_ms_p99']:.0f}",
                   f"{r['itl_ms_p50']:.0f}/{r['itl_ms_p99']:.0f}", r["peak_running"],
                   f"{r['peak_rss_mib']:.0f}",
                   "n/a" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.2f}",
                   "yes" if r["sustained"] else "no"] for r in rows], 2),
        "",
        "Highest sustained rate (req/s): " + "; ".join(
            f"{s}: " + ", ".join(f"{w} {v:g}" for w, v in by.items())
            for s, by in results["max_sustained_rate"].items()) + ".",
    ]
    if "max_sustained_rate_default_slo" in results:
        d = SLO()
        md += ["", f"Under the default SLO (TTFT p{d.quantile:.0f} <= {d.ttft_s:g} s, TPOT "
               f"p{d.quantile:.0f} <= {d.tpot_s * 1e3:g} ms), judged from the same rows' "
               "percentiles: " + "; ".join(
                   f"{s}: " + ", ".join(f"{w} {v:g}" for w, v in by.items())
                   for s, by in results["max_sustained_rate_default_slo"].items()) + "."]
    for name, why in results["skipped"].items():
        md += ["", f"{name}: {why.splitlines()[0] if why else why}"]
    errors = [f"{r['server']} {r['workload']}@{r['rate']}: {r['errors']}"
              for r in rows if r["errors"]]
    if errors:
        md += ["", "Errors: " + "; ".join(errors)]
    kv_after = [r.get("kv_blocks_used_after") for r in rows if "kv_blocks_used_after" in r]
    if kv_after:
        md += ["", f"octavo KV blocks in use after each run: {sorted(set(kv_after))}."]
    return "\n".join(md)


def plot(results: dict, fig: Figure) -> None:
    rows = results["rows"]
    loads = sorted({r["workload"] for r in rows}, key=["chat", "agent"].index)
    for k, load in enumerate(loads, 1):
        ax = fig.add_subplot(1, max(len(loads), 1), k)
        for server in SERVERS:
            sub = [r for r in rows if r["server"] == server and r["workload"] == load]
            if not sub:
                continue
            ax.plot([r["rate"] for r in sub], [r["goodput_req_s"] for r in sub], "o-",
                    label=f"{server} (max sustained "
                          f"{results['max_sustained_rate'][server][load]:g})")
        top = max((r["rate"] for r in rows if r["workload"] == load), default=1.0)
        ax.plot([0, top], [0, top], ":", color="0.6", lw=1, label="offered")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("goodput under the SLO (req/s)")
        ax.set_title(f"{load}: goodput vs offered rate")
        ax.legend(fontsize=7)
