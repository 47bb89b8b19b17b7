"""Speculative decoding (n-gram) in the engine, on the tiny random-weight model: the same tokens
as without it (greedy and seeded), the target distribution when sampling (chi-square), stop
strings, logprobs, n > 1 and max_tokens, and every block back in the pool."""

from __future__ import annotations

import random

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.engine.conftest import tokens_prompt

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "cost_model": False}


def llm_pair(model_dir, **kw) -> tuple[LLM, LLM]:
    plain = LLM(str(model_dir), **kw)
    spec = LLM(str(model_dir), speculative_config=SPEC, **kw)
    return plain, spec


def spec_stats(llm: LLM) -> dict:
    return {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}


def generate_both(plain: LLM, spec: LLM, prompts: list[list[int]], params):
    """The same requests without and with speculation."""
    inputs = [tokens_prompt(p) for p in prompts]
    return (plain.generate(inputs, params, use_tqdm=False),
            spec.generate(inputs, params, use_tqdm=False))


def assert_pool_empty(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    llm.engine.kv.check_invariants()


def repetitive_prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts with repeated spans (the n-gram proposer finds drafts) over a few tokens."""
    out = []
    for _ in range(count):
        span = [rng.randrange(3, 40) for _ in range(rng.randint(3, 8))]
        out.append(span * rng.randint(2, 4) + [rng.randrange(3, 40) for _ in range(3)])
    return out


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    return llm_pair(tiny_llama_dir, block_size=16, num_kv_blocks=256, max_model_len=128)


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_and_seeded_outputs_equal_plain_decoding(tiny_llama_dir, block_size):
    plain, spec = llm_pair(tiny_llama_dir, block_size=block_size,
                           num_kv_blocks=4096 // block_size, max_model_len=128)
    rng = random.Random(block_size)
    prompts = repetitive_prompts(rng, 8)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True, top_k=20)
        for s in range(4)]
    want = plain.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)
    batched = spec.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)
    alone = [spec.generate([tokens_prompt(p)], q, use_tqdm=False)[0]
             for p, q in zip(prompts, params, strict=True)]
    for i, w in enumerate(want):
        assert batched[i].outputs[0].token_ids == w.outputs[0].token_ids, f"prompt {i}"
        assert alone[i].outputs[0].token_ids == w.outputs[0].token_ids, f"prompt {i} alone"
    stats = spec_stats(spec)
    assert stats["spec_decode_num_drafts"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert_pool_empty(spec)


def test_sampled_tokens_follow_the_target_distribution(pair, tiny_llama_dir):
    """Temperature 1 over 8 allowed tokens, biased towards 11 and 12. After a first token 11
    the prompt's (10, 11) proposes 12, so the next step verifies the draft 12: the token
    sampled at the verified position and the one sampled after an accepted 12 must both
    follow the model's distribution there (chi-square over 3000 seeds), and the seeded
    outputs equal plain decoding's, token for token."""
    from transformers import AutoModelForCausalLM

    plain, spec = pair
    allowed = list(range(10, 18))
    bias = {11: 2.5, 12: 2.5}
    prompt = [10, 11, 12, 13, 14, 15, 10]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True,
                             allowed_token_ids=allowed, logit_bias=bias) for s in range(3000)]
    before = spec_stats(spec)["spec_decode_num_accepted_tokens"]
    outs = spec.generate([tokens_prompt(prompt)] * len(params), params, use_tqdm=False)
    ref = plain.generate([tokens_prompt(prompt)] * 300, params[:300], use_tqdm=False)
    for a, b in zip(outs, ref, strict=False):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert spec_stats(spec)["spec_decode_num_accepted_tokens"] - before > 300

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def target(context: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([context])).logits[0, -1].double()
        for t, b in bias.items():
            logits[t] += b
        return torch.softmax(logits[allowed], dim=0)

    tokens = [o.outputs[0].token_ids for o in outs]
    verified = [t[1] for t in tokens if t[0] == 11]  # sampled where the draft 12 was checked
    after = [t[2] for t in tokens if t[:2] == [11, 12]]  # sampled after the accepted draft
    for samples, context in ((verified, prompt + [11]), (after, prompt + [11, 12])):
        assert len(samples) > 300
        counts = torch.tensor([samples.count(t) for t in allowed], dtype=torch.double)
        expected = target(context) * len(samples)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 24.32, f"chi-square {chi2:.1f} >= the 0.999 quantile for 7 dof"
    assert_pool_empty(spec)


def test_stop_strings_cut_a_multi_token_step(pair):
    """A stop string inside the tokens of one step ends the output there, tokens and text,
    exactly as without speculation."""
    plain, spec = pair
    rng = random.Random(7)
    prompts = repetitive_prompts(rng, 6)
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = plain.generate([tokens_prompt(p) for p in prompts], base, use_tqdm=False)
    params = []
    for out in full:  # a stop string taken from the middle of each greedy output
        text = out.outputs[0].text
        params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                     stop=[text[len(text) // 2 : len(text) // 2 + 2]]))
    want, got = generate_both(plain, spec, prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason == "stop"
        assert g.outputs[0].stop_reason == w.outputs[0].stop_reason
    assert_pool_empty(spec)


def test_logprobs_n_and_max_tokens(pair):
    plain, spec = pair
    rng = random.Random(3)
    prompts = repetitive_prompts(rng, 4)
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=17, logprobs=2,
                            ignore_eos=True)
    want, got = generate_both(plain, spec, prompts, params)
    for w, g in zip(want, got, strict=True):
        assert len(g.outputs) == 3
        for a, b in zip(w.outputs, g.outputs, strict=True):
            assert b.token_ids == a.token_ids
            assert len(b.token_ids) == 17 and len(b.logprobs) == 17
            for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                assert la.keys() == lb.keys()
                for t in la:
                    assert lb[t].logprob == pytest.approx(la[t].logprob, abs=1e-4)
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
    assert spec_stats(spec)["spec_decode_num_accepted_tokens"] > 0
    assert_pool_empty(spec)


def test_aborts_mid_speculation_return_every_block(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=40, max_model_len=128,
              speculative_config=SPEC)
    engine = llm.engine
    rng = random.Random(11)
    for i, p in enumerate(repetitive_prompts(rng, 6)):
        engine.add_request(f"r{i}", tokens_prompt(p),
                           SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for step in range(40):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        engine.check_invariants()
        if step % 7 == 3 and engine.requests:
            engine.abort_request(sorted(engine.requests)[0])
            engine.check_invariants()
    for rid in list(engine.requests):
        engine.abort_request(rid)
    assert_pool_empty(llm)
    assert spec_stats(llm)["spec_decode_num_drafts"] > 0


def test_drafts_without_free_blocks_are_dropped_not_preempting(tiny_llama_dir):
    """Drafts take blocks only where they are free: with one free block, the first decode's
    drafts take it and the second decode goes ahead without drafts; nobody is preempted."""
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=5, max_model_len=40,
              speculative_config=SPEC, enable_prefix_caching=False)
    engine = llm.engine
    plans = []
    inner = engine.scheduler.schedule

    def schedule():
        plans.append(inner())
        return plans[-1]

    engine.scheduler.schedule = schedule
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # 15 tokens: 2 blocks each
    for i in range(2):  # outputs among the prompt's tokens: the proposer always finds a draft
        engine.add_request(f"r{i}", tokens_prompt(prompt),
                           SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                          allowed_token_ids=[5, 6, 7, 8]))
    engine.step()  # both prefills: 4 blocks used, 1 free
    engine.step()  # both decode at position 15: drafts from 16 on need a third block
    decode = plans[-1].chunks
    assert [len(c.token_ids) for c in decode] == [1, 1]
    assert [len(c.draft_token_ids) > 0 for c in decode] == [True, False]
    assert llm.stats()["num_preemptions"] == 0
    engine.check_invariants()
    for rid in list(engine.requests):
        engine.abort_request(rid)
    assert_pool_empty(llm)


SELF = {"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 1,
        "cost_model": False}


@pytest.mark.parametrize("block_size", [1, 16])
def test_self_draft_gives_plain_decodings_tokens(tiny_llama_dir, block_size):
    """Drafts from the target's first layer and LM head, verified in the batch: greedy and
    seeded outputs as without speculation, blocks all back."""
    kw = dict(block_size=block_size, num_kv_blocks=4096 // block_size, max_model_len=128)
    plain = LLM(str(tiny_llama_dir), **kw)
    spec = LLM(str(tiny_llama_dir), speculative_config=SELF, **kw)
    rng = random.Random(5)
    prompts = repetitive_prompts(rng, 6)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True, logprobs=1)
        for s in range(3)]
    want, got = generate_both(plain, spec, prompts, params)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"prompt {i}"
    stats = spec_stats(spec)
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert_pool_empty(spec)


def test_self_draft_layers_must_leave_a_layer_to_verify(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"num_draft_layers must be in \[1, 1\]"):
        LLM(str(tiny_llama_dir), speculative_config={**SELF, "num_draft_layers": 2})


def draft_config(model_dir) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
            "cost_model": False}


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory):
    from tests.conftest import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), num_hidden_layers=1,
                            hidden_size=32, intermediate_size=64, num_attention_heads=2,
                            num_key_value_heads=1)


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_draft_model_gives_plain_decodings_tokens(tiny_llama_dir, small_draft_dir,
                                                    block_size):
    """A smaller model of the same vocabulary drafts over its own paged KV cache (the
    target's block tables): greedy and seeded outputs as without speculation, batched, with
    a prefix shared between requests and with n > 1."""
    kw = dict(block_size=block_size, num_kv_blocks=4096 // block_size, max_model_len=128)
    plain = LLM(str(tiny_llama_dir), **kw)
    spec = LLM(str(tiny_llama_dir), speculative_config=draft_config(small_draft_dir), **kw)
    rng = random.Random(8)
    prompts = repetitive_prompts(rng, 4)
    prompts += [prompts[0] + [7, 8, 9], prompts[0][:-2]]  # prefix-cache hits
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True, n=2)
        for s in range(3)]
    want, got = generate_both(plain, spec, prompts, params)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        for a, b in zip(w.outputs, g.outputs, strict=True):
            assert b.token_ids == a.token_ids, f"prompt {i}"
    assert spec_stats(spec)["spec_decode_num_draft_tokens"] > 0
    assert_pool_empty(spec)


def test_the_target_as_its_own_draft_model_is_always_right(tiny_llama_dir):
    """With the target itself as the draft model, greedy drafts are the target's own tokens:
    every one is accepted, which only holds if the draft cache's frontier, catch-up and
    lookahead positions are right, through preemption and chunked prefill too."""
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=24, max_model_len=96,
              max_num_batched_tokens=32, speculative_config=draft_config(tiny_llama_dir))
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(10, 50))] for _ in range(6)]
    outs = llm.generate([tokens_prompt(p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_decode_num_draft_tokens"] > 30
    assert stats["spec_decode_num_accepted_tokens"] >= 0.97 * stats["spec_decode_num_draft_tokens"]
    assert_pool_empty(llm)


def test_a_draft_model_must_share_the_vocabulary(tiny_llama_dir, tmp_path):
    from tests.conftest import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match=r"vocabulary \(300\) differs from the target's"):
        LLM(str(tiny_llama_dir), speculative_config=draft_config(other))


def test_eos_inside_a_multi_token_step_hides_only_its_own_text(pair):
    """Sampled outputs over a few tokens and EOS, with drafts: where EOS ends a step of
    several tokens, the text keeps the tokens before it, as plain decoding's does."""
    plain, spec = pair
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, skip_special_tokens=False,
                             allowed_token_ids=[5, 6, 7, 2], logit_bias={2: -1.5})
              for s in range(40)]
    want = plain.generate([tokens_prompt(prompt)] * len(params), params, use_tqdm=False)
    before = spec_stats(spec)["spec_decode_num_accepted_tokens"]
    got = spec.generate([tokens_prompt(prompt)] * len(params), params, use_tqdm=False)
    assert spec_stats(spec)["spec_decode_num_accepted_tokens"] > before
    ended = 0
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        ended += w.outputs[0].finish_reason == "stop"
    assert ended > 10
    assert_pool_empty(spec)
