"""The agent CLIs people point at local servers, against `octavo serve` on the largest chat
model installed (Qwen2.5-Coder-1.5B-Instruct after `make pull-qwen`, otherwise the embedded
SmolLM2-135M-Instruct): Claude Code (`@anthropic-ai/claude-code`, ANTHROPIC_BASE_URL, print
mode, /v1/messages) and Codex CLI (`@openai/codex`, a custom provider on /v1/responses), each
given one short tool-using task.

Only the protocol is judged: the CLI finishes without an API error and every request it made
got a 2xx. A small model does not always decide to call the tool, so a tool round trip is
checked only when the model made one (the CLI's own tool loop then sent the result back).

Marked `agent_cli`. The CLIs come from npm into $OCTAVO_CACHE/agent-clis (the first run installs
them: a few hundred MB). Skipped where node is missing or older than 18, where the npm registry
cannot be reached, and under CI (`CI` set) unless they are installed already. Run them with
`pytest -m agent_cli tests/server/test_agent_clis.py`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from octavo.bench.options import BenchOptions
from octavo.bench.server_proc import ServerProcess
from octavo.envs import cache_dir
from octavo.model import catalog

pytestmark = pytest.mark.agent_cli
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}


def largest_chat_model() -> tuple[str, str | None, int]:
    """(served name, `--model` value, context tokens) of the largest installed chat model.
    Gemma 3 270M is a base model, not a chat model, so it is not a candidate."""
    qwen = catalog.find("qwen2.5-coder-1.5b")
    if qwen is not None and catalog.installed_file(qwen) is not None:
        return "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b", 32768
    return "smollm2", None, 8192


MODEL, MODEL_ARG, CONTEXT = largest_chat_model()
TASK = "Use your shell tool to run this command and tell me its output: cat note.txt"


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    root = cache_dir() / "agent-clis"
    bins = {name: root / "node_modules" / ".bin" / name for name in PACKAGES}
    if all(b.exists() for b in bins.values()):
        return bins
    if os.environ.get("CI"):
        pytest.skip("the agent CLIs are not installed and CI installs nothing from npm "
                    f"(install them into {root} with npm to run these tests)")
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the agent CLIs")
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    major = re.match(r"v(\d+)", version)
    if major is None or int(major.group(1)) < 18:
        pytest.skip(f"node {version.strip()} is too old for the agent CLIs (18 or later)")
    root.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(root),
                               *PACKAGES.values()], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("npm install of the agent CLIs timed out (registry unreachable?)")
    if done.returncode != 0 or not all(b.exists() for b in bins.values()):
        pytest.skip(f"npm could not install the agent CLIs: {done.stderr[-500:]}")
    return bins


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--uvicorn-log-level", "info"]
    proc = ServerProcess(BenchOptions(model=MODEL_ARG), log, flags, name=MODEL)
    try:
        proc.wait_ready(timeout_s=600)
        yield proc
    finally:
        assert proc.stop() == 0


def requests_in(log: Path, path: str) -> list[int]:
    """The statuses the server answered on `path` (uvicorn's access log)."""
    return [int(m.group(1)) for m in re.finditer(
        rf'"POST {re.escape(path)}(?:\?[^ ]*)? HTTP/1.1" (\d+)', log.read_text())]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "note.txt").write_text("the note says 42\n")
    return tmp_path


def test_claude_code(clis: dict[str, Path], server: ServerProcess, workdir: Path) -> None:
    env = {**os.environ, "HOME": str(workdir), "ANTHROPIC_BASE_URL": server.url,
           "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": MODEL,
           "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           # Claude Code's own prompt is about 7.4k tokens: in an 8k context its answers are
           # kept short
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512" if CONTEXT <= 8192 else "4096"}
    done = subprocess.run(
        [str(clis["claude"]), "-p", TASK, "--model", MODEL, "--tools", "Bash",
         "--allowedTools", "Bash", "--max-turns", "3", "--output-format", "json",
         "--system-prompt", "You are a helpful assistant. Use the Bash tool to run commands."],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    result = json.loads(done.stdout)
    if CONTEXT <= 8192 and result["is_error"] and "output token maximum" in result["result"]:
        # the 135M model rambled past max_tokens (sampled at Claude Code's temperature): the
        # answer's length, not the protocol; every request still got its 200 below
        assert result["subtype"] == "success", result
    else:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert result["is_error"] is False and result["subtype"] == "success", result
    statuses = requests_in(server.log, "/v1/messages")
    print(f"Claude Code on {MODEL}: {result['num_turns']} turn(s), /v1/messages {statuses}, "
          f"answer {result['result'][:300]!r}")
    assert statuses and all(s == 200 for s in statuses), statuses
    if result["num_turns"] > 1:  # the model called Bash: its result went back in a 2nd turn
        assert len(statuses) >= 2


def test_codex(clis: dict[str, Path], server: ServerProcess, workdir: Path) -> None:
    home = workdir / "codex-home"
    home.mkdir()
    (home / "instructions.md").write_text("You are a coding agent. Run shell commands with "
                                          "your exec_command tool. Be brief.\n")
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "octavo"\n'
        # the model's context is 8k tokens: Codex's own instructions are longer
        f'model_instructions_file = "{home / "instructions.md"}"\n\n'
        f'[model_providers.octavo]\nname = "octavo"\nbase_url = "{server.url}/v1"\n'
        'wire_api = "responses"\n')
    env = {**os.environ, "HOME": str(workdir), "CODEX_HOME": str(home),
           "OPENAI_API_KEY": "unused"}
    done = subprocess.run(
        [str(clis["codex"]), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access",
         "--json", TASK], cwd=workdir, env=env, capture_output=True, text=True, timeout=1800,
        stdin=subprocess.DEVNULL)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    # judged on the protocol: a small model sampled past Codex's output maximum gets an
    # incomplete response (max_output_tokens), which Codex reports as a failed turn; that is
    # the answer's length, not a protocol error (its output depends on the CPU's kernel path)
    too_long = "Incomplete response returned, reason: max_output_tokens"
    failures = [e for e in events if e["type"] in ("error", "turn.failed")]
    if failures and all(too_long in json.dumps(e) for e in failures):
        assert kinds[-1] == "turn.failed", kinds
    else:
        assert done.returncode == 0 and "turn.completed" in kinds, (kinds, done.stderr[-2000:])
        assert "turn.failed" not in kinds and not any(
            e["type"] == "error" and "error" in e.get("message", "") for e in events), events
    statuses = requests_in(server.log, "/v1/responses")
    print(f"Codex on {MODEL}: events {kinds}, /v1/responses {statuses}")
    assert statuses and all(s == 200 for s in statuses), statuses
    commands = [e for e in events if e["type"] == "item.completed"
                and e["item"].get("type") == "command_execution"]
    if commands:  # the model ran the command: its output went back in the next request
        assert len(statuses) >= 2
