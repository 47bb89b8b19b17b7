"""bf16 `mixed` (64 requests) through the engine with prefill attention on the bf16 dot
products or on the widened-to-fp32 loop. Usage: dot_ab.py THREADS on|off"""
import sys, time, torch
from octavo.bench.engine_run import make_llm, greedy_params
from octavo.bench import workloads
torch.set_num_threads(int(sys.argv[1]))
llm = make_llm(None, dtype="bfloat16", max_model_len=2048)
eng = llm.engine
eng.runner.backend.bf16_dot = sys.argv[2] == "on"
wl = workloads.make("mixed", num_requests=64)
for i, r in enumerate(wl.requests):
    eng.add_request(str(i), {"prompt_token_ids": list(r.prompt_token_ids)}, greedy_params(r.output_len))
t0 = time.perf_counter()
while eng.has_unfinished_requests(): eng.step()
print(f"threads {sys.argv[1]} bf16_dot {sys.argv[2]}: {time.perf_counter() - t0:.2f} s")
