"""Property-based fuzzing of the whole HTTP API from its own OpenAPI document (schemathesis,
every check): no 5xx, every status and body as documented, invalid data rejected, valid data
accepted (but for the cross-field rules tests/server/schemathesis.toml lists). Bounded: a few
dozen examples per operation, a fixed seed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import start_server, stop_server

CONFIG = Path(__file__).with_name("schemathesis.toml")


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir):
    # small limits keep generated requests quick: n <= 4, at most 63 new tokens
    s = start_server(tiny_llama_dir, num_kv_blocks=64, max_num_seqs=4, max_model_len=64)
    yield s
    stop_server(s)


def test_schemathesis_finds_nothing(fuzz_server):
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe, "schemathesis is a test dependency (pyproject.toml [test])"
    done = subprocess.run(
        [exe, "--config-file", str(CONFIG), "run", f"{fuzz_server.url}/openapi.json",
         "--checks", "all", "--max-examples", "30", "--workers", "1", "--seed", "1"],
        capture_output=True, text=True, timeout=600,
    )
    summary = "\n".join(done.stdout.splitlines()[-30:])
    assert done.returncode == 0, summary
    counts = re.search(r"(\d+) generated, (\d+) passed", summary)
    assert counts and counts[1] == counts[2] and int(counts[1]) > 100, summary
    assert fuzz_server.wait_idle()["octavo:kv_blocks_used"] == 0
