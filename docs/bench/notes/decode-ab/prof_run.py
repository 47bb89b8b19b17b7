import sys, time, torch
from octavo.bench.engine_run import make_llm, greedy_params
from octavo.bench import workloads
torch.set_num_threads(int(sys.argv[1]))
llm = make_llm(None, dtype=sys.argv[2] if len(sys.argv) > 2 else "float32", max_model_len=2048)
eng = llm.engine
wl = workloads.make("mixed", num_requests=64)
for i, r in enumerate(wl.requests):
    eng.add_request(str(i), {"prompt_token_ids": list(r.prompt_token_ids)}, greedy_params(r.output_len))
open("/tmp/octavo-ab/go", "w").write("go")
t0 = time.perf_counter()
while eng.has_unfinished_requests(): eng.step()
print("total", time.perf_counter() - t0)
