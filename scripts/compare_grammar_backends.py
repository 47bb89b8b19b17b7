"""Compare llguidance and xgrammar on this CPU: grammar compile time and per-token mask time
over the JSON schemas of octavo/bench/json_schemas.py, with the embedded model's tokenizer.

xgrammar is not an octavo dependency (its wheel pulls triton); to run this, install it apart:
    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xg .venv/bin/python scripts/compare_grammar_backends.py
Each matcher walks a random path through its grammar (same seed for both libraries: at each
step a random allowed token); the time is that of computing the bitmask of one row.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from octavo.bench.json_schemas import SCHEMAS
from octavo.model.sources import resolve_model_dir

STEPS = 60


def allowed(mask_row: np.ndarray, vocab: int) -> list[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits).tolist()


def walk(compute, consume, vocab: int, eos: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        row = compute()
        times.append(time.perf_counter() - t0)
        ids = [t for t in allowed(row, vocab) if t != eos]
        if not ids:
            break
        consume(rng.choice(ids))
    return times


def main() -> None:
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    vocab = len(tok)
    eos = tok.eos_token_id
    results: dict[str, dict[str, float]] = {}

    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    ll_init = time.perf_counter() - t0
    ll_compile, ll_mask = [], []
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = llguidance.LLMatcher(lltok, grammar)
        ll_compile.append(time.perf_counter() - t0)
        mask = lln.allocate_token_bitmask(1, vocab)

        def compute(m=m, mask=mask):
            lln.fill_next_token_bitmask(m, mask, 0)
            return mask[0]

        ll_mask += walk(compute, m.consume_token, vocab, eos, hash(name) & 0xFFFF)
    results["llguidance"] = {"tokenizer_init_s": ll_init,
                             "compile_ms_median": 1e3 * statistics.median(ll_compile),
                             "mask_us_median": 1e6 * statistics.median(ll_mask),
                             "mask_us_mean": 1e6 * statistics.mean(ll_mask),
                             "mask_us_p99": 1e6 * float(np.quantile(ll_mask, 0.99))}
    try:
        import xgrammar as xgr
    except ImportError as e:
        results["xgrammar"] = {"error": f"not importable: {e}"}  # type: ignore[dict-item]
    else:
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        xg_init = time.perf_counter() - t0
        xg_compile, xg_mask = [], []
        for name, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema))
            m = xgr.GrammarMatcher(compiled)
            xg_compile.append(time.perf_counter() - t0)
            mask = xgr.allocate_token_bitmask(1, vocab)

            def compute(m=m, mask=mask):
                m.fill_next_token_bitmask(mask, 0)
                return mask[0].numpy()

            xg_mask += walk(compute, m.accept_token, vocab, eos, hash(name) & 0xFFFF)
        results["xgrammar"] = {"tokenizer_init_s": xg_init,
                               "compile_ms_median": 1e3 * statistics.median(xg_compile),
                               "mask_us_median": 1e6 * statistics.median(xg_mask),
                               "mask_us_mean": 1e6 * statistics.mean(xg_mask),
                               "mask_us_p99": 1e6 * float(np.quantile(xg_mask, 0.99))}
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), platform.processor())
    print(json.dumps({"cpu": cpu, "torch_threads": torch.get_num_threads(), "vocab": vocab,
                      "schemas": list(SCHEMAS), "steps_per_schema": STEPS,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
