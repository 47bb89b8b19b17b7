import torch, time, statistics
for th in (1, 2):
    torch.set_num_threads(th)
    for n in (1, 8, 64, 256):
        x = torch.randn(n, 49152)
        r = {}
        for f, name in ((lambda: x.argmax(dim=-1), "argmax"), (lambda: x.max(dim=-1).indices, "max")):
            f(); ts = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(20): f()
                ts.append((time.perf_counter() - t) / 20 * 1e3)
            r[name] = statistics.median(ts)
        print(f"threads {th} rows {n:3d} argmax {r['argmax']:.3f} ms  max {r['max']:.3f} ms  ratio {r['argmax']/r['max']:.2f}")
