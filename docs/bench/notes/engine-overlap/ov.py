"""Can engine work (output processing) hide behind the forward pass on a CPU?

Usage: ov.py THREADS BATCH W_MS ROUNDS [SWITCH_INTERVAL_S]

Each step runs engine.step() and W ms of pure-Python work (standing in for detokenizing and
building outputs), either one after the other ("serial") or the work on a second thread while
the step runs on this one ("overlap").
Prints the median step time of each mode; an overlap that hides the work gives
overlap ~= max(step, W), a core-bound one gives overlap ~= serial.
"""
import random, statistics, sys, threading, time
import torch
from octavo import SamplingParams
from octavo.bench.engine_run import make_llm

threads, batch, w_ms, rounds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
if len(sys.argv) > 5: sys.setswitchinterval(float(sys.argv[5]))
llm = make_llm(None, dtype="float32", max_model_len=2048)
eng = llm.engine
rng = random.Random(0)


def work(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        x += sum(range(50))


def run(mode: str, tag: str) -> float:
    for i in range(batch):
        p = [rng.randrange(49152) for _ in range(256)]
        eng.add_request(f"{tag}{i}", {"prompt_token_ids": p},
                        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, detokenize=False))
    eng.step()  # prefills
    times = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        if mode == "none":
            eng.step()
        elif mode == "serial":
            eng.step(); work(w_ms)
        else:
            th = threading.Thread(target=work, args=(w_ms,)); th.start()
            eng.step(); th.join()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[2:])


res = {m: [] for m in ("none", "serial", "overlap")}
for r in range(rounds):
    for m in res:
        res[m].append(run(m, f"{m}{r}-"))
med = {m: statistics.median(v) for m, v in res.items()}
print(f"threads {threads} batch {batch} W {w_ms} ms: step {med['none']:.2f} ms, serial "
      f"{med['serial']:.2f}, overlap {med['overlap']:.2f}; hidden "
      f"{(med['serial'] - med['overlap']) / w_ms:.0%} of W")
