"""Gemma 3 270M's tg128 from a one-token prompt: the median of 3 generations after a warm-up.
Usage: PYTHONPATH=CHECKOUT python gemma_tg.py THREADS LABEL (the GGUF path is this machine's)."""
import sys, time, random, torch
from octavo import LLM, SamplingParams
torch.set_num_threads(int(sys.argv[1]))
llm = LLM(model="/work/cache/gguf/models/files/gemma-3-270m-q4_k_m.gguf", max_model_len=700, enable_prefix_caching=False)
full = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
llm.generate([{"prompt_token_ids": [rng.randrange(100, 30000)]}], full, use_tqdm=False)
best = []
for rep in range(3):
    t = time.perf_counter(); llm.generate([{"prompt_token_ids": [rng.randrange(100, 30000)]}], full, use_tqdm=False); best.append(128 / (time.perf_counter() - t))
best.sort()
print(f"{sys.argv[2]} tg128 tok/s {best[1]:.2f} weights {llm.stats()['weights_bytes']}", flush=True)
