"""Offline throughput of vLLM (the CPU build), run by its own interpreter in a subprocess.

    PEER_PYTHON octavo/bench/peers/vllm_offline.py IN.json OUT.json

Self-contained on purpose: it runs where vllm is installed and octavo is not. IN.json holds the
model directory, dtype, KV budget, repeats and the workloads as token-id prompts with output
lengths; OUT.json gets one wall time per repeat and workload. Outputs are forced with
ignore_eos, prompts go in as TokensPrompt, prefix caching is off (repeats must not hit the
previous repeat's blocks) and one warm-up generate runs first.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              enable_prefix_caching=False, seed=0)
    warm = [TokensPrompt(prompt_token_ids=[1000 + i for i in range(16)])]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    out = {"vllm_version": __import__("vllm").__version__, "runs": {}}
    for name, reqs in spec["workloads"].items():
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False)
                  for _, o in reqs]
        times = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            got = sum(len(r.outputs[0].token_ids) for r in res)
            assert got == sum(o for _, o in reqs), f"vLLM produced {got} tokens"
        out["runs"][name] = {"times_s": times, "output_tokens": sum(o for _, o in reqs),
                             "requests": len(reqs)}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":  # vLLM starts worker processes: the guard is required
    main()
