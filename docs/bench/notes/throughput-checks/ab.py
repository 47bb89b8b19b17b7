"""One timed run (two, after a warm-up) of the throughput benchmark's workload through octavo-paged
(fp32). Usage: ab.py THREADS WORKLOAD LABEL; run alternately with PYTHONPATH on two trees."""
import sys, time, torch
from octavo.bench.options import BenchOptions
from octavo.bench.throughput import OctavoEngine, bench_workloads
threads, name = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(threads)
opts = BenchOptions(threads=threads)
wl = next(w for w in bench_workloads(opts) if w.name == name)
eng = OctavoEngine(opts, "float32", "paged")
eng.run(type(wl)("warm", wl.requests[:2], wl.max_model_len).capped(2))
r = [eng.run(wl)["elapsed_s"] for _ in range(2)]
print(f"{sys.argv[3]} {name} {r[0]:.2f} {r[1]:.2f}")
