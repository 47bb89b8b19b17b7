"""Tensor parallelism over gloo (the `mp` executor): the same greedy tokens as one rank, on the
embedded model and on a tiny GQA model whose heads, MLP and vocabulary split unevenly; with
prefix caching, preemption, chunked prefill, n > 1 and n-gram speculation; and a worker that
dies fails the step naming it, and every step after it, without hanging."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.config import ModelConfig
from octavo.engine.engine import StepFailed
from octavo.engine.executor import WorkerDiedError
from octavo.model.parallel.tensor_parallel import ShardPlan, check_tp_config, split_sizes
from tests.conftest import build_tiny_llama

# 6 query heads over 3 KV heads, 129 MLP units and 259 tokens: none splits evenly over 2 ranks
UNEVEN = dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16, hidden_size=96,
              intermediate_size=129, vocab_size=259, attention_bias=True)


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tp-uneven"), **UNEVEN)


def _greedy(llm: LLM, prompts: list, max_tokens: int) -> list[list[list[int]]]:
    # detokenize off: the uneven model's 259 tokens are more than its byte tokenizer's 256
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


# ---- the shard plan (no processes) --------------------------------------------------------
def test_split_sizes_are_even_with_the_larger_shares_first():
    assert split_sizes(3, 2) == [2, 1]
    assert split_sizes(129, 2) == [65, 64]
    assert split_sizes(8, 4) == [2, 2, 2, 2]


@pytest.mark.parametrize("size", [2, 3])
def test_the_ranks_shards_put_back_together_are_the_full_weights(uneven_dir, size):
    config = ModelConfig.from_dir(uneven_dir)
    plans = [ShardPlan(config, r, size) for r in range(size)]
    locals_ = [p.local_config for p in plans]
    assert sum(c.num_kv_heads for c in locals_) == config.num_kv_heads
    assert sum(c.num_heads for c in locals_) == config.num_heads
    assert sum(c.intermediate_size for c in locals_) == config.intermediate_size
    d, h, i = config.head_dim, config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(q + 2 * kv, h, generator=gen)
    parts = [p.shard("layers.0.self_attn.qkv_proj.weight", qkv) for p in plans]
    # each rank's rows: its q heads, then its k heads, then its v heads
    splits = [part.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d])
              for part, c in zip(parts, locals_, strict=True)]
    for j in range(3):
        assert torch.equal(torch.cat([s[j] for s in splits]), qkv.split([q, kv, kv])[j])
    o = torch.randn(h, q, generator=gen)
    assert torch.equal(torch.cat([p.shard("layers.0.self_attn.o_proj.weight", o)
                                  for p in plans], dim=1), o)
    gate_up = torch.randn(2 * i, h, generator=gen)
    gu = [p.shard("layers.1.mlp.gate_up_proj.weight", gate_up).chunk(2) for p in plans]
    assert torch.equal(torch.cat([g for g, _ in gu]), gate_up[:i])
    assert torch.equal(torch.cat([u for _, u in gu]), gate_up[i:])
    down = torch.randn(h, i, generator=gen)
    assert torch.equal(torch.cat([p.shard("layers.1.mlp.down_proj.weight", down)
                                  for p in plans], dim=1), down)
    bias = torch.randn(h, generator=gen)
    summed = sum(p.shard("layers.0.self_attn.o_proj.bias", bias) for p in plans)
    assert torch.equal(summed, bias)  # held by rank 0 only: added once by the all-reduce
    embed = torch.randn(config.vocab_size, h, generator=gen)
    rows = [p.shard("embed_tokens.weight", embed) for p in plans]
    assert len({r.shape[0] for r in rows}) == 1  # padded to the same rows for the gather
    assert torch.equal(torch.cat(rows)[: config.vocab_size], embed)
    norm = torch.randn(h, generator=gen)
    assert all(torch.equal(p.shard("layers.0.input_layernorm.weight", norm), norm)
               for p in plans)


def test_a_config_that_cannot_split_is_refused_by_name(uneven_dir):
    config = ModelConfig.from_dir(uneven_dir)
    with pytest.raises(ValueError, match="more than the model's 3 KV heads"):
        check_tp_config(config, 4)
    import dataclasses
    moe = dataclasses.replace(config, model_type="mixtral")
    with pytest.raises(ValueError, match="'mixtral' does not run tensor-parallel"):
        check_tp_config(moe, 2)


def test_only_ngram_speculation_runs_tensor_parallel():
    with pytest.raises(ValueError, match="speculative_config: method 'self_draft'"):
        LLM(tensor_parallel_size=2, speculative_config={"method": "self_draft",
                                                         "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="distributed_executor_backend: uni runs one rank"):
        LLM(tensor_parallel_size=2, distributed_executor_backend="uni")


# ---- two ranks against one -----------------------------------------------------------------
def test_tp2_gives_the_greedy_tokens_of_one_rank_on_the_embedded_model():
    shared = list(range(1000, 1040))  # 40 tokens: two full blocks shared by the first prompts
    prompts = [{"prompt_token_ids": shared + [5, 6, 7]},
               {"prompt_token_ids": shared + [8, 9]},
               "The capital of France is",
               "def quicksort(items):\n    ",
               "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"]
    sampled = SamplingParams(temperature=0.8, max_tokens=12, n=2, seed=7, ignore_eos=True)
    one = LLM(tensor_parallel_size=1)
    want = _greedy(one, prompts, 24)
    want_n = [list(c.token_ids) for c in one.generate(prompts[2], sampled,
                                                       use_tqdm=False)[0].outputs]
    with LLM(tensor_parallel_size=2) as two:
        assert two.engine.runner is None and len(two.engine.executor.worker_pids()) == 2
        assert _greedy(two, prompts, 24) == want
        assert two.stats()["prefix_cache_hit_tokens"] >= 32  # the second prompt's blocks
        got_n = [list(c.token_ids) for c in two.generate(prompts[2], sampled,
                                                          use_tqdm=False)[0].outputs]
        assert got_n == want_n and got_n[0] != got_n[1]
        path = two.engine.kernel_path()
        assert path["tensor_parallel_size"] == 2 and path["threads_per_rank"] >= 1
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with LLM(tensor_parallel_size=2, speculative_config=spec) as two:
        assert _greedy(two, prompts, 24) == want
        assert two.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("collectives", ["shared memory", "gloo"])
def test_tp2_with_preemption_and_chunked_prefill_on_uneven_shards(uneven_dir, collectives,
                                                                   monkeypatch):
    if collectives == "gloo":  # the workers inherit it: every collective over gloo's TCP
        monkeypatch.setenv("OCTAVO_TP_SHM", "0")
    prompts = [{"prompt_token_ids": [(7 * j + i) % 250 + 3 for i in range(40 + 9 * j)]}
               for j in range(6)]
    opts = dict(model=str(uneven_dir), num_kv_blocks=24, block_size=8,
                max_num_batched_tokens=32, enable_prefix_caching=True)
    want = _greedy(LLM(**opts), prompts, 40)
    with LLM(tensor_parallel_size=2, **opts) as two:
        assert two.engine.kernel_path()["collectives"] == collectives
        assert _greedy(two, prompts, 40) == want
        stats = two.stats()
        assert stats["num_preemptions"] > 0
        assert stats["kv_blocks_used"] == 0


def test_a_dead_worker_fails_the_step_naming_it_and_every_step_after(uneven_dir):
    llm = LLM(model=str(uneven_dir), tensor_parallel_size=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, params)
    engine.step()
    pid = engine.executor.worker_pids()[1]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(StepFailed) as failed:
        for _ in range(50):
            engine.step()
    assert isinstance(failed.value.__cause__, WorkerDiedError)
    assert f"rank 1 (pid {pid}) died" in str(failed.value.__cause__)
    assert failed.value.request_ids == ["a"]
    assert engine.executor.dead is not None
    engine.abort_request("a")
    assert engine.stats()["kv_blocks_used"] == 0
    engine.add_request("b", {"prompt_token_ids": [5, 6, 7]}, params)
    with pytest.raises(StepFailed, match="rank 1"):
        engine.step()
    engine.abort_request("b")
    for p in engine.executor.worker_pids():  # the other worker was stopped
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)
    llm.shutdown()
