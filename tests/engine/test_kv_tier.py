"""The KV tier end to end: greedy tokens served from tier hits equal the tokens computed
without them (block sizes 16 and 256, chunked prefill, a sliding-window model and a hybrid one,
batched and alone), after a restart, after the pool evicted the blocks, between two servers
sharing one directory, and when the tier's files are corrupt, truncated, gone or cannot be
written. Each run ends with every KV block back in the pool and the KV invariants holding."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from pathlib import Path

import pytest

from octavo import LLM, SamplingParams
from octavo.config import ModelConfig
from octavo.engine_args import EngineArgs, EngineArgsError
from octavo.paging import BlockHasher
from octavo.paging.tier import DiskStore
from octavo.paging.tier.record import record_size
from tests.model.models.test_families import (
    COMMON,
    FAMILIES,
    build,
    build_model,
    perturb_biases_and_norms,
)

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_prompts(seed: int, prefix_len: int, suffixes: tuple[int, ...]) -> list[list[int]]:
    """Prompts sharing a prefix (the pool and the tier both have something to find), then one
    of their own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(prefix_len)]
    out = [prefix + [rng.randrange(3, 256) for _ in range(n)] for n in suffixes]
    return out + [[rng.randrange(3, 256) for _ in range(prefix_len // 2)]]


def generate(llm: LLM, prompts: list[list[int]], alone: bool = False) -> list[list[int]]:
    batches = [[p] for p in prompts] if alone else [prompts]
    got = []
    for batch in batches:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        got += [list(o.outputs[0].token_ids) for o in outs]
    llm.engine.check_invariants()
    assert llm.stats()["kv_blocks_used"] == 0
    return got


def tier_llm(model: Path, tier: Path, **opts) -> LLM:
    return LLM(model=str(model), kv_offload_dir=str(tier), **opts)


def written(llm: LLM) -> int:
    tier = llm.engine.tier
    assert tier is not None
    assert tier.flush(30)
    return llm.stats()["tier_blocks_written"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("llama"), "mistral-full")


@pytest.fixture(scope="module")
def written_tier(llama, tmp_path_factory):
    """A tier a server wrote at block size 16 (its outputs are the reference: it had no tier
    hits), shared read-only by the fault tests (each copies it)."""
    tier = tmp_path_factory.mktemp("tier16")
    prompts = make_prompts(1, 100, (20, 45))
    llm = tier_llm(llama, tier, block_size=16, num_kv_blocks=128)
    ref = generate(llm, prompts)
    assert llm.stats()["tier_hit_tokens"] == 0
    assert written(llm) > 0
    return tier, prompts, ref


CONFIGS = {
    # name: (model, block size, engine options, prompt prefix length, suffix lengths)
    "bs256": ("mistral-full", 256, {"num_kv_blocks": 8}, 300, (30, 80)),
    "chunked": ("mistral-full", 16, {"num_kv_blocks": 128, "max_num_batched_tokens": 48},
                100, (20, 45)),
    "sliding": ("mistral", 16, {"num_kv_blocks": 128}, 100, (20, 45)),
    "hybrid": ("qwen2", 16, {"num_kv_blocks": 192}, 100, (20, 45)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_restarted_server_serves_tier_hits_with_the_same_tokens(name, tmp_path) -> None:
    family, bs, opts, prefix_len, suffixes = CONFIGS[name]
    model = build(tmp_path / "m", family)
    prompts = make_prompts(2, prefix_len, suffixes)
    first = tier_llm(model, tmp_path / "tier", block_size=bs, **opts)
    ref = generate(first, prompts)
    assert written(first) > 0
    again = tier_llm(model, tmp_path / "tier", block_size=bs, **opts)
    assert generate(again, prompts) == ref
    stats = again.stats()
    assert stats["tier_hit_tokens"] >= bs
    assert stats["tier_read_failures"] == 0


def test_tier_hits_alone_and_batched_and_mixed_with_pool_hits(llama, written_tier) -> None:
    tier, prompts, ref = written_tier
    batched = tier_llm(llama, tier, block_size=16, num_kv_blocks=128)
    assert generate(batched, prompts) == ref
    # one by one: the first loads the shared prefix from the tier, the others hit it in the pool
    # and load only their own blocks
    alone = tier_llm(llama, tier, block_size=16, num_kv_blocks=128)
    assert generate(alone, prompts, alone=True) == ref
    stats = alone.stats()
    full = sum((len(p) - 1) // 16 for p in prompts) * 16
    assert stats["tier_hit_tokens"] < stats["prefix_cache_hit_tokens"] == full


def test_blocks_evicted_from_the_pool_come_back_from_the_tier(llama, tmp_path) -> None:
    prompts = make_prompts(3, 96, (16,))
    llm = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=16,
                   kv_offload_write="evict")
    ref = generate(llm, prompts[:1])
    generate(llm, make_prompts(4, 160, (16,))[:1])  # takes every block: the first is evicted
    assert llm.stats()["tier_blocks_written"] + llm.stats()["tier_writes_pending"] > 0
    written(llm)
    assert generate(llm, prompts[:1]) == ref
    assert llm.stats()["tier_hit_tokens"] >= 16


def test_two_servers_share_one_tier(llama, tmp_path) -> None:
    """Both up at once: the second finds what the first wrote after it started."""
    prompts = make_prompts(5, 128, (10, 30, 50))
    a = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=128)
    b = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=128)
    ref = generate(a, prompts)
    written(a)
    assert generate(b, prompts) == ref
    stats = b.stats()
    # what the second found of the first's prompts (the tier's blocks, or the pool's once the
    # tier gave them), of what a prefix hit can cover (every full block but the last token's)
    hit_rate = stats["prefix_cache_hit_tokens"] / stats["prefix_cache_query_tokens"]
    can_hit = sum((len(p) - 1) // 16 * 16 for p in prompts) / stats["prefix_cache_query_tokens"]
    assert hit_rate == can_hit > 0.8
    assert stats["tier_hit_tokens"] >= (len(prompts[0]) - 1) // 16 * 16
    assert stats["tier_blocks_written"] == 0  # nothing new to write: the first one did


def block_key(prompt: list[int], i: int) -> bytes:
    """The tier key of block i of a prompt (block size 16, no cache salt, group 0)."""
    hashes: list[bytes] = []
    BlockHasher(16).extend(hashes, prompt, None)
    return hashes[i]


def test_corrupt_truncated_and_missing_records_are_recomputed(llama, written_tier, tmp_path,
                                                               caplog) -> None:
    src, prompts, ref = written_tier
    tier = tmp_path / "tier"
    shutil.copytree(src, tier)
    llm = tier_llm(llama, tier, block_size=16, num_kv_blocks=128)
    store = llm.engine.tier.store
    # the last block of the first prompt flipped, a block of the second's own truncated, the
    # second block of the third gone: every kind of damage a reader may meet
    flip, cut, gone = (store.path(block_key(prompts[0], 6)), store.path(block_key(prompts[1], 7)),
                       store.path(block_key(prompts[2], 1)))
    data = bytearray(flip.read_bytes())
    data[-7] ^= 0xFF
    flip.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:100])
    damaged = {flip: flip.read_bytes(), cut: cut.read_bytes()}
    gone.unlink()
    # a server started earlier in this process rate-limits octavo's log lines (one per message
    # a minute): here each damaged record must say so
    tier_log = logging.getLogger("octavo.paging.tier.kv_tier")
    limits = list(tier_log.filters)
    for f in limits:
        tier_log.removeFilter(f)
    try:
        with caplog.at_level("WARNING"):
            assert generate(llm, prompts) == ref
    finally:
        for f in limits:
            tier_log.addFilter(f)
    stats = llm.stats()
    assert stats["tier_read_failures"] == 3
    assert stats["tier_hit_tokens"] == (6 + 1 + 1) * 16  # up to each damaged block
    assert caplog.text.count("recomputing from there") == 3
    # a record that failed its check is removed; the recomputed block may be written again
    # (by the writer's thread, at its own pace), so what is there after a flush is a new record
    assert llm.engine.tier.flush(30)
    for path, bad in damaged.items():
        assert not path.exists() or path.read_bytes() != bad


def test_a_vanished_tier_directory_falls_back_to_recompute(llama, written_tier,
                                                           tmp_path) -> None:
    src, prompts, ref = written_tier
    tier = tmp_path / "tier"
    shutil.copytree(src, tier)
    llm = tier_llm(llama, tier, block_size=16, num_kv_blocks=128)
    shutil.rmtree(tier)
    assert generate(llm, prompts) == ref
    assert llm.stats()["tier_hit_tokens"] == 0
    written(llm)  # the writer makes the directory again
    assert llm.stats()["tier_blocks_written"] > 0


def test_a_full_disk_loses_saves_not_tokens(llama, tmp_path, monkeypatch) -> None:
    prompts = make_prompts(6, 100, (20,))
    llm = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=128)

    def disk_full(fd: int, parts) -> None:
        os.write(fd, bytes(memoryview(parts[0])[:10]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "_write_record", staticmethod(disk_full))
    ref = generate(llm, prompts)
    assert written(llm) == 0
    stats = llm.stats()
    assert stats["tier_write_errors"] > 0 and stats["tier_blocks"] == 0
    assert list((tmp_path / "tier").rglob("*.tmp")) == []  # no half-written record left
    monkeypatch.undo()
    again = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=128)
    assert generate(again, prompts) == ref


def test_the_size_bound_evicts_the_least_recently_used(llama, tmp_path) -> None:
    payload = ModelConfig.from_dir(llama).kv_bytes_per_slot(4) * 16
    bound = 6 * record_size(bytes(16), 16, payload)
    llm = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=128,
                   kv_offload_bytes=bound)
    prompts = make_prompts(8, 100, (20, 45))
    ref = generate(llm, prompts)
    written(llm)
    stats = llm.stats()
    assert stats["tier_evictions"] > 0
    assert 0 < stats["tier_bytes"] <= bound
    assert sum(f.stat().st_size for f in (tmp_path / "tier").rglob("*.kvb")) <= bound
    again = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=128,
                     kv_offload_bytes=bound)
    assert generate(again, prompts) == ref


def test_another_model_or_block_size_never_reads_the_records(llama, written_tier,
                                                              tmp_path) -> None:
    tier, prompts, ref = written_tier
    # the same architecture and config, other weights
    other = build_model(tmp_path / "m", FAMILIES["mistral-full"], COMMON, seed=2,
                        perturb=perturb_biases_and_norms)
    llm = tier_llm(other, tier, block_size=16, num_kv_blocks=128)
    generate(llm, prompts)
    assert llm.stats()["tier_hit_tokens"] == 0 and llm.stats()["tier_read_failures"] == 0
    llm = tier_llm(llama, tier, block_size=32, num_kv_blocks=64)
    generate(llm, prompts)
    assert llm.stats()["tier_hit_tokens"] == 0


def test_the_page_map_shows_blocks_on_their_way_to_and_from_the_tier(llama, tmp_path) -> None:
    short, long = make_prompts(10, 64, (1,))[0], make_prompts(11, 64, (1,))[0]
    llm = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("short", {"prompt_token_ids": short},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    engine.add_request("long", {"prompt_token_ids": long}, GREEDY)
    engine.step()  # the short one finishes: its blocks wait for the next step's copy
    saving = engine.kv_map()["device"]["tier_saving"]
    assert len(saving) == len(short) // 16
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_map()["device"]["tier_saving"] == []
    written(llm)
    again = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=64)
    again.engine.add_request("r", {"prompt_token_ids": short}, GREEDY)
    again.engine.step()
    loaded = again.engine.kv_map()["device"]["tier_loaded"]
    assert loaded == sorted(again.engine.kv.block_table(again.engine.scheduler.running[0]
                                                        .seqs[0].seq_id)[: len(loaded)])
    assert len(loaded) == (len(short) - 1) // 16


@pytest.mark.parametrize(("opts", "bad"), [
    ({"kv_offload_bytes": 1 << 20}, "kv_offload_bytes"),
    ({"kv_offload_dir": "/t", "kv_offload_url": "redis://h:1/0"}, "kv_offload_url"),
    ({"kv_offload_url": "redis://h:1/0", "kv_offload_bytes": 1 << 20}, "kv_offload_bytes"),
    ({"kv_offload_url": "http://h:1"}, "kv_offload_url"),
    ({"kv_offload_dir": "/t", "enable_prefix_caching": False}, "kv_offload_dir"),
    ({"kv_offload_dir": "/t", "kv_offload_write": "always"}, "kv_offload_write"),
])
def test_tier_options_are_checked(opts, bad) -> None:
    with pytest.raises(EngineArgsError) as e:
        EngineArgs(**opts)
    assert e.value.option == bad


def test_an_aborted_requests_blocks_reach_the_tier_without_another_step(llama,
                                                                         tmp_path) -> None:
    prompt = make_prompts(13, 64, (1,))[0]
    llm = tier_llm(llama, tmp_path / "tier", block_size=16, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("r")
    assert engine.kv_map()["device"]["tier_saving"] == []
    assert written(llm) == len(prompt) // 16
