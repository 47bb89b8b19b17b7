import sys, time, torch
from octavo.bench.engine_run import make_llm, greedy_params
from octavo.bench import workloads
th = int(sys.argv[1]); torch.set_num_threads(th)
llm = make_llm(None, dtype="float32", max_model_len=2048)
eng = llm.engine; run = eng.runner
T = {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: T[key] = T.get(key, 0) + time.perf_counter() - t
    setattr(obj, name, g)
wrap(eng.scheduler, "schedule", "schedule")
wrap(eng.scheduler, "update_from_output", "update")
wrap(eng.output_processor, "process", "outproc")
wrap(eng.executor, "execute", "execute")
wrap(run.batch, "apply", "batch.apply")
wrap(run.batch, "prepare", "batch.prepare")
wrap(run, "_sample", "sample")
wrap(run.model, "forward", "model")
wl = workloads.make("mixed", num_requests=int(sys.argv[2]) if len(sys.argv) > 2 else 64)
for i, r in enumerate(wl.requests):
    eng.add_request(str(i), {"prompt_token_ids": list(r.prompt_token_ids)}, greedy_params(r.output_len))
t0 = time.perf_counter(); steps = 0
while eng.has_unfinished_requests():
    eng.step(); steps += 1
tot = time.perf_counter() - t0
print(f"threads {th} steps {steps} total {tot:.2f}s")
for k, v in T.items(): print(f"  {k:14s} {v:7.3f}s {100*v/tot:5.1f}%  {1e3*v/steps:.2f} ms/step")
