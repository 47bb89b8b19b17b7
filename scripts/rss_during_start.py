"""The resident set of `octavo serve` sampled every 0.2 s during its start-up, split into
anonymous memory (what the process allocated) and file-backed pages (the GGUF file's pages
while it is mapped for reading, which the kernel can drop at any time): the peak of each and
the settled set 3 s after /health answers.

    PYTHONPATH=. python scripts/rss_during_start.py qwen2.5-coder-1.5b
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

from serve_rss import status  # this directory: /proc/<pid>/status's resident-set fields, bytes

from octavo.bench.common import free_port

KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status_mib(pid: int) -> dict[str, int]:
    """KEYS in MiB."""
    return {k: v >> 20 for k, v in status(pid).items() if k in KEYS}


def main() -> int:
    model = sys.argv[1]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "octavo.cli", "serve", "--model", model, "--host", "127.0.0.1",
         "--port", str(port), "--max-model-len", "4096", "--num-kv-blocks", "256",
         "--max-num-seqs", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak: dict[str, tuple[int, float]] = {}
    t0 = time.monotonic()
    ready_at = None
    try:
        while time.monotonic() - t0 < 900 and proc.poll() is None:
            now = status_mib(proc.pid)
            for k, v in now.items():
                if v > peak.get(k, (0, 0.0))[0]:
                    peak[k] = (v, round(time.monotonic() - t0, 1))
            if ready_at is None:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    ready_at = time.monotonic()
                except OSError:
                    pass
            elif time.monotonic() - ready_at > 3:
                print(f"settled (MiB): {now}")
                break
            time.sleep(0.2)
        print(f"peaks (MiB, at s): {peak}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
