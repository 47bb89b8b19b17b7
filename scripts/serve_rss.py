"""The resident set of `octavo serve` after start-up, and where its bytes go.

Starts `octavo serve --model MODEL` (extra flags after `--`) on a free port, waits for /health,
reads /proc/<pid>/status (VmRSS and its anonymous / file / shared parts) and the largest
mappings of /proc/<pid>/smaps, and prints them with the model file's size and the weights' bytes
the server logged. Then stops it.

    PYTHONPATH=. python scripts/serve_rss.py qwen2.5-coder-1.5b -- --max-model-len 4096
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from octavo.bench.common import free_port


def status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def largest_mappings(pid: int, n: int = 8) -> list[tuple[int, str]]:
    sizes: list[tuple[int, str]] = []
    name = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anonymous]"
            elif line.startswith("Rss:"):
                sizes.append((int(line.split()[1]) * 1024, name))
    merged: dict[str, int] = {}
    for size, mapping in sizes:
        merged[mapping] = merged.get(mapping, 0) + size
    return sorted(((v, k) for k, v in merged.items()), reverse=True)[:n]


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    port = free_port()
    cmd = [sys.executable, "-m", "octavo.cli", "serve", "--model", args.model, "--host",
           "127.0.0.1", "--port", str(port), *extra]
    log_path = f"/tmp/serve_rss_{port}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=os.environ.copy())
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}); see {log_path}")
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit("the server did not start in time")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        started = time.monotonic() - t0
        time.sleep(2)
        st = status(proc.pid)
        maps = largest_mappings(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    with open(log_path) as f:
        text = f.read()
    weights = re.search(r"'weights_bytes': (\d+)", text)
    print(f"command: {' '.join(cmd[1:])}")
    print(f"started in {started:.0f}s")
    for key, value in st.items():
        print(f"{key}: {value / 2**20:.0f} MiB")
    if weights:
        print(f"weights (the server's weights_bytes): {int(weights.group(1)) / 2**20:.0f} MiB")
    print("largest mappings (Rss):")
    for size, name in maps:
        print(f"  {size / 2**20:8.0f} MiB  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
