"""Sliding-window paging end to end: a Mistral-style model (every layer slides) on a prompt four
times its window keeps at most window/block_size + 1 blocks per sequence after every step, and
its greedy tokens still equal HF transformers' (fp32); a hybrid model (Qwen2 with full layers
below max_window_layers) keeps every block in its full group only."""

from __future__ import annotations

import random

import pytest

from octavo import LLM
from octavo.config import ModelConfig
from tests.model.models.test_families import GREEDY, MAX_TOKENS, build, hf_greedy

WINDOW = 48
BLOCK = 16


@pytest.fixture(scope="module")
def long_mistral(tmp_path_factory):
    path = build(tmp_path_factory.mktemp("swa"), "mistral", sliding_window=WINDOW)
    rng = random.Random(11)
    prompt = [rng.randrange(3, 256) for _ in range(4 * WINDOW)]
    return path, prompt, hf_greedy(path, [prompt])[0]


def run_stepwise(llm: LLM, prompt: list[int]) -> tuple[list[int], list[dict]]:
    """Generate step by step, keeping the KV stats after every step."""
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt}, GREEDY)
    seen: list[dict] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        seen.append(engine.kv.stats())
        engine.check_invariants()
    return tokens, seen


@pytest.mark.parametrize("chunk", [None, 32], ids=["whole-prompt", "chunked-32"])
def test_a_prompt_four_windows_long_holds_one_window_of_blocks(long_mistral, chunk) -> None:
    path, prompt, ref = long_mistral
    opts = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(model=str(path), block_size=BLOCK, num_kv_blocks=64, **opts)
    assert llm.engine.kv.windows == (WINDOW,)
    tokens, seen = run_stepwise(llm, prompt)
    assert tokens == ref
    bound = WINDOW // BLOCK + 1
    held = [s["kv_sliding_blocks_held_max"] for s in seen]
    assert max(held) <= bound, f"a sliding sequence held {max(held)} blocks (bound {bound})"
    assert held[-2] == bound  # steady state: exactly the window's blocks plus the one written
    total = -(-(len(prompt) + MAX_TOKENS) // BLOCK)
    assert seen[-1]["kv_blocks_freed_out_of_window"] >= total - bound - 1
    if chunk:  # a step holds the window plus the chunk, never the whole prompt
        assert seen[-1]["peak_kv_blocks_used"] <= bound + chunk // BLOCK + 1
    assert seen[-1]["kv_blocks_used"] == 0


def test_the_full_group_of_a_hybrid_model_keeps_every_block(tmp_path) -> None:
    """Qwen2 with max_window_layers=1: layer 0 full, layers 1-2 sliding (two groups of one)."""
    path = build(tmp_path / "q", "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                 max_window_layers=1)
    assert ModelConfig.from_dir(path).kv_groups.windows == (None, WINDOW, WINDOW)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 256) for _ in range(3 * WINDOW)]
    llm = LLM(model=str(path), block_size=BLOCK, num_kv_blocks=96)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt}, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        (seq_id,) = [s for s in engine.scheduler.seqs] or [None]
        if seq_id is None:
            continue
        full, *sliding = engine.kv.block_tables(seq_id)
        null = engine.kv.null_block_id
        assert null not in full
        for table in sliding:
            assert len(table) == len(full)
            assert sum(b != null for b in table) <= WINDOW // BLOCK + 1
    assert tokens == hf_greedy(path, [prompt])[0]
    assert engine.kv.stats()["kv_blocks_used"] == 0
