import sys, time, random, torch
from octavo.bench.engine_run import make_llm
from octavo import SamplingParams
torch.set_num_threads(2)
ctx_prompt = int(sys.argv[1]) if len(sys.argv) > 1 else 256
llm = make_llm(None, dtype=sys.argv[2] if len(sys.argv) > 2 else "float32", max_model_len=2048)
eng = llm.engine
rng = random.Random(0)
p = [rng.randrange(49152) for _ in range(ctx_prompt)]
rates = []
for rep in range(4):
    eng.add_request(f"p{rep}", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False))
    while eng.has_unfinished_requests(): eng.step()
    eng.add_request(f"r{rep}", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=129, ignore_eos=True, detokenize=False))
    eng.step()  # prefill + first token
    t = time.perf_counter(); n = 0
    while eng.has_unfinished_requests(): eng.step(); n += 1
    if rep: rates.append(n / (time.perf_counter() - t))
rates.sort(); print(f"decode tok/s {rates[1]:.1f}")
