"""Time spent in Python's cyclic GC during `mixed` (64 requests) through the engine.
Usage: gcm.py THREADS DTYPE [freeze]"""
import gc, sys, time, torch
from octavo.bench.engine_run import make_llm, greedy_params
from octavo.bench import workloads
torch.set_num_threads(int(sys.argv[1]))
llm = make_llm(None, dtype=sys.argv[2], max_model_len=2048)
eng = llm.engine
if len(sys.argv) > 3:
    gc.collect(); gc.freeze()
stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
t_start = [0.0]
def cb(phase, info):
    if phase == "start": t_start[0] = time.perf_counter()
    else:
        s = stats[info["generation"]]; s[0] += 1; s[1] += time.perf_counter() - t_start[0]
gc.callbacks.append(cb)
wl = workloads.make("mixed", num_requests=64)
for i, r in enumerate(wl.requests):
    eng.add_request(str(i), {"prompt_token_ids": list(r.prompt_token_ids)}, greedy_params(r.output_len))
t0 = time.perf_counter(); steps = 0
while eng.has_unfinished_requests(): eng.step(); steps += 1
total = time.perf_counter() - t0
gc_s = sum(s[1] for s in stats.values())
print(f"threads {sys.argv[1]} {sys.argv[2]} manual_freeze={len(sys.argv) > 3}: total {total:.2f} s, {steps} steps, "
      f"gc {gc_s * 1e3:.0f} ms ({100 * gc_s / total:.1f}%), tracked objects {len(gc.get_objects())}; "
      + ", ".join(f"gen{g}: {n} x, {1e3 * t:.0f} ms" for g, (n, t) in stats.items()))
