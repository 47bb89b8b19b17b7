"""`octavo serve` in a subprocess on a free loopback port, for the benchmarks that need a real
server: started with the benchmark's flags (plus the command line's engine overrides), its log
in a file, its metrics and memory readable, stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from octavo.bench.common import free_port
from octavo.bench.options import BenchOptions
from octavo.engine_args import to_cli_flags


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name: value}, labels summed over (one model per server)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z0-9_:]+)(\{[^}]*\})? (\S+)$", line)
        if m and not line.startswith("#"):
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


class ServerProcess:
    def __init__(self, opts: BenchOptions, log: Path, flags: list[str],
                 name: str = "bench") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        cmd = [sys.executable, "-m", "octavo.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", opts.dtypes[0], "--seed", str(opts.seed),
               "--uvicorn-log-level", "warning", "--served-model-name", name, *flags]
        if opts.model:
            cmd += ["--model", opts.model]
        cmd += to_cli_flags(opts.engine_overrides)
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OMP_NUM_THREADS": str(opts.threads)}
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=env)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"octavo serve exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"octavo serve not ready after {timeout_s} s")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def wait_idle(self, timeout_s: float = 30) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if (m.get("vllm:num_requests_running", 0) == 0
                    and m.get("vllm:num_requests_waiting", 0) == 0
                    and m.get("octavo:kv_blocks_used", 0) == 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far (all its threads, user + system)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_lines(self) -> int:
        self._log_file.flush()
        with open(self.log, "rb") as f:
            return sum(1 for _ in f)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode
