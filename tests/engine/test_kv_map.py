"""LLMEngine.kv_map(): one consistent snapshot of the page map, the block tables and stats()."""

from __future__ import annotations

import json

import pytest

from octavo import LLM, SamplingParams
from tests.engine.conftest import tokens_prompt

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def prompt(seed: int, n: int) -> dict:
    return tokens_prompt([3 + (seed * 31 + i * 7) % 250 for i in range(n)])


def check_consistent(engine) -> dict:
    """Every figure of the snapshot agrees with the engine at the same moment."""
    snap = engine.kv_map(block_tables=True)
    json.dumps(snap)  # what the endpoint sends
    lean = engine.kv_map()  # the default leaves the tables out, and only them
    for r, full in zip(lean["requests"], snap["requests"], strict=True):
        assert r == {**full, "seqs": [{k: v for k, v in q.items() if k != "block_tables"}
                                      for q in full["seqs"]]}
        assert engine.kv_map_request(r["request_id"]) == full
    stats, kv = snap["stats"], engine.kv
    states = snap["device"]["states"]
    assert len(states) == stats["kv_blocks_total"] == snap["device"]["num_blocks"]
    counts = snap["device"]["counts"]
    assert counts["used"] + counts["shared"] == stats["kv_blocks_used"]
    assert counts["cached"] == stats["kv_blocks_cached_free"]
    assert snap["host"]["counts"]["swapped"] == stats["kv_cpu_blocks_used"]
    refs = dict(zip(snap["device"]["shared_ref_cnt"][::2], snap["device"]["shared_ref_cnt"][1::2],
                    strict=True))
    entries: dict[int, int] = {}
    for r in snap["requests"]:
        for q in r["seqs"]:
            if r["status"] == "waiting":
                assert q["block_tables"] == []
                continue
            swapped, tables = kv.held_tables(q["seq_id"])
            assert (q["swapped"], q["block_tables"]) == (swapped, tables)
            assert q["num_blocks"] == len(tables[0])
            if not swapped:
                for b in tables[0]:
                    entries[b] = entries.get(b, 0) + 1
    for b, n in entries.items():  # each table entry holds a reference
        assert states[b] in "us"
        assert refs.get(b, 1) == kv.block_pool.blocks[b].ref_cnt >= n
    assert snap["num_requests"] == {"running": stats["num_requests_running"],
                                    "swapped": stats["num_requests_swapped"],
                                    "waiting": stats["num_requests_waiting"]}
    return snap


@pytest.fixture
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=16, max_model_len=128,
               max_num_batched_tokens=24, preemption_mode="swap")


def test_snapshots_stay_consistent_through_sharing_swapping_and_caching(llm):
    engine = llm.engine
    engine.add_request("n3", prompt(1, 20), SamplingParams(
        n=3, temperature=1.0, seed=0, max_tokens=40, ignore_eos=True))
    for i in range(3):
        engine.add_request(f"r{i}", prompt(i + 2, 20), LONG)
    seen = {"shared": False, "swapped": False, "waiting": False}
    while engine.has_unfinished_requests():
        engine.step()
        snap = check_consistent(engine)
        seen["shared"] |= "s" in snap["device"]["states"]
        seen["swapped"] |= "w" in snap["host"]["states"]
        seen["waiting"] |= any(r["status"] == "waiting" for r in snap["requests"])
    assert all(seen.values()), seen
    snap = check_consistent(engine)
    assert snap["requests"] == [] and snap["device"]["counts"]["cached"] > 0
    assert engine.kv_map_request("n3") is None


def test_block_details_name_every_holder(llm):
    engine = llm.engine
    engine.add_request("n3", prompt(1, 20), SamplingParams(
        n=3, temperature=1.0, seed=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    (req,) = engine.kv_map(block_tables=True)["requests"]
    first = req["seqs"][0]["block_tables"][0][0]  # the prompt's first block: all three share it
    block = engine.kv_map_block(first)
    assert block["state"] == "shared" and block["ref_cnt"] == 3 and block["filled"] == 8
    assert block["prefix_cached"]
    assert sorted(h["seq_id"] for h in block["holders"]) == sorted(
        q["seq_id"] for q in req["seqs"])
    assert {(h["request_id"], h["group"], h["logical"]) for h in block["holders"]} == {
        ("n3", 0, 0)}
    free = engine.kv_map()["device"]["states"].index("f")
    assert engine.kv_map_block(free) == {
        "block_id": free, "pool": "device", "state": "free", "ref_cnt": 0, "filled": 0,
        "prefix_cached": False, "holders": []}
    with pytest.raises(ValueError, match="not in the device pool"):
        engine.kv_map_block(16)
    with pytest.raises(ValueError, match="not in the host pool"):
        engine.kv_map_block(-1, host=True)


def test_the_contiguous_shadow_holds_the_same_tokens_in_reservations(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=64, max_model_len=128)
    engine = llm.engine
    engine.add_request("n4", prompt(1, 20), SamplingParams(
        n=4, temperature=1.0, seed=0, max_tokens=40, ignore_eos=True))
    for _ in range(5):
        engine.step()
    snap = check_consistent(engine)
    live = snap["stats"]["kv_slots_live"]
    contiguous = snap["contiguous"]
    assert contiguous["reserve"] == "request"
    # four sequences of 60 tokens reserve 8 blocks each: they fit, holding each token once
    # per sequence (no sharing), so more live slots than the paged cache's shared blocks
    assert contiguous["num_seqs_placed"] == 4
    assert contiguous["states"].count("u") + contiguous["states"].count("r") == 4 * 8
    assert contiguous["slots"]["kv_slots_live"] == 4 * (20 + 4) > live
    by_len = engine.kv_map("max_model_len")["contiguous"]
    assert by_len["reserve"] == "max_model_len"
    # 128 tokens = 16 blocks each: four of them fill all 64 blocks
    assert by_len["num_seqs_placed"] == 4 and "f" not in by_len["states"]
    assert engine.kv_map(None)["contiguous"] is None
    with pytest.raises(ValueError, match="contiguous must be one of"):
        engine.kv_map("everything")


def test_the_contiguous_engine_maps_its_own_layout(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=64, max_model_len=128,
              kv_allocator="contiguous")
    engine = llm.engine
    engine.add_request("a", prompt(1, 20), LONG)
    engine.step()
    snap = engine.kv_map()
    assert snap["allocator"] == "contiguous" and "contiguous" not in snap
    assert snap["device"]["states"] == "uuu" + "r" * 13 + "f" * 48
    assert snap["requests"][0]["seqs"][0]["num_blocks"] == 3
    assert engine.kv_map_request("a")["seqs"][0]["block_tables"] == [list(range(16))]
