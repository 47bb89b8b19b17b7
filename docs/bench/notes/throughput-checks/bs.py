"""block size A/B on the throughput bench's workloads, one process, interleaved."""
import sys, statistics, torch
from octavo.bench.options import BenchOptions
from octavo.bench import throughput as tp
th = int(sys.argv[1]); sizes = [int(s) for s in sys.argv[2].split(",")]; reps = int(sys.argv[3])
torch.set_num_threads(th)
opts = BenchOptions()
wls = tp.bench_workloads(opts)
engs = {b: tp.OctavoEngine(opts, "float32", "paged", block_size=b) for b in sizes}
import octavo.bench.workloads as W
warm = W.Workload("warmup", wls[0].requests[:2], wls[0].max_model_len).capped(2)
for e in engs.values(): e.run(warm)
res = {}
for r in range(reps):
    for wl in wls:
        for b, e in engs.items():
            s = e.run(wl)["elapsed_s"]; res.setdefault((wl.name, b), []).append(s)
            print(wl.name, b, f"{s:.2f}", flush=True)
for (w, b), v in sorted(res.items()):
    print(f"{w:9s} bs{b:<4d} median {statistics.median(v):.2f}  {' '.join(f'{x:.2f}' for x in v)}")
