"""The `mixed, 64 at once` case of `octavo bench spec` alone: speculation off vs n-gram on one
checkout, two interleaved repeats (docs/bench/notes/prefill-attention.md).

    .venv/bin/python scripts/spec_batch_ab.py new
    # the same against an older commit, from a worktree of it, with its own ops cache:
    git worktree add /tmp/old COMMIT && cd /tmp/old && \\
        OCTAVO_CACHE=/tmp/old_cache PYTHONPATH=/tmp/old /path/to/.venv/bin/python \\
        /path/to/scripts/spec_batch_ab.py old
"""

import json
import sys

import torch

from octavo.bench import workloads
from octavo.bench.engine_run import make_llm, run_workload
from octavo.bench.spec_decode import SPEC

torch.set_num_threads(2)
tag = sys.argv[1] if len(sys.argv) > 1 else "run"
wl = workloads.mixed(64, output_len=128, max_prompt=512, vocab=workloads.SMOLLM2_VOCAB, seed=0)
llms = {way: make_llm(None, dtype="float32", overrides={}, max_model_len=2048,
                      speculative_config=cfg)
        for way, cfg in (("off", None), ("ngram", SPEC))}
for llm in llms.values():
    run_workload(llm, workloads.Workload("warm", wl.requests[:2], 2048).capped(2), tag="w")
tok_s: dict[str, list[float]] = {way: [] for way in llms}
for rep in range(2):
    for way, llm in llms.items():
        r = run_workload(llm, wl, tag=f"{way}{rep}-")
        tok_s[way].append(wl.output_tokens / r.elapsed_s)
        print(tag, way, rep, round(tok_s[way][-1], 1), flush=True)
print(tag, json.dumps(tok_s))
