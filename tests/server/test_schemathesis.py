"""Property-based fuzzing of the whole HTTP API from its own OpenAPI document (schemathesis,
every check): no 5xx, every status and body as documented, invalid data rejected, valid data
accepted (but for the cross-field rules tests/server/schemathesis.toml lists). Bounded: twenty
examples per operation, a fixed seed."""

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
         "--checks", "all", "--max-examples", "20", "--workers", "1", "--seed", "1"],
        capture_output=True, text=True, timeout=600,
    )
    summary = "\n".join(done.stdout.splitlines()[-30:])
    assert done.returncode == 0, summary
    counts = re.search(r"(\d+) generated, (\d+) passed", summary)
    assert counts and counts[1] == counts[2] and int(counts[1]) > 100, summary
    assert fuzz_server.wait_idle()["octavo:kv_blocks_used"] == 0


def test_the_openapi_document_says_what_the_server_answers(fuzz_server):
    import httpx

    doc = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    text = str(doc)
    assert "'422'" not in text and "HTTPValidationError" not in text
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "500", "503"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    error = completions["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    health = doc["paths"]["/health"]["get"]["responses"]
    assert health["200"].get("content") in ({}, None) and "503" in health
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    # bounds of the served model: the tiny one has 256 tokens and max_model_len 64
    request = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert '"maximum": 63' in str(request["max_tokens"]).replace("'", '"')
    assert '"maximum": 255' in str(request["stop_token_ids"]).replace("'", '"')
