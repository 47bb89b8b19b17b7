"""Does a compiled op let another Python thread run, and what does that cost the op?

200 paged_decode calls on 1 OpenMP thread while a second thread counts in a Python loop.
Run against a build whose bindings release the GIL (py::call_guard<py::gil_scoped_release>)
and one whose bindings do not."""
import threading, time, torch
from octavo.model.kernels.cpu_ops import load_cpu_ops
m = load_cpu_ops()
torch.set_num_threads(1)
BLOCK, kvh, heads, hd = 16, 3, 9, 64
nb = 256
kc, vc = torch.randn(nb, BLOCK, kvh, hd), torch.randn(nb, BLOCK, kvh, hd)
tables = torch.arange(nb).view(1, nb); ctx = torch.tensor([nb * BLOCK]); q = torch.randn(1, heads, hd)
stop = False; count = 0
def spin():
    global count
    while not stop: count += 1
th = threading.Thread(target=spin); th.start()
time.sleep(0.05)
c0 = count; t = time.perf_counter()
for _ in range(200): m.paged_decode(q, kc, vc, tables, ctx, 0.125)
dt = time.perf_counter() - t; c1 = count
stop = True; th.join()
print(f"200 calls {dt*1e3:.1f} ms, spinner counted {c1 - c0} meanwhile")
