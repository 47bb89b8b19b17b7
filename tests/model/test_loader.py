"""load_model's memory: parameters created on the meta device directly in their dtype, weights
streamed from safetensors one checkpoint tensor at a time, and a tensor-parallel rank reading
only its slice of each (model/loader.py, checkpoint.py, layers/weights.py). Checked through a
stand-in for safe_open that counts the bytes each read takes out of the files and how many of
them are alive at once."""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import octavo.model.loader as loader
from octavo.config import ModelConfig
from octavo.model.layers import weights
from octavo.model.loader import load_model
from octavo.model.parallel.tensor_parallel import ShardPlan, TPGroup
from tests.conftest import build_tiny_llama


class Reads:
    """Bytes read out of the checkpoint: in all, alive now, alive at most at once."""

    def __init__(self) -> None:
        self.total = self.alive = self.peak = 0

    def took(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.total += n
        self.alive += n
        self.peak = max(self.peak, self.alive)
        weakref.finalize(t, self._freed, n)
        return t

    def _freed(self, n: int) -> None:
        self.alive -= n


class CountingSlice:
    def __init__(self, part, reads: Reads) -> None:
        self.part, self.reads = part, reads

    def __getitem__(self, index):
        return self.reads.took(self.part[index])

    def __getattr__(self, name):
        return getattr(self.part, name)


class CountingFile:
    def __init__(self, handle, reads: Reads) -> None:
        self.handle, self.reads = handle, reads

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def get_tensor(self, name):
        return self.reads.took(self.handle.get_tensor(name))

    def get_slice(self, name):
        return CountingSlice(self.handle.get_slice(name), self.reads)

    def keys(self):
        return self.handle.keys()


@pytest.fixture
def reads(monkeypatch) -> Reads:
    """Every safe_open octavo's loading calls, counted."""
    counted = Reads()

    def counting_open(*args, **kwargs):
        return CountingFile(safe_open(*args, **kwargs), counted)

    for module in ("octavo.model.loader", "octavo.model.checkpoint"):
        if hasattr(sys.modules.get(module), "safe_open"):
            monkeypatch.setattr(sys.modules[module], "safe_open", counting_open)
    return counted


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose vocabulary (251) splits unevenly over two ranks, saved in bf16 in two
    files with an index, as large checkpoints are."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_llama(tmp_path_factory.mktemp("loader"), vocab_size=251,
                            num_hidden_layers=3)
    tensors = {k: v.bfloat16() for k, v in load_file(path / "model.safetensors").items()}
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def checkpoint_bytes(model_dir: Path) -> tuple[int, int]:
    """(all the checkpoint's tensor bytes, its largest tensor's)."""
    sizes = []
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            sizes += [f.get_slice(n)[:].numel() * 2 for n in f.keys()]  # noqa: SIM118
    return sum(sizes), max(sizes)


def load(model_dir: Path, dtype: torch.dtype, tp: TPGroup | None = None) -> nn.Module:
    config = ModelConfig.from_dir(model_dir)
    return load_model(model_dir, config, dtype, torch.device("cpu"), 64, linear_backend="torch",
                      fused_ops="torch", tp=tp)


def test_parameters_are_born_in_their_dtype(model_dir, monkeypatch) -> None:
    """No fp32 copy of a bf16 model ever exists: the parameters the device gets are bf16."""
    born: list[set[torch.dtype]] = []
    to_empty = nn.Module.to_empty

    def spy(self, *args, **kwargs):
        module = to_empty(self, *args, **kwargs)
        born.append({p.dtype for p in module.parameters()})
        return module

    monkeypatch.setattr(nn.Module, "to_empty", spy)
    model = load(model_dir, torch.bfloat16)
    assert born == [{torch.bfloat16}]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos.dtype == torch.float32


def test_weights_stream_one_tensor_at_a_time(model_dir, reads) -> None:
    total, largest = checkpoint_bytes(model_dir)
    load(model_dir, torch.float32)
    assert reads.total >= total  # every tensor read (the tied-or-not LM head included)
    assert reads.peak <= largest, (reads.peak, largest, total)


def test_a_rank_reads_its_slice_and_gets_what_the_whole_model_cuts(model_dir, reads) -> None:
    """Rank 1 of 2 reads about half the checkpoint (its heads, MLP units and vocabulary rows,
    and the whole norms), and its parameters equal the full model's cut by ShardPlan.shard."""
    total, _ = checkpoint_bytes(model_dir)
    whole = {n: p.detach().clone() for n, p in load(model_dir, torch.float32).named_parameters()}
    before = reads.total
    rank = load(model_dir, torch.float32, TPGroup(1, 2))
    assert reads.total - before < 0.6 * total
    plan = ShardPlan(ModelConfig.from_dir(model_dir), 1, 2)
    inner = {".linear.": ".", "embed_tokens.embedding.": "embed_tokens.",
             "lm_head.lm_head.": "lm_head."}
    for name, p in rank.named_parameters():
        for wrapped, plain in inner.items():
            name = name.replace(wrapped, plain)
        torch.testing.assert_close(p, plan.shard(name, whole[name]), rtol=0, atol=0)


def test_lazy_tensors_read_only_the_regions_asked_for() -> None:
    base = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    asked: list[tuple[slice, ...]] = []

    def get(index):
        asked.append(index)
        return base[index]

    stored = weights.Stored(base.shape, base.dtype, get)
    fused = weights.cat([stored[:2], stored[4:], torch.ones(1, 4)])
    assert fused.shape == (5, 4)
    q, rest = fused.split([3, 2])
    cut = weights.cat([q[1:3, 1:3], rest[:, 1:3]])
    dst = torch.empty(4, 2)
    weights.copy_into(dst, cut)
    want = torch.cat([base[:2], base[4:], torch.ones(1, 4)])
    assert torch.equal(dst, torch.cat([want[1:3, 1:3], want[3:5, 1:3]]))
    assert asked == [(slice(1, 2), slice(1, 3)), (slice(4, 5), slice(1, 3)),
                     (slice(5, 6), slice(1, 3))]
    stacked = weights.stack([stored[:2], stored[2:4]])
    assert torch.equal(stacked.materialize(), base[:4].view(2, 2, 4))
    with pytest.raises(TypeError, match="basic slices"):
        stored[0]


def test_a_missing_checkpoint_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="holds no \\*.safetensors checkpoint"):
        loader.load_safetensors(nn.Module(), tmp_path)
