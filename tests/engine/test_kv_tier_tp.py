"""The KV tier under tensor parallelism (the `mp` executor, two ranks, a tiny model whose 3 KV
heads split 2 + 1): a block's record holds both ranks' shards in rank order; greedy tokens
served from a TP=2 tier after a restart equal those computed without a tier; records written
by one rank are never read by two, nor the reverse (zero hits, the same tokens); every KV block
is back in the pool after each run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.config import ModelConfig
from octavo.engine.executor.tier_shards import TierShards
from octavo.engine.kv_tier_setup import fingerprint, fingerprint_digest, model_identity
from octavo.engine_args import EngineArgs
from octavo.model.parallel.tensor_parallel import ShardPlan
from octavo.paging.tier.record import decode
from tests.conftest import build_tiny_llama
from tests.engine.test_kv_tier import block_key, make_prompts
from tests.engine.test_tensor_parallel import UNEVEN

BLOCK = 16
# detokenize off: the model's 259 tokens are more than its byte tokenizer's 256
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tier-tp"), **UNEVEN)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.engine.check_invariants()
    assert llm.stats()["kv_blocks_used"] == 0
    return [list(o.outputs[0].token_ids) for o in outs]


def flushed(llm: LLM) -> dict:
    assert llm.engine.tier is not None and llm.engine.tier.flush(30)
    return llm.stats()


def test_tier_shards_split_and_join_in_rank_order() -> None:
    shards = TierShards((6, 3))
    record = bytes(range(9))
    per_rank = shards.split([(4, memoryview(record)), (7, record[::-1])])
    assert per_rank == [[(4, record[:6]), (7, record[::-1][:6])],
                        [(4, record[6:]), (7, record[::-1][6:])]]
    saved = [[loads[0][1], loads[1][1]] for loads in per_rank]
    assert shards.join(saved, 2) == [record, record[::-1]]
    with pytest.raises(ValueError, match="holds 9 bytes"):
        shards.split([(4, record[:8])])
    with pytest.raises(ValueError, match="rank 1 copied out"):
        shards.join([[record[:6]], []], 1)


def test_one_ranks_fingerprint_is_the_one_it_always_was(uneven_dir) -> None:
    """A directory written by one rank before tensor-parallel records existed stays found."""
    args = EngineArgs(model=str(uneven_dir), block_size=BLOCK)
    config = ModelConfig.from_dir(uneven_dir)
    before = {
        "format": 1, "model": model_identity(uneven_dir), "model_type": config.model_type,
        "dtype": "float32", "kv_block": "float32[2, 2, 16, 3, 16]", "block_size": BLOCK,
        "kv_groups": {"windows": list(config.kv_groups.windows),
                      "layer_group": list(config.kv_groups.layer_group),
                      "layer_slot": list(config.kv_groups.layer_slot)},
        "tensor_parallel": [0, 1], "quantization": args.quantization,
        "quantization_group_size": args.quantization_group_size if args.quantization else None}
    one = fingerprint(args, uneven_dir, config, "float32", ["float32[2, 2, 16, 3, 16]"])
    assert fingerprint_digest(one) == fingerprint_digest(before)
    two = fingerprint(args, uneven_dir, config, "float32",
                      ["float32[2, 2, 16, 2, 16]", "float32[2, 2, 16, 1, 16]"])
    assert two["tensor_parallel"] == {"size": 2, "ranks": [0, 1]}
    assert fingerprint_digest(two) != fingerprint_digest(one)


def test_tp2_tier_hits_give_the_tokens_computed_without_them(uneven_dir, tmp_path) -> None:
    prompts = make_prompts(21, 4 * BLOCK, (BLOCK + 3, 2 * BLOCK + 5))
    opts = dict(model=str(uneven_dir), block_size=BLOCK, num_kv_blocks=48)
    tier = tmp_path / "tier"
    ref = generate(LLM(**opts), prompts)  # one rank, no tier

    # one rank writes first: its records are not the two ranks' (zero hits, no failures)
    one = LLM(kv_offload_dir=str(tier), **opts)
    assert generate(one, prompts) == ref
    one_root = one.engine.tier.store.root
    assert flushed(one)["tier_blocks_written"] > 0
    one.shutdown()
    with LLM(tensor_parallel_size=2, kv_offload_dir=str(tier), **opts) as first:
        assert generate(first, prompts) == ref
        stats = flushed(first)
        assert stats["tier_hit_tokens"] == 0 and stats["tier_read_failures"] == 0
        assert stats["tier_blocks_written"] > 0
        two_root = first.engine.tier.store.root
    assert two_root != one_root

    # a record at TP=2 holds rank 0's 2 KV heads then rank 1's 1: the block one rank computed
    config = ModelConfig.from_dir(uneven_dir)
    heads = [ShardPlan(config, r, 2).local_config.num_kv_heads for r in range(2)]
    assert heads == [2, 1]
    key, toks = block_key(prompts[0], 1), prompts[0][BLOCK:2 * BLOCK]
    whole = decode((one_root / key.hex()[:2] / f"{key.hex()}.kvb").read_bytes(), key, toks)
    sharded = decode((two_root / key.hex()[:2] / f"{key.hex()}.kvb").read_bytes(), key, toks)
    slots, d = config.kv_groups.slots_per_group, config.head_dim
    full = torch.frombuffer(bytearray(whole), dtype=torch.float32).view(slots, 2, BLOCK, 3, d)
    split = torch.frombuffer(bytearray(sharded), dtype=torch.float32).split(
        [slots * 2 * BLOCK * h * d for h in heads])
    parts = [s.view(slots, 2, BLOCK, h, d) for s, h in zip(split, heads, strict=True)]
    torch.testing.assert_close(torch.cat(parts, dim=3), full)

    # a restart at TP=2 loads the prefixes from the tier, with the same tokens
    with LLM(tensor_parallel_size=2, kv_offload_dir=str(tier), **opts) as again:
        assert generate(again, prompts) == ref
        stats = flushed(again)
        assert stats["tier_hit_tokens"] >= sum((len(p) - 1) // BLOCK for p in prompts[:1]) * BLOCK
        assert stats["tier_blocks_loaded"] > 0 and stats["tier_read_failures"] == 0

    # one rank does not read the two ranks' records (its own are gone)
    shutil.rmtree(one_root)
    one = LLM(kv_offload_dir=str(tier), **opts)
    assert generate(one, prompts) == ref
    stats = flushed(one)
    assert stats["tier_hit_tokens"] == 0 and stats["tier_read_failures"] == 0
    one.shutdown()
