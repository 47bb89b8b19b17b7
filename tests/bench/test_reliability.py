"""`octavo bench reliability --quick` on the tiny model: every scenario's functional checks hold
(no error, no leaked block, statuses, equal outputs, exit codes); the latency figures and the
full run are in RELIABILITY.md."""

from __future__ import annotations

import json

from octavo.bench.cli import main as bench_main


def test_reliability_quick(tiny_llama_dir, tmp_path):
    assert bench_main(["reliability", "--quick", "--threads", "1", "--model", str(tiny_llama_dir),
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "reliability.json").read_text())["results"]
    names = {r["scenario"].split(" ")[0] for r in rows}
    assert {"concurrency", "disconnect", "slow", "idle", "huge", "soak", "preemption",
            "drain"} <= names
    # the functional checks; the latency figures are judged on the full run (RELIABILITY.md)
    failed = [r for r in rows if not r["checks_ok"]]
    assert not failed, failed
