"""The throughput benchmark's run with each step's shape recorded: its tokens (the rows of every
decoder layer's matmuls) and its sampled rows (the rows of the vocabulary projection). The GEMM
time of those very shapes, timed as roofline.py times the floor (oneDNN-packed, median of 5),
against the floor's fixed 32-row / 512-row rates and against the run's own time.
Usage: stepshapes.py THREADS WORKLOAD"""
import sys, time, torch
from octavo.bench.options import BenchOptions
from octavo.bench.roofline import floor_seconds, layer_shapes
from octavo.bench.throughput import OctavoEngine, bench_workloads
from octavo.model.layers.linear import PackedLinear

threads, name = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(threads)
opts = BenchOptions(threads=threads)
wl = next(w for w in bench_workloads(opts) if w.name == name)
eng = OctavoEngine(opts, "float32", "paged")
cfg = eng.llm.engine.model_config
shapes = []
ex = eng.llm.engine.executor
orig = ex.execute
def execute(plan):
    shapes.append((plan.num_tokens, sum(len(c.sample_seq_ids) for c in plan.chunks)))
    return orig(plan)
ex.execute = execute
eng.run(type(wl)("warm", wl.requests[:2], wl.max_model_len).capped(2))
shapes.clear()
elapsed = eng.run(wl)["elapsed_s"]

layers = {}
def linear(a, b):
    if (a, b) not in layers:
        layers[a, b] = PackedLinear(torch.nn.Linear(a, b, bias=False))
    return layers[a, b]
cache = {}
def gemm_s(rows, with_layers=True, head_rows=0):
    """Seconds for `rows` through the 30 layers' linears (+ the head at `head_rows`)."""
    key = (rows, with_layers, head_rows)
    if key not in cache:
        calls = [(linear(a, b), rows) for a, b in layer_shapes(cfg)] if with_layers else []
        if head_rows:
            calls.append((linear(cfg.hidden_size, cfg.vocab_size), head_rows))
        xs = {(l.in_features, r): torch.randn(r, l.in_features) for l, r in calls}
        times = []
        with torch.inference_mode():
            for rep in range(6):
                t0 = time.perf_counter()
                for l, r in calls:
                    l(xs[l.in_features, r])
                if rep:
                    times.append(time.perf_counter() - t0)
        times.sort()
        cache[key] = times[len(times) // 2]
    return cache[key]
total = 0.0
for rows, sampled in shapes:
    total += cfg.num_layers * gemm_s(rows) + (gemm_s(1, False, sampled) if sampled else 0.0)
floor = floor_seconds(cfg, wl, torch.float32)["floor_s"]
print(f"threads {threads} {name}: {len(shapes)} steps, run {elapsed:.2f} s; GEMM of the run's "
      f"own step shapes {total:.2f} s; floor (32/512 rows) {floor:.2f} s")
hist = {}
for rows, _ in shapes:
    b = "1" if rows == 1 else "2-8" if rows <= 8 else "9-31" if rows < 32 else "32" if rows == 32 \
        else "33-512" if rows <= 512 else ">512"
    hist[b] = hist.get(b, 0) + 1
print("  steps by tokens:", hist)
