"""The options every `octavo bench NAME` accepts; each benchmark reads the ones it needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class BenchOptions:
    quick: bool = False
    out: Path = Path("bench_results")
    seed: int = 0
    repeats: int | None = None  # None: the benchmark's default (fewer under --quick)
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    num_requests: int | None = None  # override a benchmark's default request count
    workloads: list[str] = field(default_factory=list)  # only these workloads (empty: all)
    peer: list[str] = field(default_factory=list)  # "vllm"
    variants: list[str] = field(default_factory=list)  # throughput: DTYPE[:QUANTIZATION] each
    peer_python: str | None = None
    # serve-peers: the peers' binaries and models, the shared KV budget, the SLO, the rates
    llama_server: str | None = None  # path of a llama-server binary
    llama_slots: int = 16  # llama-server's -np
    llama_args: list[str] = field(default_factory=list)  # more llama-server flags, as given
    peer_gguf: str | None = None  # the model's GGUF for llama-server
    peer_hf_dir: str | None = None  # the model's HF directory for vLLM
    peer_dtype: str = "bfloat16"
    kv_budget_mib: int | None = None
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 150.0
    rates: list[float] = field(default_factory=list)
    cpus: str | None = None  # taskset CPU list every server is pinned to
    servers: list[str] = field(default_factory=list)  # serve-peers: only these (empty: all)
    threads: int = 1  # torch threads here and in the server / peer subprocesses
    command: str = ""  # the command line, recorded next to every result
    # engine options given on the command line, over each benchmark's own (EngineArgs names)
    engine_overrides: dict[str, Any] = field(default_factory=dict)

    def pick(self, quick: int, full: int) -> int:
        return quick if self.quick else full

    def reps(self, quick: int, full: int) -> int:
        return self.repeats if self.repeats is not None else self.pick(quick, full)

    def parts(self, bench: str, names: tuple[str, ...]) -> list[str]:
        """The parts of `bench` that --workload names (all of `names` when it names none)."""
        return chosen(f"{bench} --workload", self.workloads, names)


def chosen(flag: str, given: list[str], names: tuple[str, ...]) -> list[str]:
    """Those of `names` a repeatable flag gave (all of them when it gave none); a name not
    among them is an error naming the flag."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"{flag}: one of {', '.join(names)}, not {unknown}")
    return given or list(names)
