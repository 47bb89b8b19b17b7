"""HF transformers' references for the real GGUF models, stored as test fixtures.

transformers reads the model's GGUF file itself (`from_pretrained(dir, gguf_file=...)`, every
tensor dequantized to fp32) and generates 64 greedy tokens (no EOS) after each of 20 prompts,
10 plain texts and 10 chats rendered with the file's own chat template. Stored, compressed, in
tests/fixtures/<model>.npz: the prompts (texts and messages, and their token ids), the tokens,
and at each generated position the top-K token ids with their log-probabilities (float16).
tests/model/test_real_models.py compares octavo against it; HF at these sizes is too slow to
run in CI.

    PYTHONPATH=. python scripts/gguf_references.py gemma-3-270m qwen2.5-coder-1.5b

With --check, octavo is then measured against the same references (the dequantized path's
greedy tokens; the block path's teacher-forced top-1 agreement and its KL divergence against
transformers' full next-token distributions, not only the stored top-K).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from octavo.envs import cache_dir
from tests.model.real_references import FIXTURES, fixture_path, load_fixture

NEW_TOKENS = 64
TOP_K = 20

GEMMA_PLAIN = [
    "The Eiffel Tower is in the city of",
    "def fibonacci(n):",
    "Q: What is the capital of France?\nA:",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "import numpy as np\n\n",
    "Water boils at a temperature of",
    "In 1969, Neil Armstrong",
    "SELECT name, age FROM users WHERE",
]
GEMMA_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "List three fruits."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What color is the sky?"}],
    [{"role": "user", "content": "Hi, who are you?"},
     {"role": "assistant", "content": "I am a language model."},
     {"role": "user", "content": "What can you do?"}],
    [{"role": "user", "content": "Explain gravity to a child."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Give me a name for a black cat."}],
]
QWEN_PLAIN = [
    "def quicksort(arr):",
    "# Python: read a CSV file and print the number of rows\nimport csv\n",
    "The difference between a process and a thread is",
    "SELECT customers.name, COUNT(orders.id) FROM customers",
    "#include <stdio.h>\n\nint main(void) {",
    "A binary search tree is",
    "function debounce(fn, wait) {",
    "The capital of Japan is",
    "1, 1, 2, 3, 5, 8,",
    "class Stack:\n    def __init__(self):",
]
QWEN_CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "What does the `git rebase` command do?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Explain recursion in one paragraph."}],
    [{"role": "user", "content": "How do I read a file line by line in Rust?"}],
    [{"role": "user", "content": "Write a SQL query that finds duplicate emails in a users "
                                 "table."}],
    [{"role": "user", "content": "What is the time complexity of binary search?"}],
    [{"role": "user", "content": "Hello! Who are you?"}],
    [{"role": "user", "content": "Write a bash one-liner that counts lines in all .py files."}],
    [{"role": "user", "content": "What is a closure in JavaScript?"},
     {"role": "assistant", "content": "A function together with the variables it captures."},
     {"role": "user", "content": "Show a short example."}],
    [{"role": "user", "content": "Fix this code: print('hello' + 5)"}],
]
PROMPTS = {
    "gemma-3-270m": (GEMMA_PLAIN, GEMMA_CHATS),
    "qwen2.5-coder-1.5b": (QWEN_PLAIN, QWEN_CHATS),
}


def prompt_ids(tok, plain: list[str], chats: list[list[dict]]) -> list[list[int]]:
    ids = [list(tok(text)["input_ids"]) for text in plain]
    ids += [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) for c in chats]
    return ids


def hf_references(model: str, gguf: Path, model_dir: Path) -> dict[str, np.ndarray]:
    import gguf as gguf_py
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain, chats = PROMPTS[model]
    tok = AutoTokenizer.from_pretrained(str(model_dir))  # octavo's: transformers' conversion
    prompts = prompt_ids(tok, plain, chats)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    print(f"{model}: transformers read {gguf.name} in {time.perf_counter() - t0:.0f}s",
          flush=True)
    # each prompt's result is kept as it comes, so that a run killed half way resumes
    partial = cache_dir() / "references" / f"{model}.partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    done = json.loads(partial.read_text()) if partial.is_file() else {}
    if done.get("prompts") != prompts:
        done = {"prompts": prompts, "results": []}
    for i, p in enumerate(prompts):
        if i < len(done["results"]):
            continue
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                              return_dict_in_generate=True, output_logits=True)
        gen = out.sequences[0, len(p):].tolist()
        assert len(gen) == NEW_TOKENS
        logprobs = torch.cat(out.logits).float().log_softmax(-1)  # [64, vocab]
        values, indices = logprobs.topk(TOP_K, dim=-1)
        assert indices[:, 0].tolist() == gen  # greedy: each token is its step's top 1
        done["results"].append({"tokens": gen, "top_ids": indices.tolist(),
                                "top_logprobs": values.tolist()})
        partial.write_text(json.dumps(done))
        print(f"  prompt {i + 1}/{len(prompts)}: {tok.decode(gen)[:60]!r}", flush=True)
    results = done["results"]
    tokens = [r["tokens"] for r in results]
    top_ids = [np.array(r["top_ids"], np.int32) for r in results]
    top_lps = [np.array(r["top_logprobs"], np.float32).astype(np.float16) for r in results]
    meta = {"model": model, "gguf": gguf.name, "new_tokens": NEW_TOKENS, "top_k": TOP_K,
            "plain": plain, "chats": chats, "transformers": transformers.__version__,
            "gguf_py": getattr(gguf_py, "__version__", "?"), "torch": torch.__version__}
    offsets = np.cumsum([0] + [len(p) for p in prompts]).astype(np.int32)
    return {"meta": np.array(json.dumps(meta)),
            "prompt_ids": np.concatenate([np.array(p, np.int32) for p in prompts]),
            "prompt_offsets": offsets, "tokens": np.array(tokens, np.int32),
            "top_ids": np.stack(top_ids), "top_logprobs": np.stack(top_lps)}


def check(model: str, gguf: Path) -> None:
    """octavo against transformers on the fixture's prompts: dequantized greedy tokens, then
    the block path teacher-forced (top-1 agreement; KL against the full distributions)."""
    import gc

    from transformers import AutoModelForCausalLM

    from octavo import LLM, SamplingParams
    from octavo.bench.quant import sequence_logits

    ref = load_fixture(model)
    prompts, tokens = ref["prompts"], ref["tokens"]
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    full = []
    with torch.no_grad():
        for p, r in zip(prompts, tokens, strict=True):
            logits = hf(torch.tensor([p + r])).logits[0, len(p) - 1: len(p) + len(r) - 1]
            full.append(logits.float().log_softmax(-1))
    del hf
    gc.collect()
    llm = LLM(model=model, quantization=None, max_model_len=1024, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    same = sum(g == r for g, r in zip(got, tokens, strict=True))
    first = [next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), None)
             for g, r in zip(got, tokens, strict=True)]
    print(f"{model} dequantized: {same}/{len(tokens)} prompts equal token for token; first "
          f"differences at {[f for f in first if f is not None]}")
    del llm
    gc.collect()
    llm = LLM(model=model, max_model_len=1024, num_kv_blocks=512)
    report = llm.engine.executor.runner.model.quant_report
    agree = total = 0
    kls = []
    for p, r, hf_lp in zip(prompts, tokens, full, strict=True):
        q = sequence_logits(llm, p + r)[len(p) - 1: len(p) + len(r) - 1].log_softmax(-1)
        agree += int((q.argmax(-1) == torch.tensor(r)).sum())
        total += len(r)
        kls.append((hf_lp.exp() * (hf_lp - q)).sum(-1))
    kl = torch.cat(kls)
    print(f"{model} blocks ({report.method}, {report.layers} layers in blocks): top-1 "
          f"{agree}/{total} = {agree / total:.4f}; KL mean {kl.mean():.5f}, max {kl.max():.4f}; "
          f"weights {llm.stats()['weights_bytes'] / 2**20:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    from octavo.model import catalog
    from octavo.model.sources import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", choices=sorted(PROMPTS))
    parser.add_argument("--check", action="store_true", help="also measure octavo against it")
    parser.add_argument("--skip-references", action="store_true",
                        help="with --check: use the stored fixture")
    args = parser.parse_args(argv)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        entry = catalog.find(model)
        assert entry is not None
        gguf = catalog.gguf_path(entry)
        if not args.skip_references:
            data = hf_references(model, gguf, resolve_model_dir(model))
            np.savez_compressed(fixture_path(model), **data)
            print(f"wrote {fixture_path(model)} ({fixture_path(model).stat().st_size} bytes)")
        if args.check:
            check(model, gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
