"""The mixture-of-experts families (Qwen2-MoE, Mixtral), as tiny random-weight HF models built
here, give HF transformers' greedy tokens in fp32: batched and one by one, block sizes 1 / 16 /
256, prefix caching on and off, under preemption with chunked prefill (test_families.py's
checks). The MoE block equals a naive per-token reference, and its forward runs no loop over
tokens (the expert fallback loop runs at most num_experts times)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from octavo.config import ModelConfig
from octavo.model.layers import moe
from octavo.model.layers.moe import SparseMoeBlock
from tests.model.models.test_families import (
    COMMON,
    CONFIGS,
    build_model,
    check_greedy,
    hf_greedy,
    perturb_biases_and_norms,
    prompts,
)

FAMILIES = {
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; top-2 of 8, renormalised
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1],
        use_sliding_window=True, sliding_window=32, max_window_layers=2)),  # layer 0 slides
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=48)),
}


@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    """One torch thread (as tests/engine does): on small shared machines OpenMP threads spin
    against other processes and these tiny matmuls get 100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OCTAVO_TEST_TORCH_THREADS", "1")))
    yield
    torch.set_num_threads(before)


def perturb(name: str, p: torch.Tensor) -> None:
    perturb_biases_and_norms(name, p)
    if name.endswith("gate.weight"):  # routers: spread the experts' probabilities
        p.normal_(0, 0.5)


def build(path, family: str, **overrides):
    return build_model(path, FAMILIES[family], COMMON, seed=1, perturb=perturb, **overrides)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = build(tmp_path_factory.mktemp(request.param), request.param)
    ps = prompts()
    return request.param, path, ps, hf_greedy(path, ps)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(family, config) -> None:
    check_greedy(*family, config)


# ---- the block alone --------------------------------------------------------------------------
E, K, H, INTER = 8, 2, 64, 32


def block(shared: bool, norm: bool) -> SparseMoeBlock:
    config = ModelConfig.from_hf_dict({**COMMON, "model_type": "qwen2_moe"})
    config = dataclasses.replace(config, hf={"hidden_act": "silu"})
    torch.manual_seed(0)
    b = SparseMoeBlock(config, num_experts=E, top_k=K, intermediate=INTER, norm_topk_prob=norm,
                       weights_in_model_dtype=shared, shared_intermediate=48 if shared else None)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.2)
    return b.eval()


def naive(b: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(F.linear(x[t], b.gate.weight).double(), dim=-1)
        w, ids = torch.topk(probs, K)
        if b.norm_topk_prob:
            w = w / w.sum()
        for wk, e in zip(w.tolist(), ids.tolist(), strict=True):
            gate, up = F.linear(x[t], b.gate_up_proj[e]).chunk(2)
            out[t] += wk * F.linear(F.silu(gate) * up, b.down_proj[e])
        if b.shared_expert is not None:
            s = b.shared_expert
            gate, up = F.linear(x[t], s.gate_up_proj.weight).chunk(2)
            shared = F.linear(F.silu(gate) * up, s.down_proj.weight)
            out[t] += torch.sigmoid(F.linear(x[t], b.shared_expert_gate.weight)) * shared
    return out


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "expert-loop"])
@pytest.mark.parametrize("shared,norm", [(True, False), (True, True), (False, True)])
def test_block_equals_per_token_reference(monkeypatch, grouped, shared, norm) -> None:
    if grouped and not moe.grouped_mm_usable("cpu", torch.float32):
        pytest.skip("torch's grouped_mm does not run here")
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *_: grouped)
    b = block(shared, norm)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = b(x)
        want = naive(b, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_loops_over_experts_not_tokens(monkeypatch) -> None:
    """The fallback runs one matmul per expert with tokens and projection (at most 2 * E for
    300 tokens), grouped_mm two in all."""
    calls = []
    real = moe._expert_linear
    monkeypatch.setattr(moe, "_expert_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *_: False)
    b = block(shared=True, norm=True)
    x = torch.randn(300, H, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = b(x)
    assert 0 < len(calls) <= 2 * E and sum(calls) == 2 * 300 * K
    grouped_calls = []
    real_grouped = F.grouped_mm
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *_: True)
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **kw: grouped_calls.append(1)
                        or real_grouped(*a, **kw))
    with torch.inference_mode():
        got = b(x)
    assert len(grouped_calls) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_layers_follow_the_config() -> None:
    from octavo.model.models.qwen2_moe import sparse_layers

    def layers(**hf):
        return sparse_layers(ModelConfig.from_hf_dict(
            {**COMMON, "model_type": "qwen2_moe", "num_hidden_layers": 6, "num_experts": 4, **hf}))

    assert layers() == set(range(6))
    assert layers(decoder_sparse_step=2) == {1, 3, 5}
    assert layers(mlp_only_layers=[0, 3]) == {1, 2, 4, 5}
    assert layers(num_experts=0) == set()


def test_grouped_routing_reads_nothing_back_to_the_host(monkeypatch) -> None:
    """Inside a CUDA graph nothing may wait for the host: with grouped_mm the block reads no
    tensor's value in Python and calls no bincount (whose CUDA kernel reads its input's max
    back), so its decode steps can be captured."""
    b = block(shared=True, norm=True)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = naive(b, x)

    def read_back(*args, **kwargs):
        raise AssertionError("a value was read back to the host")

    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *_: True)
    monkeypatch.setattr(F, "grouped_mm", _grouped_reference)
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, read_back)
    monkeypatch.setattr(torch, "bincount", read_back)
    with torch.inference_mode():
        got = b(x)
    monkeypatch.undo()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _grouped_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm without reading offs on the host: every row against every expert, each row
    keeping its own expert's product (the group of row r is how many offsets are <= r)."""
    group = (torch.arange(x.shape[0])[:, None] >= offs[None, :]).sum(dim=1)
    every = torch.einsum("si,eio->seo", x, w)
    return every[torch.arange(x.shape[0]), group]


def test_graph_safety_is_decided_by_the_experts_path(monkeypatch) -> None:
    from octavo.model.worker.cuda_graphs import graphs_off_because

    cuda = torch.device("cuda")
    dense, sparse = torch.nn.Linear(2, 2), torch.nn.Sequential(block(shared=False, norm=True))
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *_: False)
    assert graphs_off_because(dense, cuda, torch.float32, "triton", 1, False) is None
    assert "per-expert matmuls" in graphs_off_because(sparse, cuda, torch.float32, "triton",
                                                      1, False)
    monkeypatch.setattr(moe, "grouped_mm_usable", lambda *_: True)
    assert graphs_off_because(sparse, cuda, torch.bfloat16, "triton", 1, False) is None
    assert graphs_off_because(sparse, cuda, torch.bfloat16, "triton", 1, True) == "enforce_eager"
    assert graphs_off_because(sparse, cuda, torch.bfloat16, "torch", 1, False).startswith(
        "attention_backend torch")
    assert graphs_off_because(dense, torch.device("cpu"), torch.float32, "triton", 1,
                              False) == "not on CUDA"
