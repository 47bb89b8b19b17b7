"""kv_cache_dtype through the engine: quantization is per token and attention reads K/V as
stored, so greedy outputs with int8 (and fp8) pages do not depend on how the work is done:
prefix caching on or off (a second run hits every full block), preemption by recompute or by
swap, block sizes 1 / 16 / 256, chunked prefill, batched or alone, the C++ decode loop or the
Python layers, the compiled attention kernels or the torch backend. Every run ends with every
block back in the pool. Plus what the engine reports (stats, bytes per token, sizing) and the
fp8 scales' two sources (calibration, the checkpoint).

The tiny random-weight model keeps each engine under a second; the kernels themselves are
checked on the real head dims in tests/model/layers/test_kv_quant.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from octavo import LLM, SamplingParams
from octavo.engine_args import EngineArgsError
from octavo.model.layers.decoder import Attention
from octavo.paging.block_hash import BlockHasher
from octavo.sampling_params import BeamSearchParams
from tests.conftest import build_tiny_llama
from tests.engine.conftest import tokens_prompt

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 2 layers x (K, V) x 2 KV heads x (16 int8 values + a 4-byte scale)
INT8_BYTES_PER_TOKEN = 2 * 2 * 2 * (16 + 4)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """7 prompts of 3..150 tokens, four of them sharing a 60-token prefix."""
    rng = random.Random(7)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, 256) for _ in range(n)]

    prefix = rand(60)
    return [rand(3), rand(40), rand(150)] + [prefix + rand(n) for n in (5, 20, 33, 70)]


def generate(llm: LLM, prompts: list[list[int]], alone: bool = False) -> list[list[int]]:
    if alone:
        outs = [llm.generate([tokens_prompt(p)], GREEDY, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([tokens_prompt(p) for p in prompts], GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_cpu_blocks_used"] == 0
    llm.engine.kv.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def int8_alone(tiny_llama_dir, prompts) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", block_size=16, num_kv_blocks=128,
              enable_prefix_caching=False)
    return generate(llm, prompts, alone=True)


CONFIGS = {
    "batched-bs16-caching": dict(block_size=16, num_kv_blocks=128),
    "bs1-chunked": dict(block_size=1, num_kv_blocks=2048, max_num_batched_tokens=24,
                        enable_prefix_caching=False),
    "bs256": dict(block_size=256, num_kv_blocks=8),
    "recompute": dict(block_size=16, num_kv_blocks=16, max_model_len=256),
    "swap": dict(block_size=16, num_kv_blocks=16, max_model_len=256, preemption_mode="swap"),
    "python-layers": dict(block_size=16, num_kv_blocks=128, decode_stack=False),
    "torch-attention": dict(block_size=16, num_kv_blocks=128, attention_backend="torch"),
    # drafts verified at lookahead slots, the rejected ones' K/V overwritten later
    "ngram-drafts": dict(block_size=16, num_kv_blocks=128, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2, "cost_model": False}),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_int8_greedy_is_the_same_however_it_runs(tiny_llama_dir, prompts, int8_alone, config):
    llm = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", **CONFIGS[config])
    assert generate(llm, prompts) == int8_alone
    stats = llm.stats()
    if config in ("recompute", "swap"):
        assert stats["num_preemptions"] > 0
    if llm.engine.args.enable_prefix_caching:  # the second run finds every full block
        assert generate(llm, prompts) == int8_alone
        if llm.engine.args.block_size <= 16:  # (256-token blocks: no prompt fills one)
            assert llm.stats()["prefix_cache_hit_tokens"] > stats["prefix_cache_hit_tokens"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_forked_samples_copy_their_pages_with_the_scales(tiny_llama_dir, prompts,
                                                         kv_cache_dtype):
    """n = 3 greedy samples fork the prompt's blocks and copy the last, shared one on their
    first write (copy-on-write); swapped out and in under preemption: each sample must read
    exactly the pages (and int8 scales) a lone greedy run reads."""
    llm = LLM(str(tiny_llama_dir), kv_cache_dtype=kv_cache_dtype, num_kv_blocks=20,
              max_model_len=256, preemption_mode="swap")
    alone = generate(llm, prompts[:5], alone=True)
    params = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([tokens_prompt(p) for p in prompts[:5]], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[a] * 3 for a in alone]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0


def test_int8_beam_search_forks_pages_alike_at_any_block_size_and_the_page_map_sees_them(
        tiny_llama_dir, prompts):
    """Beams fork copy-on-write and die mid-block: with int8 pages the beams found are the same
    at block sizes 1 and 16, batched or alone; the page map of a run in flight reports them."""
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)

    def beams(llm: LLM, ps: list[list[int]]) -> list[list[list[int]]]:
        outs = llm.beam_search([tokens_prompt(p) for p in ps], params)
        assert llm.stats()["kv_blocks_used"] == 0
        return [[s.tokens for s in o.sequences] for o in outs]

    bs16 = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", num_kv_blocks=128)
    ref = beams(bs16, prompts[3:6])
    bs1 = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", block_size=1, num_kv_blocks=2048,
              enable_prefix_caching=False)
    assert [beams(bs1, [p])[0] for p in prompts[3:6]] == ref
    bs16.engine.add_request("m", tokens_prompt(prompts[4]), GREEDY)
    bs16.engine.step()
    snap = bs16.engine.kv_map()
    assert snap["stats"]["kv_cache_dtype"] == "int8"
    assert snap["stats"]["kv_bytes_per_token"] == INT8_BYTES_PER_TOKEN
    assert snap["device"]["counts"] and snap["num_requests"]["running"] == 1
    bs16.engine.abort_request("m")
    assert bs16.stats()["kv_blocks_used"] == 0


def test_fp8_under_tensor_parallelism(tmp_path, prompts):
    """Two ranks, 3 KV heads split 2 + 1: each rank calibrates the scales of its own heads
    (the calibration pass all-reduces like any forward) and gives one rank's greedy tokens."""
    model_dir = build_tiny_llama(tmp_path / "tp", num_attention_heads=6, num_key_value_heads=3,
                                 hidden_size=96)
    one = generate(LLM(str(model_dir), kv_cache_dtype="fp8", num_kv_blocks=128), prompts[:3])
    tp = LLM(str(model_dir), kv_cache_dtype="fp8", num_kv_blocks=128, tensor_parallel_size=2)
    try:
        assert generate(tp, prompts[:3]) == one
        assert tp.stats()["kv_bytes_per_token"] == 2 * 2 * 2 * 16  # rank 0: 2 of the 3 heads
    finally:
        tp.engine.shutdown()


def test_fp8_greedy_batched_equals_alone_and_scales_are_per_head(tiny_llama_dir, prompts):
    llm = LLM(str(tiny_llama_dir), kv_cache_dtype="fp8", num_kv_blocks=128)
    batched = generate(llm, prompts[:4])
    assert generate(llm, prompts[:4], alone=True) == batched
    runner = llm.engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    quant = layers[0].kv_quant
    assert quant is not None and quant.fmt.name == "fp8_e4m3"
    assert quant.k_scale.shape == (2,) and bool((quant.k_scale > 0).all())
    assert runner.kv_cache.device_cache.dtype == torch.float8_e4m3fn
    assert llm.stats()["kv_cache_dtype"] == "fp8_e4m3"


def test_checkpoint_scales_are_used(tmp_path):
    model_dir = build_tiny_llama(tmp_path / "fp8-scales")
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02)
    save_file(tensors, file, metadata={"format": "pt"})
    llm = LLM(str(model_dir), kv_cache_dtype="fp8_e5m2", num_kv_blocks=32)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
    assert torch.equal(layers[1].kv_quant.k_scale, torch.tensor([0.1, 0.1]))
    assert torch.equal(layers[0].kv_quant.v_scale, torch.tensor([0.02, 0.02]))
    assert len(generate(llm, [[5, 6, 7]])[0]) == MAX_TOKENS


def test_sizing_and_stats_count_the_stored_bytes(tiny_llama_dir):
    budget = 100 * 16 * INT8_BYTES_PER_TOKEN + 7
    llm = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", kv_cache_memory_bytes=budget)
    stats = llm.stats()
    assert stats["kv_cache_dtype"] == "int8"
    assert stats["kv_bytes_per_token"] == INT8_BYTES_PER_TOKEN
    assert stats["kv_blocks_total"] == 100
    cache = llm.engine.runner.kv_cache.device_cache
    assert cache.dtype == torch.int8 and cache.numel() == 100 * 16 * INT8_BYTES_PER_TOKEN
    auto = LLM(str(tiny_llama_dir), kv_cache_memory_bytes=budget).stats()
    assert auto["kv_cache_dtype"] == "float32" and auto["kv_bytes_per_token"] == 2 * 2 * 2 * 64
    assert auto["kv_blocks_total"] == budget // (16 * 512)


def test_kv_tier_restores_int8_pages_with_their_scales_and_keeps_formats_apart(
        tiny_llama_dir, prompts, int8_alone, tmp_path):
    """The KV tier stores a block's bytes: an int8 row's scale travels in them, so a restart
    served from tier records gives the tokens computed without any; records of one KV format
    (or fp8 scales) are never read into a cache of another."""
    tier = str(tmp_path / "tier")
    first = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", num_kv_blocks=128,
                kv_offload_dir=tier)
    assert generate(first, prompts) == int8_alone
    assert first.engine.tier.flush(30) and first.stats()["tier_blocks_written"] > 0
    again = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", num_kv_blocks=128,
                kv_offload_dir=tier)
    assert generate(again, prompts) == int8_alone
    assert again.stats()["tier_hit_tokens"] >= 48  # the shared prefix: 3 full blocks
    assert again.stats()["tier_read_failures"] == 0
    for other in ("auto", "fp8_e4m3"):
        llm = LLM(str(tiny_llama_dir), kv_cache_dtype=other, num_kv_blocks=128,
                  kv_offload_dir=tier)
        generate(llm, prompts[3:])
        assert llm.stats()["tier_hit_tokens"] == 0, other
    cache = llm.engine.runner.kv_cache
    assert cache.scales_id and cache.scales_id in cache.block_format()
    assert "int8 pages" in again.engine.runner.kv_cache.block_format()


def test_a_bad_kv_cache_dtype_names_the_option():
    with pytest.raises(EngineArgsError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="int4")


def test_prefix_cache_keys_differ_by_kv_dtype():
    tokens = list(range(40))
    hashes = {}
    for seed in (None, "int8", "fp8_e4m3"):
        hashes[seed] = []
        BlockHasher(16, seed).extend(hashes[seed], tokens, None)
    assert len({h[0] for h in hashes.values()}) == 3  # every block of the chain differs
    assert len({h[1] for h in hashes.values()}) == 3
    plain: list[bytes] = []
    BlockHasher(16).extend(plain, tokens, None)
    assert plain == hashes[None]  # the model dtype's keys are what they always were
