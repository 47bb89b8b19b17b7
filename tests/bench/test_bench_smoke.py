"""Smoke tests for `octavo bench`: the model-free benchmarks end to end, plus the model-driven
ones on the tiny random Llama (fast; its numbers mean nothing, only that the plumbing works).

The model-free ones also check the goals that do not depend on the machine: paging at block
size 16 wastes under 4% of occupied KV memory and runs >= 4x the requests of max-length
contiguous reservation on the same budget.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from octavo.bench import workloads
from octavo.bench.cli import main as bench_main
from octavo.bench.sim import simulate
from octavo.cli import build_parser


def _files(out: Path, name: str) -> dict:
    for ext in ("json", "md", "png"):
        assert (out / f"{name}.{ext}").stat().st_size > 0, f"{name}.{ext} missing"
    data = json.loads((out / f"{name}.json").read_text())
    assert data["machine"]["cpu"] and data["machine"]["cores"]
    assert data["command"].startswith("octavo bench")
    return data


def test_workloads_are_seeded_and_shaped() -> None:
    a, b = workloads.sharegpt(200, seed=3), workloads.sharegpt(200, seed=3)
    assert a == b and a != workloads.sharegpt(200, seed=4)
    assert all(r.total_len <= a.max_model_len for r in a.requests)
    assert 100 < a.prompt_tokens / len(a) < 200 and 250 < a.output_tokens / len(a) < 400
    m = workloads.mixed()
    assert len(m) == 64 and {r.output_len for r in m.requests} == {128}
    assert all(32 <= r.prompt_len <= 512 for r in m.requests)
    p = workloads.prefix(num_groups=2, per_group=3)
    for r in p.requests:
        same = [q for q in p.requests if q.group == r.group]
        assert all(q.prompt_token_ids[:512] == r.prompt_token_ids[:512] for q in same)
        assert r.prompt_len == 576
    c = workloads.case_study(100)
    assert c.max_model_len == 4096 and all(200 <= r.total_len <= 1000 for r in c.requests)
    al = workloads.alpaca(500)
    assert 12 < al.prompt_tokens / len(al) < 25 and 40 < al.output_tokens / len(al) < 70
    assert workloads.poisson_arrivals(3, math.inf) == [0.0] * 3
    arr = workloads.poisson_arrivals(1000, 2.0, seed=1)
    assert arr == sorted(arr) and 400 < arr[-1] < 600


def test_simulated_paging_finishes_every_request() -> None:
    wl = workloads.sharegpt(60, seed=1)
    for kind in ("contiguous-max", "contiguous-request", "paged"):
        r = simulate(wl, kind, kv_tokens=8192, block_size=16)
        assert r.completed == len(wl)
        assert r.peak_running <= 8192 // 2048 if kind == "contiguous-max" else True


def test_cli_has_bench_subcommand() -> None:
    args = build_parser().parse_args(["bench", "all", "--quick", "--out", "x"])
    assert args.name == "all" and args.quick and args.func.__name__ == "cmd_bench"


def test_waste_quick(tmp_path: Path) -> None:
    # fewer requests than --quick's: the replay runs the engine's scheduler, which is slower
    argv = ["waste", "--quick", "--num-requests", "60", "--threads", "1", "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    rows = _files(tmp_path, "waste")["results"]
    paged16 = [r for r in rows if r["allocator"] == "paged" and r["block_size"] == 16]
    assert paged16 and all(1 - r["waste_of_used"]["live"]["mean"] < 0.04 for r in paged16)
    contig = [r for r in rows if r["allocator"] == "contiguous-max"]
    assert all(r["waste_of_used"]["live"]["mean"] < 0.4 for r in contig)


def test_concurrency_quick(tmp_path: Path) -> None:
    argv = ["concurrency", "--quick", "--num-requests", "200", "--threads", "1", "--out",
            str(tmp_path)]
    assert bench_main(argv) == 0
    assert _files(tmp_path, "concurrency")["results"]["paged_vs_contiguous_max"] >= 4


@pytest.mark.parametrize("name", ["prefix", "sharing", "serving"])
def test_model_benchmarks_quick_on_tiny_model(name: str, tiny_llama_dir: Path,
                                              tmp_path: Path) -> None:
    argv = [name, "--quick", "--model", str(tiny_llama_dir), "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    results = _files(tmp_path, name)["results"]
    if name == "prefix":
        on = next(r for r in results["rows"] if r["prefix_caching"])
        assert on["hit_rate"] > 0.3 and on["prefill_saved"] > 0.3
    elif name == "sharing":
        beams = [r for r in results if r["mode"] == "beam"]
        assert beams and all(r["mean_saving"] > 0 for r in beams)
    else:
        assert all(r["completed"] == r["requests"] and r["short_outputs"] == 0
                   for r in results)


def test_kvquant_quick_on_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    argv = ["kvquant", "--quick", "--threads", "1", "--model", str(tiny_llama_dir), "--out",
            str(tmp_path)]
    assert bench_main(argv) == 0
    results = _files(tmp_path, "kvquant")["results"]
    assert set(results["quality"]) == {"auto + noise", "int8", "fp8_e4m3"}
    assert results["quality"]["int8"]["positions"] == 4 * 32
    # the control on a path without quantized activations: the perturbation moves no top-1
    assert results["quality"]["auto + noise"]["top1_agreement"] == 1.0
    assert results["quality"]["auto + noise"]["max_kl"] < 1e-4
    assert results["quality"]["int8"]["kv_bytes_per_token"] < results["auto_kv_bytes_per_token"]
    assert [r["kv_cache_dtype"] for r in results["speed"]] == ["auto", "int8"]


def test_kvquant_control_perturbs_what_attention_reads(tiny_llama_dir: Path) -> None:
    """The control engine's logits move (its K and V are perturbed) by far less than a
    KV format's rounding does."""
    from octavo.bench.engine_run import make_llm
    from octavo.bench.kv_quant import NOISE, perturb_kv
    from octavo.bench.quant import sequence_logits

    tokens = list(range(3, 40))
    base = sequence_logits(make_llm(str(tiny_llama_dir), num_kv_blocks=8), tokens)
    noisy = sequence_logits(perturb_kv(make_llm(str(tiny_llama_dir), num_kv_blocks=8), NOISE),
                            tokens)
    int8 = sequence_logits(make_llm(str(tiny_llama_dir), num_kv_blocks=8,
                                    kv_cache_dtype="int8"), tokens)
    moved = (noisy - base).abs().max().item()
    assert 0 < moved < 1e-3
    assert moved < (int8 - base).abs().max().item() / 10


def test_kvquant_speed_windows_keep_every_sequence_running(tiny_llama_dir: Path) -> None:
    """The sequences prefilled first decode while the others prefill (a small step budget
    spreads the prompts over many steps): they still have tokens left in the last timed
    window, so every window's rate is that of the whole batch."""
    from octavo.bench.kv_quant import decode_speeds
    from octavo.bench.options import BenchOptions

    opts = BenchOptions(model=str(tiny_llama_dir),
                        engine_overrides={"max_num_batched_tokens": 64})
    [row] = decode_speeds(opts, ("auto",), num_seqs=4, context=60)
    assert row["min_running"] == 4
    assert row["context"] == 60 and len(row["windows_tok_s"]) == 3


def test_kvquant_parts(tiny_llama_dir: Path, tmp_path: Path) -> None:
    base = ["kvquant", "--quick", "--threads", "1", "--model", str(tiny_llama_dir), "--out",
            str(tmp_path)]
    assert bench_main([*base, "--workload", "1x8k"]) == 0
    results = _files(tmp_path, "kvquant")["results"]
    assert results["quality"] == {} and len(results["speed"]) == 2
    with pytest.raises(ValueError, match="kvquant --workload"):
        bench_main([*base, "--workload", "8x8k"])


def test_throughput_quick_on_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    argv = ["throughput", "--quick", "--threads", "1", "--dtype", "auto", "--model",
            str(tiny_llama_dir), "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    result = _files(tmp_path, "throughput")
    # the tiny model is an fp32 checkpoint: auto computes in fp32, and the label says so
    path = result["config"]["kernel_path"]["auto (float32)"]
    assert path["dtype"] == "float32" and path["dtype_requested"] == "auto"
    assert path["isa"] in ("avx512", "avx2", "portable")
    rows = result["results"]["engines"]
    assert {r["dtype"] for r in rows} == {"auto (float32)"}
    engines = {r["engine"] for r in rows}
    assert {"octavo-paged", "octavo-contiguous", "hf-generate", "GEMM floor"} <= engines
    for r in rows:
        if r["engine"] == "GEMM floor":
            g = r["gemm"]
            assert g["prefill_flops"] > 0 and g["decode_gflops"] > 0
            assert g["decode_gflops_own_weights"] > 0 and g["prefill_gflops_own_weights"] > 0
            assert r["x_own_weights_time"] == r["median_s"] / g["own_weights_s"]
        else:  # nothing runs the whole model faster than its matmuls alone
            assert r["x_floor_time"] > 1


def test_gemm_rate_needs_at_least_one_copy_of_the_weights() -> None:
    import torch

    from octavo.bench.roofline import gemm_rate
    from octavo.config import ModelConfig

    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5,
                      rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                      tie_word_embeddings=True)
    assert gemm_rate(cfg, torch.float32, 2, repeats=1, copies=2) > 0
    with pytest.raises(ValueError, match="copies must be >= 1"):
        gemm_rate(cfg, torch.float32, 2, repeats=1, copies=0)


def test_gemm_floor_counts_every_weight_once_per_token() -> None:
    from octavo.bench.roofline import workload_flops
    from octavo.config import ModelConfig

    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5,
                      rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                      tie_word_embeddings=True)
    wl = workloads.Workload("w", (workloads.BenchRequest((1, 2, 3), 4),), 64)
    per_token = 2 * 2 * (8 * 16 + 8 * 8 + 8 * 32 + 16 * 8)  # qkv, o, gate_up, down; 2 layers
    f = workload_flops(cfg, wl)
    assert f["prefill_flops"] == 3 * per_token and f["decode_flops"] == 3 * per_token
    assert f["lm_head_flops"] == 4 * 2 * 8 * 100


def test_cpu_paths_quick_on_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import torch

    from octavo.model.kernels.cpu_isa import cpu_flags, native_bf16, supported_isas
    from octavo.model.kernels.cpu_ops import load_cpu_ops

    argv = ["cpu", "--quick", "--threads", "1", "--num-requests", "4", "--model",
            str(tiny_llama_dir), "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    result = _files(tmp_path, "cpu")
    isas = supported_isas()
    assert result["machine"]["cpu_isas"] == isas
    res = result["results"]
    assert {r["path"] for r in res["decode_attention"]} == {
        "torch (gather + SDPA)", *(f"kernel {i}" for i in isas)}
    dot = [i for i in isas if i == "avx512" and "avx512_bf16" in cpu_flags()]  # bf16 both ways
    assert [(r["dtype"], r["path"]) for r in res["prefill_attention"] if r["step"] == "prompts"] \
        == [("float32", p) for p in ("torch (SDPA per chunk)", *(f"kernel {i}" for i in isas))] \
        + [("bfloat16", p) for p in ("torch (SDPA per chunk)", *(
            x for i in isas for x in ((f"kernel {i} (bf16 dot products)",
                                       f"kernel {i} (widened to fp32)") if i in dot
                                      else (f"kernel {i}",))))]
    step = res["decode_step_attention"]
    assert [(r["dtype"], r["path"]) for r in step] == [
        (d, f"kernel {i}") for d in ("float32", "bfloat16") for i in isas]
    assert all(r["ms"] > 0 and r["kv_gb_s"] > 0 for r in step)
    # every build in fp32, the best once more with oneDNN only; with native bf16, the best in
    # bf16 with packed_gemv and with oneDNN only
    bf16 = [(isas[0], "bfloat16")] * 2 if native_bf16(isas[0]) else []
    single = res["single_stream"]
    assert [(r["isa"], r["dtype"]) for r in single] == [
        (i, "float32") for i in isas + isas[:1]] + bf16
    for r in single:
        assert r["kernel_path"]["isa"] == r["isa"] and r["kernel_path"]["dtype"] == r["dtype"]
        assert 0 < r["forward_ms"] < r["step_ms"]
    assert single[len(isas)]["decode_linears"] == "off"  # the best build, oneDNN only
    if bf16:
        assert single[-1]["decode_linears"] == "off"
        assert single[-2]["decode_linears"].startswith("packed_gemv <= ")
    def max_rows(isa, dtype="float32", block=64):
        return load_cpu_ops(isa).packed_gemv_max_rows(getattr(torch, dtype), block)

    gemv_isas = [i for i in isas if max_rows(i)]
    assert {r["decode_linears"] for r in single[:len(isas)] if r["isa"] in gemv_isas} \
        <= {f"packed_gemv <= {max_rows(i)} rows" for i in gemv_isas}
    linears = res["decode_linears"]
    assert {(r["isa"], r["dtype"]) for r in linears if r["dtype"] == "float32"} == {
        (i, "float32") for i in gemv_isas}
    for r in linears:
        assert r["onednn_ms"] > 0 and r["packed_gemv_ms"] > 0
        # the engine's kernel comes first (bf16 with AMX: AMX tiles, then vdpbf16ps as the A/B)
        first = next(x["kernel"] for x in linears if (x["isa"], x["dtype"]) == (r["isa"],
                                                                             r["dtype"]))
        assert r["kernel"] in (("fma",) if r["dtype"] == "float32" else ("amx", "avx512_bf16"))
        block = 32 if r["kernel"] == "amx" else 64
        assert r["engine_takes"] == (r["rows"] <= max_rows(r["isa"], r["dtype"], block)
                                     and r["kernel"] == first)
    for r in res["mixed"]:
        if r["dtype"] == "bfloat16" and r["isa"] != "avx512":
            assert r["computes_in"] == "float32"  # no native bf16 on the forced-down paths
        assert r["output_tok_s"] > 0


def test_saturation_quick_on_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    argv = ["saturation", "--quick", "--threads", "1", "--num-requests", "4", "--model",
            str(tiny_llama_dir), "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    result = _files(tmp_path, "saturation")
    rows = {r["way"]: r for r in result["results"]["rows"]}
    assert set(rows) == {"offline", "offline, 2nd thread", "server"}
    assert rows["offline"]["x_offline"] == 1.0
    for r in rows.values():
        assert r["output_tok_s"] > 0 and r["cores_busy"] > 0
    assert rows["server"]["client_cores_busy"] >= 0
    assert result["results"]["kv_blocks_used_after"] == 0
    assert result["config"]["kernel_path"]["device"] == "cpu"


def test_spec_decode_quick_on_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    argv = ["spec", "--quick", "--threads", "1", "--num-requests", "2", "--model",
            str(tiny_llama_dir), "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    result = _files(tmp_path, "spec_decode")
    rows = result["results"]["rows"]
    cases = {r["case"] for r in rows}
    assert cases == {"grounded", "mixed", "mixed, sampled", "mixed, batch"}
    for r in rows:
        assert r["output_tok_s"] > 0
        if r["way"] == "off":
            assert r["x_off"] == 1.0 and r["draft_tokens_per_rep"] == 0
    # greedy and seeded single-stream outputs are the same with and without speculation
    assert all(result["results"]["same_tokens"][c] for c in ("grounded", "mixed",
                                                               "mixed, sampled"))
    assert any(r["draft_tokens_per_rep"] > 0 for r in rows if r["way"] != "off")
    assert result["config"]["kernel_path"]["device"] == "cpu"


def test_kv_map_quick_on_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    argv = ["kvmap", "--quick", "--threads", "1", "--num-requests", "4", "--model",
            str(tiny_llama_dir), "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    result = _files(tmp_path, "kv_map")
    snap = result["results"]["snapshot"]
    state = snap["state"]
    assert state["num_blocks"] == result["config"]["num_blocks"] == 2048
    counts = state["counts"]
    # a busy map: most blocks in use, some shared (prefix hits, n=2), some cached
    assert state["blocks_in_use"] == state["blocks_used_stats"] > 2048 // 2
    assert counts["shared"] > 0 and counts["cached"] == state["blocks_cached_stats"] > 0
    assert state["prefix_cache_hit_tokens"] > 0 and state["preemptions"] == 0
    assert state["running_requests"] > 0 and state["waiting_requests"] == 0
    rows = {r["call"]: r for r in snap["rows"]}
    http = rows["snapshot + JSON"]
    assert rows["snapshot"]["median_ms"] > 0 and http["json_bytes"] > 2048
    assert rows["snapshot + JSON, contiguous=None"]["json_bytes"] < http["json_bytes"]
    assert snap["goal_met"] == (http["median_ms"] < result["config"]["goal_ms"])
    tput = {r["way"]: r for r in result["results"]["throughput"]["rows"]}
    assert set(tput) == {"closed", "open 4 Hz", "open 20 Hz"}
    assert tput["closed"]["x_closed"] == 1.0
    for way, r in tput.items():
        assert r["output_tok_s"] > 0
        if way != "closed":  # the client was connected (one event in) before the batch
            samples = result["results"]["throughput"]["samples"][way]
            assert all(s["events_total"] >= 1 for s in samples)


def test_kquant_prefill_of_the_32_weight_formats_times_each_way() -> None:
    """`octavo bench kquant`'s rows for Q8_0 and Q5_0 at Gemma 3 270M's shapes: every way runs
    at every thread count (the kernels' results are tests/model/quant/test_block_tiles.py's)."""
    import torch

    from octavo.bench import kquant
    from octavo.model.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("octavo's CPU ops cannot be built here")
    gen = torch.Generator().manual_seed(0)
    path = ops.block_tiles_path()
    for name in kquant.NAMES_32:
        rows = kquant.prefill_32(ops, name, 1, gen)
        ways = {r["way"] for r in rows}
        expect = {"the engine's", "widened tiles + oneDNN fp32", "oneDNN fp32 GEMM"}
        if path == "avx512_vnni":
            expect.add("AVX2 tiles (VNNI off)")
        assert ways == expect
        assert {r["threads"] for r in rows} == set(kquant.THREADS)
        assert all(r["gflop_s"] > 0 and r["ms"] > 0 for r in rows)
    assert ops.block_tiles_path() == path  # the VNNI-off way turned them back on
