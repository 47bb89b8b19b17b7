"""Beam search over copy-on-write forks returns transformers' best beam."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from octavo import LLM, BeamSearchParams
from octavo.engine.beam_search import BeamSearchState
from octavo.model.sample.sampler import compute_logprobs
from octavo.outputs import Logprob

TEXTS = ["The capital of France is", "def add(a, b):", "My favourite food is",
         "Q: What is 2+2?\nA:", "The weather today"]
QUESTIONS = ["Say hi.", "What is 2+2? Answer with one number.", "Name one color."]


@pytest.fixture(scope="module")
def setup(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = [tok.encode(t) for t in TEXTS]
    # chat prompts: short answers that end with EOS inside the budget exercise finished beams
    prompts += [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                tokenize=True, return_dict=False)
        for q in QUESTIONS
    ]
    return LLM(), hf, prompts


@pytest.mark.parametrize("width", [2, 4])
def test_best_beam_matches_transformers(setup, width):
    llm, hf, prompts = setup
    max_tokens = 20
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    ended_by_eos = 0
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                              do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
        ref_tokens = ref[0, len(p):].tolist()
        eos = hf.generation_config.eos_token_id
        eos = eos if isinstance(eos, int) else eos[0]
        if eos in ref_tokens:  # transformers pads after EOS
            ref_tokens = ref_tokens[: ref_tokens.index(eos) + 1]
            ended_by_eos += 1
        best = out.sequences[0]
        assert best.tokens[len(p):] == ref_tokens
        assert len(out.sequences) == width
        scores = [s.cum_logprob / len(s.tokens[len(p):]) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
    assert ended_by_eos >= 1, "no prompt exercised finished (EOS) beams"
    assert llm.stats()["kv_blocks_used"] == 0


def test_beams_share_blocks_while_running(setup):
    llm, _, prompts = setup
    engine = llm.engine
    engine.add_request("beams", {"prompt_token_ids": prompts[0] * 8},
                       beam_params=BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    saved = []
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        saved.append(engine.stats()["kv_blocks_saved_by_sharing"])
    # 4 beams over a ~40-token prompt share its full blocks
    assert max(saved) >= 3 * (len(prompts[0]) * 8 // 16) - 3
    assert engine.stats()["kv_blocks_used"] == 0


def top_logprobs(logits: list[list[float]], k: int) -> list[dict[int, Logprob]]:
    """What the runner hands a beam: its top-k next-token logprobs with ranks."""
    return compute_logprobs(torch.tensor(logits), [0] * len(logits), k)


def test_selection_rules_unit():
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    state = BeamSearchState(params, eos_token_id=0)
    sel = state.step(top_logprobs([[0.0, 3.0, 2.0, -5.0]], 4), [[]])
    assert [(s.parent, s.token_id) for s in sel] == [(0, 1), (0, 2)]
    # beam 1 (token 2) now prefers EOS strongly: a finished hypothesis of rank < width
    sel = state.step(top_logprobs([[0.0, 1.0, 1.0, 1.0], [9.0, -9.0, -9.0, -9.0]], 4),
                     [[1], [2]])
    assert state.finished and state.finished[0].token_ids == [2, 0]
    assert all(s.token_id != 0 for s in sel)


def test_top_2k_per_beam_equals_a_search_over_the_whole_vocabulary():
    """Each beam only hands over its top 2k tokens: the pick is the same as over every token
    of every beam (the float32 scores transformers uses), checked against a brute force."""
    gen = torch.Generator().manual_seed(0)
    k, vocab = 3, 50
    state = BeamSearchState(BeamSearchParams(beam_width=k, max_tokens=10), eos_token_id=None)
    outputs: list[list[int]] = [[]]
    for _ in range(5):
        logits = torch.randn(len(outputs), vocab, generator=gen) * 3
        scores = torch.tensor(state.running_scores, dtype=torch.float32)
        flat = (logits.log_softmax(-1) + scores[:, None]).reshape(-1)
        want = [divmod(i, vocab) for i in flat.topk(k).indices.tolist()]
        sel = state.step(top_logprobs(logits.tolist(), 2 * k), outputs)
        assert [(s.parent, s.token_id) for s in sel] == want
        assert [s.cum_logprob for s in sel] == flat.topk(k).values.tolist()
        outputs = [outputs[s.parent] + [s.token_id] for s in sel]
