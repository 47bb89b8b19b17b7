"""What the hybrid families' tests (recurrent layers beside attention) check beyond
test_families.py's greedy configurations: n = 4 samples and beam search against transformers,
swap preemption, a state pool smaller than the batch, and every state slot back in the pool at
the end."""

from __future__ import annotations

from pathlib import Path

import torch

from octavo import LLM, BeamSearchParams, SamplingParams
from octavo.config import ModelConfig
from tests.model.models.test_families import GREEDY, MAX_TOKENS

# the KV cache the engines here get unless a configuration names its blocks: the 1 GiB default
# is millions of blocks for these few-layer models at block size 1, slow to set up
KV_BYTES = 32 << 20

# the test_families.py configurations, plus swap preemption and a small state pool
HYBRID_CONFIGS = {
    "swap-chunked": dict(block_size=16, num_kv_blocks=24, max_num_batched_tokens=40,
                         preemption_mode="swap", enable_prefix_caching=False),
    "few-state-slots": dict(block_size=16, num_state_slots=3, max_num_seqs=3,
                            enable_prefix_caching=True),
}


def check_hybrid(name: str, path: Path, ps: list[list[int]], refs: list[list[int]],
                 config: str) -> LLM:
    args = dict(HYBRID_CONFIGS[config])
    if "num_kv_blocks" in args:  # the same memory: a hybrid cache's blocks hold fewer layers
        args["num_kv_blocks"] *= ModelConfig.from_dir(path).kv_groups.num_groups
    llm = LLM(model=str(path), **{"kv_cache_memory_bytes": KV_BYTES, **args})
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == refs[i], f"{name} {config}: prompt {i} differs"
    stats = llm.stats()
    if config == "swap-chunked":
        assert stats["num_preemptions"] > 0 and stats["kv_cpu_blocks_total"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_cpu_blocks_used"] == 0
    assert stats.get("state_slots_used", 0) == 0 and stats.get("state_cpu_slots_used", 0) == 0
    return llm


def hf_model(path: Path, **load: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    model.generation_config.eos_token_id = None
    return model


def check_n4_and_beams(path: Path, prompt: list[int], **load: str) -> None:
    """n = 4 greedy samples all give transformers' greedy tokens (each copies the parent's
    state, where it has one, on its first write), and beam search gives transformers' best
    beam; `load`: from_pretrained options."""
    model = hf_model(path, **load)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(prompt):]
        beams = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4,
                               do_sample=False, max_new_tokens=12, pad_token_id=0)
    llm = LLM(model=str(path), block_size=16, kv_cache_memory_bytes=KV_BYTES)
    params = SamplingParams(n=4, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [greedy.tolist()] * 4
    best = llm.beam_search([{"prompt_token_ids": prompt}],
                           BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))[0]
    assert best.sequences[0].tokens[len(prompt):] == beams[0, len(prompt):].tolist()
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats.get("state_slots_used", 0) == 0
