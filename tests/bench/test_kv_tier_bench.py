"""`octavo bench kv_tier` end to end on the tiny random Llama (its numbers mean nothing, only
that the plumbing works: a restart is served from the tier, the load runs write to it)."""

from __future__ import annotations

import json
from pathlib import Path

from octavo.bench.cli import main as bench_main


def test_kv_tier_quick_on_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    argv = ["kv_tier", "--quick", "--threads", "1", "--num-requests", "4", "--model",
            str(tiny_llama_dir), "--num-kv-blocks", "128", "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    data = json.loads((tmp_path / "kv_tier.json").read_text())
    res = data["results"]
    assert all(r["tier_hit_tokens"] == 256 for r in res["restart"])
    assert all(r["blocks_written"] > 0 for r in res["load"]["True"])
    assert all(r["blocks_written"] == 0 for r in res["load"]["False"])
    assert (tmp_path / "kv_tier.png").stat().st_size > 0
    assert len(res["paired_ratios"]) == len(res["load"]["True"])


def test_kv_tier_restart_part_alone(tiny_llama_dir: Path, tmp_path: Path) -> None:
    argv = ["kv_tier", "--quick", "--threads", "1", "--workload", "restart", "--model",
            str(tiny_llama_dir), "--num-kv-blocks", "128", "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    res = json.loads((tmp_path / "kv_tier.json").read_text())["results"]
    assert "load" not in res and all(r["tier_hit_tokens"] == 256 for r in res["restart"])
