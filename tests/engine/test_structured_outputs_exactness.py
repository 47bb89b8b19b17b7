"""Structured outputs (constrained decoding) on the embedded SmolLM2 (fp32): greedy constrained
outputs are exact.

Under preemption (recompute and swap) and chunked prefill, across block sizes 8/16/32 and with
speculative decoding, every output follows its constraint, with greedy outputs equal to a roomy
engine's; greedy constrained decoding is deterministic and equals a brute-force reference built
from HF transformers' logits and the vocabulary. Last, every KV block back in the pool in every
engine the structured-outputs tests built (in a whole run this file comes after
test_structured_outputs_constraints.py, whose engines it checks too).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.sampling_params import StructuredOutputsParams as SO
from tests.engine.structured_outputs_helpers import (
    _ENGINES,
    CHOICES,
    NAMES,
    REGEXES,
    ROOMY_BLOCKS,
    _build,
    assert_idle,
    chat,
    check_valid,
    json_params,
    roomy_llm,
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return roomy_llm()


@pytest.fixture(scope="module")
def tok(llm):
    return llm.engine.tokenizer


# ---- 4-5. preemption, chunked prefill, block sizes; greedy equals the roomy engine -----------

SUBJECTS = ["for a customer", "for a test", "from a shop"]


def preemption_requests(tok) -> tuple[list[str], list[SamplingParams], list[str]]:
    """16 requests: 10 greedy JSON, 2 greedy regex, 1 greedy choice, 3 seeded-sampled JSON."""
    prompts, params, kinds = [], [], []
    for i in range(13):
        name = NAMES[i % 6]
        prompts.append(chat(tok, f"Write a JSON object of a {name} {SUBJECTS[i // 6]}."))
        sampled = i >= 10
        params.append(json_params(name, temperature=1.0 if sampled else 0.0,
                                  seed=7 + i if sampled else None))
        kinds.append(name)
    prompts += [chat(tok, "Give me a phone number."), chat(tok, "Give me a date."),
                chat(tok, "Pick one of the options.")]
    params += [SamplingParams(temperature=0, max_tokens=100,
                              structured_outputs=SO(regex=REGEXES["phone"])),
               SamplingParams(temperature=0, max_tokens=100,
                              structured_outputs=SO(regex=REGEXES["date"])),
               SamplingParams(temperature=0, max_tokens=100,
                              structured_outputs=SO(choice=CHOICES))]
    kinds += ["regex:phone", "regex:date", "choice"]
    return prompts, params, kinds


def drive(llm: LLM, prompts, params) -> tuple[list, dict[str, int]]:
    """Run requests through engine.step() (what LLM.generate does), checking the allocator's
    invariants every step and recording peaks of the host pool and of running requests."""
    engine = llm.engine
    ids = [f"pre-{i}-{id(prompts)}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, p, sp)
    done: dict[str, Any] = {}
    peaks = {"kv_cpu_blocks_used": 0, "num_requests_swapped": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
        s = engine.stats()
        for k in peaks:
            peaks[k] = max(peaks[k], s[k])
    return [done[rid] for rid in ids], peaks


@pytest.fixture(scope="module")
def roomy_reference(llm, tok):
    """The 16 requests on the roomy engine (one batch), and the first three of them alone."""
    prompts, params, kinds = preemption_requests(tok)
    batch = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate(prompts[i], params[i], use_tqdm=False)[0].outputs[0]
             for i in (0, 3, 13)]
    return prompts, params, kinds, batch, alone


def test_roomy_batch_equals_alone(roomy_reference, llm):
    _, _, kinds, batch, alone = roomy_reference
    for i, a in zip((0, 3, 13), alone, strict=True):
        assert batch[i].token_ids == a.token_ids, kinds[i]
    for kind, c in zip(kinds, batch, strict=True):
        assert c.finish_reason == "stop" and check_valid(kind, c.text), (kind, c.text)
    assert_idle(llm)


@pytest.mark.parametrize("config", [
    dict(block_size=8, num_kv_blocks=40, max_num_batched_tokens=64,
         preemption_mode="recompute"),
    dict(block_size=32, num_kv_blocks=10, max_num_batched_tokens=48, preemption_mode="swap"),
], ids=["bs8-recompute-chunked", "bs32-swap-chunked"])
def test_preemption_chunked_prefill_block_sizes(roomy_reference, config):
    """16 concurrent requests on a 320-token KV cache with a small token budget (chunked
    prefill): preemptions happen (swap mode really swaps), every output is valid, finishes
    'stop', and equals the roomy engine's (block size 16) token for token; greedy and seeded."""
    prompts, params, kinds, batch, _ = roomy_reference
    small = _build(**config)
    outs, peaks = drive(small, prompts, params)
    stats = small.engine.stats()
    assert stats["num_preemptions"] > 0, stats
    if config["preemption_mode"] == "swap":
        assert stats["kv_cpu_blocks_total"] > 0
        assert peaks["kv_cpu_blocks_used"] > 0 and peaks["num_requests_swapped"] > 0, peaks
    mismatches, invalid = [], []
    for kind, out, ref in zip(kinds, outs, batch, strict=True):
        c = out.outputs[0]
        if c.finish_reason != "stop" or not check_valid(kind, c.text):
            invalid.append(f"{kind}: {c.finish_reason}: {c.text!r}")
        if c.token_ids != ref.token_ids:
            mismatches.append(f"{kind}: {c.text!r} != roomy {ref.text!r}")
    assert not invalid, "\n".join(invalid)
    assert not mismatches, "\n".join(mismatches)
    assert_idle(small)


def test_speculative_decoding_keeps_constrained_outputs(roomy_reference):
    """n-gram drafts for constrained sequences: only drafts the grammar takes are sent, each
    draft position samples under the mask after the drafts before it, and every output equals
    the roomy engine's token for token (greedy and seeded), valid and finished 'stop'."""
    prompts, params, kinds, batch, _ = roomy_reference
    spec = _build(num_kv_blocks=ROOMY_BLOCKS, block_size=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "cost_model": False})
    outs = spec.generate(prompts, params, use_tqdm=False)
    for kind, out, ref in zip(kinds, outs, batch, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check_valid(kind, c.text), (kind, c.text)
        assert c.token_ids == ref.token_ids, (kind, c.text, ref.text)
    stats = spec.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert_idle(spec)


def test_greedy_constrained_deterministic(llm, tok):
    """The same greedy constrained requests twice, in different batch company: same tokens."""
    prompts, params, kinds = preemption_requests(tok)
    pick = [0, 3, 13, 15]
    first = llm.generate([prompts[i] for i in pick], [params[i] for i in pick], use_tqdm=False)
    second = llm.generate([prompts[i] for i in reversed(pick)],
                          [params[i] for i in reversed(pick)], use_tqdm=False)[::-1]
    for a, b in zip(first, second, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_idle(llm)


# ---- 5. greedy constrained decoding equals a brute-force reference (HF logits) --------------

@pytest.fixture(scope="module")
def vocab_text(tok) -> list[str | None]:
    """Each token's text; None for added/special tokens (a grammar never allows them)."""
    special = set(tok.added_tokens_decoder)
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    return [None if i in special else t for i, t in enumerate(texts)]


def brute_force_greedy(hf_model, prompt_ids, vocab_text, eos, allowed_after, max_steps=12):
    """Greedy decoding where each step's allowed tokens are found by scanning the vocabulary
    with `allowed_after(text, token_text) -> bool` (and `allowed_after(text, None)` says
    whether EOS may end `text`)."""
    out: list[int] = []
    text = ""
    with torch.no_grad():
        for _ in range(max_steps):
            logits = hf_model(torch.tensor([prompt_ids + out])).logits[0, -1]
            cands = [i for i, t in enumerate(vocab_text) if t and allowed_after(text, t)]
            if allowed_after(text, None):
                cands.append(eos)
            assert cands, f"no token allowed after {text!r}"
            best = max(cands, key=lambda i: logits[i].item())
            out.append(best)
            if best == eos:
                return out
            text += vocab_text[best]
    return out


def choice_rule(choices):
    def allowed(text, piece):
        if piece is None:
            return text in choices
        return any(c.startswith(text + piece) for c in choices)
    return allowed


def digits_rule(n):
    def allowed(text, piece):
        if piece is None:
            return len(text) == n
        return piece.isascii() and piece.isdigit() and len(text) + len(piece) <= n
    return allowed


def test_greedy_equals_brute_force_reference(llm, tok, hf_model, vocab_text):
    eos = llm.engine.eos_token_id
    cases = [
        (chat(tok, "Is the sky blue? Answer yes or no."), SO(choice=["yes", "no"]),
         choice_rule(["yes", "no"])),
        (chat(tok, "Is fire cold? Answer yes or no."), SO(choice=["yes", "no"]),
         choice_rule(["yes", "no"])),
        (chat(tok, "Pick a colour."), SO(choice=["red", "green", "blue", "yellow"]),
         choice_rule(["red", "green", "blue", "yellow"])),
        (chat(tok, "What is 12 times 12?"), SO(regex="[0-9]{3}"), digits_rule(3)),
        (chat(tok, "Give me a year."), SO(regex="[0-9]{4}"), digits_rule(4)),
    ]
    outs = llm.generate([c[0] for c in cases],
                        [SamplingParams(temperature=0, max_tokens=20, structured_outputs=c[1])
                         for c in cases], use_tqdm=False)
    for (_, _, rule), out in zip(cases, outs, strict=True):
        ref = brute_force_greedy(hf_model, list(out.prompt_token_ids), vocab_text, eos, rule)
        assert out.outputs[0].token_ids == ref, (out.outputs[0].text, tok.decode(ref))
        assert out.outputs[0].finish_reason == "stop"
    assert_idle(llm)


# ---- 8. every block back in the pool -----------------------------------------------------------

def test_every_engine_idle_at_the_end(llm):
    assert _ENGINES
    for engine in _ENGINES:
        assert_idle(engine)
        s = engine.engine.stats()
        assert s["kv_slots_live"] == 0
        assert s["kv_blocks_saved_by_sharing"] == 0
