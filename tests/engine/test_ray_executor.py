"""The `ray` executor on a local Ray cluster this test starts (`ray start --head` on 127.0.0.1,
stopped afterwards): the greedy tokens of one rank with tensor_parallel_size 2, with prefix
caching, n > 1, preemption, chunked prefill and hits of the KV tier; a killed actor fails the
step naming it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from octavo import LLM, SamplingParams
from octavo.engine.engine import StepFailed
from octavo.engine.executor import WorkerDiedError
from tests.conftest import build_tiny_llama
from tests.engine.test_tensor_parallel import UNEVEN, _greedy

ray = pytest.importorskip("ray", reason="ray is installed by `make install`")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster with 2 CPUs, joined through RAY_ADDRESS as a user would."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1",
                    f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True,
                   timeout=120)
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        yield os.environ["RAY_ADDRESS"]
    finally:
        if before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = before
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("ray-uneven"), **UNEVEN)


def test_ray_tp2_gives_the_greedy_tokens_of_one_rank(ray_cluster):
    shared = list(range(2000, 2040))
    prompts = [{"prompt_token_ids": shared + [5, 6]}, {"prompt_token_ids": shared + [9]},
               "The capital of France is"]
    sampled = SamplingParams(temperature=0.8, max_tokens=10, n=2, seed=3, ignore_eos=True)
    one = LLM()
    want = _greedy(one, prompts, 16)
    want_n = [list(c.token_ids) for c in one.generate(prompts[2], sampled,
                                                       use_tqdm=False)[0].outputs]
    with LLM(tensor_parallel_size=2, distributed_executor_backend="ray") as two:
        assert two.engine.kernel_path()["executor"] == "ray"
        assert _greedy(two, prompts, 16) == want
        assert two.stats()["prefix_cache_hit_tokens"] >= 32
        got_n = [list(c.token_ids) for c in two.generate(prompts[2], sampled,
                                                          use_tqdm=False)[0].outputs]
        assert got_n == want_n


def test_ray_tp2_with_preemption_and_a_kv_tier_then_a_killed_actor(ray_cluster, uneven_dir,
                                                                     tmp_path):
    prompts = [{"prompt_token_ids": [(5 * j + i) % 250 + 3 for i in range(40 + 9 * j)]}
               for j in range(5)]
    opts = dict(model=str(uneven_dir), num_kv_blocks=20, block_size=8,
                max_num_batched_tokens=32)
    want = _greedy(LLM(**opts), prompts, 32)
    llm = LLM(tensor_parallel_size=2, distributed_executor_backend="ray",
              kv_offload_dir=str(tmp_path / "tier"), **opts)
    try:
        assert _greedy(llm, prompts, 32) == want
        assert llm.stats()["num_preemptions"] > 0
        # the first prompts' blocks left the pool for the tier's records (both actors'
        # shards): they come back from there
        assert llm.engine.tier.flush(30)
        assert _greedy(llm, prompts, 32) == want
        assert llm.stats()["tier_hit_tokens"] > 0 and llm.stats()["tier_read_failures"] == 0
        assert llm.stats()["kv_blocks_used"] == 0
        engine = llm.engine
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        engine.step()
        pid = engine.executor.worker_pids()[1]
        node = ray.nodes()[0]["NodeManagerAddress"]  # where Ray reaches the one node
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(StepFailed) as failed:
            for _ in range(50):
                engine.step()
        assert isinstance(failed.value.__cause__, WorkerDiedError)
        why = str(failed.value.__cause__)
        assert f"tensor-parallel worker rank 1 (node {node}, pid {pid}) died" in why
        engine.abort_request("a")
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        llm.shutdown()
