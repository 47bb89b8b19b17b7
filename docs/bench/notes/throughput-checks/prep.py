import time, statistics, sys, torch
from octavo.model.worker.input_batch import InputBatch
from octavo.step_plan import StepPlan, NewSeq, SeqChunk
from octavo.sampling_params import SamplingParams
torch.set_num_threads(1)
def run(nseq, ctx, reps=2000):
    ib = InputBatch(16, torch.device("cpu"))
    p = SamplingParams(max_tokens=10)
    news = [NewSeq(i, list(range(ctx)), ctx, 0, p, list(range(i*64, i*64 + ctx//16 + 1))) for i in range(nseq)]
    ib.apply(StepPlan(new_seqs=news))
    chunks = [SeqChunk(i, [5], ctx, sample_seq_ids=(i,)) for i in range(nseq)]
    plan = StepPlan(chunks=chunks)
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); ib.apply(plan); ib.prepare(plan.chunks); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
for n, c in [(1, 256), (8, 300), (32, 300), (64, 300)]:
    print(n, c, f"{run(n, c):.4f} ms")
