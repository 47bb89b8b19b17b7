"""`octavo bench serve-peers` end to end against octavo alone on the tiny random model: the
traffic shapes, the SLO arithmetic, and the harness (peers skipped, saying why)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from octavo.bench import serve_peers, traffic
from octavo.bench.cli import main as bench_main
from octavo.bench.slo_client import (
    SLO,
    Timing,
    max_sustained_rate,
    peak_overlap,
    summarize,
    sustained_under,
)


def test_traffic_is_seeded_and_shaped() -> None:
    chat = traffic.chat(20, system_len=100, max_model_len=512, vocab=1000, seed=1)
    assert chat == traffic.chat(20, system_len=100, max_model_len=512, vocab=1000, seed=1)
    assert chat.num_requests == 20 and all(len(s) == 1 for s in chat.sessions)
    system = chat.sessions[0][0].prompt_token_ids[:100]
    assert all(s[0].prompt_token_ids[:100] == system for s in chat.sessions)
    assert all(t.prompt_len + t.output_len <= 512 for t in chat.turns)
    agent = traffic.agent(5, turns=3, system_len=64, first_len=20, mean_tool=30,
                          max_model_len=2048, vocab=1000, seed=2)
    for session in agent.sessions:
        for prev, nxt in zip(session, session[1:], strict=False):
            # the history grows: each turn resends the previous prompt, answer and tool result
            assert nxt.prompt_token_ids[:prev.prompt_len] == prev.prompt_token_ids
            assert nxt.prompt_len > prev.prompt_len + prev.output_len
    starts = agent.session_starts(3.0, seed=0)
    assert starts == sorted(starts) and agent.session_starts(math.inf, 0) == [0.0] * 5


def test_fresh_turns_behind_the_same_system_prompt() -> None:
    """Each offered rate gets its own turns (a prefix cache cannot serve one rate's prompts
    from the run before), behind the one system prompt every rate shares."""
    for make in (lambda ts: traffic.chat(8, system_len=32, max_model_len=512, seed=3,
                                          turn_seed=ts),
                 lambda ts: traffic.agent(3, system_len=32, max_model_len=512, seed=3,
                                          turn_seed=ts)):
        a, b, a2 = make(1000), make(2000), make(1000)
        assert a == a2
        first = {s[0].prompt_token_ids[:32] for t in (a, b) for s in t.sessions}
        assert len(first) == 1  # one system prompt
        assert ({s[0].prompt_token_ids for s in a.sessions}
                .isdisjoint(s[0].prompt_token_ids for s in b.sessions))


def test_every_prompt_cache_is_warmed_with_the_system_prompt(monkeypatch) -> None:
    """A server with a prompt cache per slot (llama-server) gets the system prompt once per
    slot, all at once (each lands in its own slot); a shared prefix cache gets it once."""
    sent: list[tuple[traffic.Traffic, float]] = []
    monkeypatch.setattr(serve_peers, "run_traffic",
                        lambda url, model, t, rate, **kw: sent.append((t, rate)))
    chat = traffic.chat(4, system_len=40, max_model_len=512, vocab=1000, seed=1)
    system = chat.sessions[0][0].prompt_token_ids[:40]
    for copies in (16, 1):
        sent.clear()
        serve_peers._warm_system("http://x", chat, copies)
        (warm, rate), = sent
        assert rate == math.inf and len(warm.sessions) == copies
        assert all(s == (traffic.Turn(system, 1),) for s in warm.sessions)
    sent.clear()
    serve_peers._warm_system("http://x", traffic.Traffic("plain", chat.sessions, 512), 16)
    assert sent == []  # no shared system prompt: nothing to warm


def test_slo_summary() -> None:
    def t(ttft: float, latency: float, n: int = 11, error: str | None = None) -> Timing:
        return Timing(0, 0, 10, n, sent=0.0, ttft=ttft, latency=latency, output_tokens=n,
                      error=error)

    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    good, slow = t(0.5, 1.5), t(0.5, 2.5)  # TPOT 0.1 s and 0.2 s
    assert good.meets(slo) and not slow.meets(slo)
    row = summarize([good, good, slow], duration=2.0, rate=1.0, slo=slo)
    assert row["goodput_req_s"] == 1.0 and row["good_requests"] == 2
    assert not row["sustained"]  # p90 TPOT is over the limit
    assert summarize([good] * 3, 2.0, 0.5, slo)["sustained"]
    failed = summarize([good, t(0.5, 1.5, error="HTTP 500")], 2.0, 2.0, slo)
    assert not failed["sustained"] and failed["errors"] == ["HTTP 500"]
    rows = [{"rate": 0.5, "sustained": True}, {"rate": 1.0, "sustained": True},
            {"rate": 2.0, "sustained": False}]
    assert max_sustained_rate(rows) == 1.0 and max_sustained_rate(rows[2:]) == 0.0
    assert peak_overlap([(0, 2), (1, 3), (2, 4), (5, 6)]) == 2


def test_rows_judged_again_under_another_slo() -> None:
    """A row's p90s judge it under a stricter SLO exactly as summarize would have."""
    def t(ttft: float, latency: float) -> Timing:
        return Timing(0, 0, 10, 11, sent=0.0, ttft=ttft, latency=latency, output_tokens=11)

    loose, strict = SLO(ttft_s=8.0, tpot_s=0.2), SLO(ttft_s=1.0, tpot_s=0.1)
    runs = {0.1: [t(0.5, 1.5)] * 3, 0.2: [t(3.0, 4.0)] * 3, 0.3: [t(0.5, 2.5)] * 3}
    rows = [summarize(ts, 2.0, rate, loose) for rate, ts in runs.items()]
    for row, ts in zip(rows, runs.values(), strict=True):
        assert sustained_under(row, strict) == summarize(ts, 2.0, row["rate"], strict)["sustained"]
        assert sustained_under(row, loose) == row["sustained"]
    assert max_sustained_rate(rows) == 0.3 and max_sustained_rate(rows, strict) == 0.1
    rows[0]["completed"] = 2  # a failed request fails every SLO
    assert max_sustained_rate(rows, strict) == 0.0


def test_default_slo_rates_from_a_looser_run() -> None:
    def row(server: str, rate: float, ttft_ms: float, tpot_ms: float) -> dict:
        return {"server": server, "workload": "chat", "rate": rate, "requests": 4,
                "completed": 4, "ttft_ms_p90": ttft_ms, "tpot_ms_p90": tpot_ms,
                "sustained": True}

    rows = [row("octavo", 0.1, 1500, 90), row("octavo", 0.2, 5000, 90),
            row("llama-server", 0.1, 2500, 90)]
    best = {"octavo": {"chat": 0.2}, "llama-server": {"chat": 0.1}}
    assert serve_peers.default_slo_rates(rows, SLO(8.0, 0.2), best) == {
        "octavo": {"chat": 0.1}, "llama-server": {"chat": 0.0}}
    assert serve_peers.default_slo_rates(rows, SLO(), best) is None
    # stricter in one limit: the series may have stopped before the default's rates
    assert serve_peers.default_slo_rates(rows, SLO(8.0, 0.1), best) is None


def test_serve_peers_quick_on_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    argv = ["serve-peers", "--quick", "--threads", "1", "--model", str(tiny_llama_dir),
            "--out", str(tmp_path), "--llama-server", str(tmp_path / "no-llama-server"),
            "--peer-python", str(tmp_path / "no-python")]
    assert bench_main(argv) == 0
    data = json.loads((tmp_path / "serve-peers.json").read_text())
    assert (tmp_path / "serve-peers.png").stat().st_size > 0
    res = data["results"]
    assert set(res["skipped"]) == {"llama-server", "vllm"}
    assert all(why.startswith("skipped") for why in res["skipped"].values())
    rows = res["rows"]
    assert {r["workload"] for r in rows} == {"chat", "agent"}
    for r in rows:
        assert r["server"] == "octavo" and r["completed"] == r["requests"] and not r["errors"]
        assert r["kv_blocks_used_after"] == 0  # every block back in the pool
        assert r["peak_running"] >= 1 and r["peak_rss_mib"] > 0
        assert r["prefix_hit_rate"] is not None and r["prefix_hit_rate"] > 0
    assert set(res["max_sustained_rate"]) == {"octavo"}
    assert set(res["max_sustained_rate"]["octavo"]) == {"chat", "agent"}
    md = (tmp_path / "serve-peers.md").read_text()
    assert "llama-server: skipped" in md and "vllm: skipped" in md
    assert "max_sustained_rate_default_slo" not in res  # the run's SLO is the default one


def test_servers_picks_a_subset(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--servers runs only the servers named: here none that can start, so no rows, and each
    server left out says why."""
    argv = ["serve-peers", "--quick", "--threads", "1", "--model", str(tiny_llama_dir),
            "--out", str(tmp_path), "--servers", "llama-server"]
    assert bench_main(argv) == 0
    res = json.loads((tmp_path / "serve-peers.json").read_text())["results"]
    assert res["rows"] == [] and res["max_sustained_rate"] == {}
    assert res["skipped"]["octavo"] == res["skipped"]["vllm"] == "not run: left out by --servers"
    assert res["skipped"]["llama-server"].startswith("skipped: no llama-server binary")
    with pytest.raises(ValueError, match="--servers"):
        bench_main([*argv[:-1], "sglang"])


def test_llama_args_reach_llama_server_after_its_own_flags(tmp_path: Path) -> None:
    """--llama-args is one shell-quoted string; its flags come last, so they win."""
    import argparse
    import sys

    from octavo.bench import peer_servers
    from octavo.bench.cli import add_bench_args, options

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    argv = ["serve-peers", "--llama-args=--no-cache-idle-slots --cache-ram '0'"]
    opts = options(parser.parse_args(argv), argv)
    assert opts.llama_args == ["--no-cache-idle-slots", "--cache-ram", "0"]
    # a stand-in binary that exits at once: only the command line is looked at
    peer = peer_servers.start_llama_server(
        sys.executable, "m.gguf", kv_bytes=1 << 20, bytes_per_token=1024, slots=4, threads=1,
        cpus=None, log=tmp_path / "llama.log", extra=[*opts.llama_args, "--version"])
    try:
        assert peer.cmd[-4:] == ["--no-cache-idle-slots", "--cache-ram", "0", "--version"]
        assert peer.cmd.index("--kv-unified") < peer.cmd.index("--no-cache-idle-slots")
    finally:
        peer.stop()
