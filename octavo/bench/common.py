"""What every benchmark shares: machine tag, timing statistics and the three output files.

Each benchmark writes `<name>.json` (config, machine, raw and summarised results), `<name>.md`
(the table BENCHMARKS.md quotes) and `<name>.png` (tagged with the machine it ran on), so a
figure can never be separated from where and how it was produced.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: benchmarks run in CI and over ssh
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from octavo.model.kernels.cpu_isa import cpu_flags as all_cpu_flags  # noqa: E402
from octavo.model.kernels.cpu_isa import supported_isas  # noqa: E402

PlotFn = Callable[[Any, Figure], None]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16",
              "amx_tile", "avx512_vnni", "avx_vnni")


def cpu_flags() -> list[str]:
    """The SIMD flags of /proc/cpuinfo that decide the CPU kernels (empty off Linux)."""
    have = all_cpu_flags()
    return [flag for flag in SIMD_FLAGS if flag in have]


def machine_info() -> dict[str, Any]:
    """Where a number was measured; torch is imported lazily (model-free benches skip it)."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_isas": supported_isas(),  # octavo's CPU kernel builds this CPU runs, best first
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:  # pragma: no cover - torch is a hard dependency of octavo
        info["torch"] = None
    with contextlib.suppress(OSError):
        info["loadavg_1m_at_start"] = os.getloadavg()[0]
    return info


def machine_tag(info: dict[str, Any]) -> str:
    torch_v = info.get("torch") or "n/a"
    flags = " ".join(info.get("cpu_flags") or []) or "no SIMD flags found"
    gpu = f", {info['gpu']} (CUDA {info.get('cuda')})" if info.get("gpu") else ""
    return f"{info['cpu']} ({flags}), {info['cores']} cores{gpu}, torch {torch_v}"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) without importing numpy."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def timed_repeats(fn: Callable[[], Any], repeats: int) -> tuple[list[float], list[Any]]:
    """Run `fn` `repeats` times; wall times and results. Medians, never single runs, are
    reported: the machine is shared and a single run says little."""
    times, results = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        results.append(fn())
        times.append(time.perf_counter() - t0)
    return times, results


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fmt(x: Any, digits: int = 2) -> str:
    if isinstance(x, float):
        if x != x:  # NaN
            return "n/a"
        return f"{x:.{digits}f}"
    return str(x)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(c, digits) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class BenchResult:
    """One benchmark's output: written as JSON + markdown (+ PNG by the caller's plot fn)."""

    name: str
    command: str
    config: dict[str, Any]
    results: Any
    markdown: str
    machine: dict[str, Any] = field(default_factory=machine_info)
    elapsed_s: float = 0.0

    def write(self, out: Path, plot: PlotFn | None) -> list[Path]:
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"{self.name}.json", out / f"{self.name}.md"]
        payload = {
            "benchmark": self.name,
            "command": self.command,
            "machine": self.machine,
            "config": self.config,
            "elapsed_s": round(self.elapsed_s, 1),
            "results": self.results,
        }
        paths[0].write_text(json.dumps(payload, indent=2, default=str) + "\n")
        header = (
            f"### {self.name}\n\n`{self.command}` on {machine_tag(self.machine)} "
            f"({self.elapsed_s:.0f} s)\n\n"
        )
        paths[1].write_text(header + self.markdown.rstrip() + "\n")
        if plot is not None:
            paths.append(self.draw(plot, out / f"{self.name}.png"))
        return paths

    def draw(self, plot: PlotFn, png: Path) -> Path:
        fig = plt.figure(figsize=(10, 5.5))
        plot(self.results, fig)
        fig.text(0.99, 0.005, f"{self.name}: {machine_tag(self.machine)}",
                 ha="right", va="bottom", fontsize=7, color="0.4")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(png, dpi=110)
        plt.close(fig)
        return png



def replot(json_path: Path, plot: PlotFn) -> Path:
    """Redraw a benchmark's PNG from its JSON (a figure style change needs no rerun)."""
    data = json.loads(json_path.read_text())
    result = BenchResult(data["benchmark"], data["command"], data["config"], data["results"],
                         "", machine=data["machine"], elapsed_s=data["elapsed_s"])
    return result.draw(plot, json_path.with_suffix(".png"))
