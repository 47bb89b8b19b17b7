"""CUDA graphs for decode (model/worker/cuda_graphs.py) on the tests' device (tests/conftest.py):
the buffers, padding and buckets. On CPU `eager_capture` stands in for the graph (replay reruns
the captured forward over the persistent buffers) and the Triton kernels run in Triton's
interpreter; on CUDA the graphs are real. Padded rows must write nothing and change nothing:
greedy tokens equal the eager engine's and HF's (on CUDA, up to recorded near-ties:
tests/near_ties.py)."""

from __future__ import annotations

from octavo import LLM, SamplingParams
from octavo.model.kernels.triton import triton_missing
from octavo.model.worker.cuda_graphs import DecodeGraphs, batch_buckets, eager_capture
from tests.conftest import ON_CUDA, TEST_DEVICE
from tests.model.models import test_families
from tests.near_ties import check_greedy, chosen_logprobs, hf_reference_from_dir

# the graphs are the test's own (graphed): the engine captures none at start-up
TRITON = dict(attention_backend="triton", fused_ops="triton", device=str(TEST_DEVICE),
              enforce_eager=True)


def test_buckets_follow_vllm() -> None:
    assert batch_buckets(256) == [1, 2, 4, *range(8, 257, 8)]
    assert batch_buckets(1000)[-1] == 256
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(1) == [1]


def graphed(llm: LLM, max_num_seqs: int) -> DecodeGraphs:
    """The engine's decode steps replayed from graphs of up to max_num_seqs rows: real CUDA
    graphs on CUDA, their eager stand-in on CPU."""
    runner = llm.engine.executor.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.backend, runner.device,
                                 max_num_seqs, runner.max_positions,
                                 runner.config.kv_groups.windows,
                                 capture=None if ON_CUDA else eager_capture)
    runner.graphs.capture_all()
    return runner.graphs


def test_replayed_decode_steps_are_exact(tmp_path) -> None:
    """Mistral with a sliding window: the buffers carry each table's first position too."""
    family = "mistral"
    assert triton_missing(TEST_DEVICE.type) is None, triton_missing(TEST_DEVICE.type)
    path = test_families.build(tmp_path / family, family)
    ps = test_families.prompts()[:3] + test_families.prompts()[5:6]
    params = SamplingParams(temperature=0, max_tokens=test_families.MAX_TOKENS, ignore_eos=True,
                            logprobs=0)
    refs = hf_reference_from_dir(path, ps, test_families.MAX_TOKENS)
    # 4 prompts x (1..) decode rows: buckets 1, 2, 4 (and 8 padded from 5..8 when forked)
    llm = LLM(model=str(path), block_size=16, num_kv_blocks=64, **TRITON)
    graphs = graphed(llm, 8)
    assert graphs.buckets == [1, 2, 4, 8]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    check_greedy([o.outputs[0].token_ids for o in outs], refs, exact=not ON_CUDA,
                 got_logprobs=[chosen_logprobs(o.outputs[0]) for o in outs])
    assert graphs.replays >= test_families.MAX_TOKENS - 1  # every pure decode step
    # three sequences replay in bucket 4 with a padded row; n=2 forks too
    three = llm.generate([{"prompt_token_ids": p} for p in ps[:3]], params, use_tqdm=False)
    check_greedy([o.outputs[0].token_ids for o in three], refs.pick([0, 1, 2]),
                 exact=not ON_CUDA, got_logprobs=[chosen_logprobs(o.outputs[0]) for o in three])
    assert llm.stats()["kv_blocks_used"] == 0


def test_steps_that_cannot_replay_run_eagerly(tiny_llama_dir) -> None:
    """Prefill chunks, more sequences than the largest bucket: eager; pure decodes: the
    smallest bucket that holds them."""
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64, **TRITON)
    graphs = graphed(llm, 2)
    runner = llm.engine.executor.runner
    seen: list[int | None] = []
    bucket_for = graphs.bucket_for
    graphs.bucket_for = lambda inputs: (seen.append(bucket_for(inputs)), seen[-1])[1]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eager = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64, **TRITON)
    assert eager.engine.executor.runner.graphs is None
    ids = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    ref = hf_reference_from_dir(tiny_llama_dir, ids, 4)
    prompts = [{"prompt_token_ids": p} for p in ids]
    for batch in (prompts[:1], prompts):  # one sequence; three (above the largest bucket)
        seen.clear()
        got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
        # graphs and eager agree with HF (on CUDA up to near-ties: their attention splits
        # differ, the graphs' tables being max_model_len wide)
        for tokens in (got, want):
            check_greedy(tokens, ref.pick(list(range(len(batch)))), exact=not ON_CUDA)
        assert seen[0] is None  # the prefill step
        assert set(seen[1:]) == ({1} if len(batch) == 1 else {None})
    assert runner.kernel_path()["cuda_graphs"] == "decode batches <= 2"
