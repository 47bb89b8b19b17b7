"""A long-running engine's garbage collections: requests arrive as others finish (a server's
steady state), with the engine's own start-up freeze (octavo/gc_heap.py). Reports every
collection by generation (count, total and longest pause) and the longest step.
Usage: gclong.py THREADS NUM_REQUESTS IN_FLIGHT"""
import gc, random, sys, time, torch
from octavo.bench.engine_run import make_llm, greedy_params
torch.set_num_threads(int(sys.argv[1]))
total_reqs, in_flight = int(sys.argv[2]), int(sys.argv[3])
eng = make_llm(None, dtype="float32", max_model_len=2048).engine
stats = {g: [0, 0.0, 0.0] for g in range(3)}  # count, total s, longest s
t_start = [0.0]
def cb(phase, info):
    if phase == "start":
        t_start[0] = time.perf_counter()
    else:
        s, dt = stats[info["generation"]], time.perf_counter() - t_start[0]
        s[0] += 1; s[1] += dt; s[2] = max(s[2], dt)
gc.callbacks.append(cb)
rng = random.Random(0)
sent = done = steps = 0
step_max = 0.0
def add():
    global sent
    prompt = [rng.randrange(6000, 49152) for _ in range(rng.randint(32, 256))]
    eng.add_request(str(sent), {"prompt_token_ids": prompt}, greedy_params(rng.randint(16, 64)))
    sent += 1
t0 = time.perf_counter()
while done < total_reqs:
    while sent < total_reqs and sent - done < in_flight:
        add()
    s0 = time.perf_counter()
    outs = eng.step()
    step_max = max(step_max, time.perf_counter() - s0)
    steps += 1
    done += sum(o.finished for o in outs)
wall = time.perf_counter() - t0
gc_s = sum(s[1] for s in stats.values())
print(f"threads {sys.argv[1]}: {total_reqs} requests, {in_flight} in flight, {steps} steps, "
      f"{wall:.1f} s; longest step {1e3 * step_max:.0f} ms; gc {1e3 * gc_s:.0f} ms "
      f"({100 * gc_s / wall:.2f}%); tracked objects now {len(gc.get_objects())}, "
      f"frozen {gc.get_freeze_count()}")
for g, (n, t, m) in stats.items():
    print(f"  gen{g}: {n} collections, {1e3 * t:.0f} ms in all, longest {1e3 * m:.1f} ms")
t = time.perf_counter(); gc.collect(); t = time.perf_counter() - t
print(f"  a full collection now (the frozen start-up heap excluded): {1e3 * t:.1f} ms")
