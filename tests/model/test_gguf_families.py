"""Every family octavo runs from GGUF, as a tiny random-weight HF model written to a GGUF file
here (gguf_families.py: F32, Q8_0, Q4_0, Q4_K and Q6_K tensors), against HF transformers
loading the same file:

- `quantization=None`: octavo dequantizes every tensor as transformers does, so the greedy
  tokens are transformers' own;
- the default for a GGUF file (`quantization="auto"`, which is "gguf"): the Q8_0, Q4_0, Q4_K
  and Q6_K layers kept in their blocks, computed with int8 activations, the token embedding
  looked up in its blocks (the tied LM head's own layer where the head is tied); the F32
  vectors dequantized. Teacher-forced on transformers' tokens, the top-1 token agrees at >= 95%
  of the positions (measured: 48 of 48 on every family but qwen3 and gemma3_text, 47 of 48
  there), and the weights take fewer bytes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.model import sources
from octavo.model.quant.block_quant import BlockQuantLinear
from octavo.model.quant.gguf_weights import BlockEmbedding
from tests.model.gguf_families import FAMILIES, build_hf, write_gguf

NEW_TOKENS = 16


@pytest.fixture(autouse=True)
def _tmp_gguf_cache(tmp_path_factory, monkeypatch):
    """The config and tokenizer of throw-away GGUFs go to a throw-away folder."""
    root = tmp_path_factory.getbasetemp() / "gguf-families-cache"
    key = sources.gguf_cache_dir
    monkeypatch.setattr(sources, "gguf_cache_dir", lambda p: root / key(p).name)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 21, 40)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path, list[list[int]], list[list[int]]]:
    """(family, its GGUF file, prompts, transformers' greedy tokens reading that file)."""
    from transformers import AutoModelForCausalLM

    name = request.param
    path = write_gguf(build_hf(name), name, tmp_path_factory.mktemp(name) / f"{name}.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    assert hf.config.model_type == name
    refs = []
    with torch.no_grad():
        for p in _prompts():
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(p):].tolist())
    return name, path, _prompts(), refs


def test_dequantized_gguf_gives_transformers_tokens(family) -> None:
    name, path, prompts, refs = family
    llm = LLM(model=str(path), quantization=None, num_kv_blocks=64)
    assert llm.engine.model_config.model_type == name
    assert llm.engine.kernel_path()["quantization"] == "none"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.stats()["kv_blocks_used"] == 0


def test_gguf_blocks_agree_with_transformers(family) -> None:
    name, path, prompts, refs = family
    llm = LLM(model=str(path), num_kv_blocks=64)  # a GGUF file: quantization="gguf"
    model = llm.engine.executor.runner.model
    report = model.quant_report
    assert report.method == "gguf" and report.layers > 0 and report.saved_bytes > 0
    kept = {m.fmt.name for m in model.modules() if isinstance(m, BlockQuantLinear)}
    assert {"q8_0", "q4_k", "q6_k"} <= kept, kept  # and q4_0 where o_proj is not 256-wide
    assert type(model.embed_tokens) is BlockEmbedding
    tied = llm.engine.model_config.tie_word_embeddings
    assert (model.embed_tokens.table is model.lm_head) == tied
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, refs, strict=True)],
                        params, use_tqdm=False)
    agree = total = 0
    for out, p, r in zip(outs, prompts, refs, strict=True):
        for j, want in enumerate(r):
            top = out.prompt_logprobs[len(p) + j]
            best = next(t for t, lp in top.items() if lp.rank == 1)
            agree += best == want
            total += 1
    assert agree >= 0.95 * total, (name, agree, total)
    assert llm.stats()["kv_blocks_used"] == 0
