"""A forked sequence writing into a shared block triggers exactly one copy, and both
sequences continue correctly."""

from __future__ import annotations

from octavo import LLM, SamplingParams


def test_fork_write_into_shared_block_copies_once(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=32, max_model_len=128)
    engine = llm.engine
    copies: list[list[tuple[int, int]]] = []
    take = engine.kv.take_block_copies

    def recording_take():
        got = take()
        copies.append(got)
        return got

    engine.kv.take_block_copies = recording_take
    prompt = {"prompt_token_ids": list(range(3, 3 + 20))}  # 16 + 4: the last block is partial
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    single = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    copies.clear()
    forked = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=8,
                                                 ignore_eos=True), use_tqdm=False)[0]
    # both children write their first token into the shared partial block: the first writer
    # gets a copy, the last one (now the only holder) writes in place
    all_copies = [c for step in copies for c in step]
    assert len(all_copies) == 1
    assert [o.token_ids for o in forked.outputs] == [single, single]
    assert llm.stats()["kv_blocks_used"] == 0
