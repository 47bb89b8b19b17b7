"""One layer's linears repeated 30 times against 30 distinct layers, oneDNN-packed, fp32.
Usage: layers30.py THREADS"""
import sys, time, torch
from octavo.bench.roofline import layer_shapes
from octavo.config import ModelConfig
from octavo.model.layers.linear import PackedLinear
from octavo.model.sources import resolve_model_dir
torch.set_num_threads(int(sys.argv[1]))
cfg = ModelConfig.from_dir(resolve_model_dir(None))
def make(n):
    return [[PackedLinear(torch.nn.Linear(a, b, bias=False)) for a, b in layer_shapes(cfg)] for _ in range(n)]
one, thirty = make(1) * 30, make(30)
for rows in (1, 8, 32, 64, 512):
    xs = {a: torch.randn(rows, a) for a in (576, 1536)}
    res = {}
    for name, stack in (("same layer x30", one), ("30 layers", thirty)):
        times = []
        with torch.inference_mode():
            for rep in range(6):
                t0 = time.perf_counter()
                for layer in stack:
                    for lin in layer:
                        lin(xs[lin.in_features])
                if rep: times.append(time.perf_counter() - t0)
        times.sort(); res[name] = times[2]
    print(f"threads {sys.argv[1]} rows {rows:4d}: one layer x30 {1e3*res['same layer x30']:.1f} ms, "
          f"30 layers {1e3*res['30 layers']:.1f} ms, ratio {res['30 layers']/res['same layer x30']:.3f}")
