"""Configs that are not options: the model's architecture, and what the scheduler is given.

Every option a user can set (and its default) lives in octavo/engine_args.py; config flows one
way: CLI flags / LLM kwargs -> EngineArgs -> these -> the parts. A neutral module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF model_type -> the architecture octavo runs it with (octavo/model/models/registry.py maps these
# to classes); a neutral module cannot import the model package, so the names live here
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen2_moe", "mixtral",
                         "gemma2", "gemma3_text")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture of a decoder-only model, read from an HF ``config.json``: the fields
    every family shares, plus the whole HF dict (`hf`) for what only one family reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # biases on q, k and v
    o_proj_bias: bool = False  # and on the output projection (Llama's attention_bias; not Qwen2)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    # tokens each query sees, itself included (HF's sliding_window); None: all before it
    sliding_window: int | None = None
    # per layer: the window of a sliding-window layer, None for full attention (HF's layer_types)
    layer_windows: tuple[int | None, ...] = ()
    hf: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return cls.from_hf_dict(json.loads(config_file.read_text()))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; octavo runs these model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = d["num_attention_heads"]
        # transformers >= 5 keeps rope settings in `rope_parameters`; older configs use
        # `rope_theta` + `rope_scaling`.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): global's
            rope = dict(rope["full_attention"])
        rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        window = _sliding_window(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("qkv_bias", True)) if model_type == "qwen2_moe" else
            bool(d.get("attention_bias", model_type == "qwen2")),
            o_proj_bias=model_type != "qwen2" and bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
            sliding_window=window,
            layer_windows=_layer_windows(d, model_type, window),
            hf=dict(d),
        )

    @property
    def max_len(self) -> tuple[int, str]:
        """The longest sequence this model runs exactly, and what sets it."""
        return self.max_position_embeddings, (
            f"its max_position_embeddings ({self.max_position_embeddings})")

    @property
    def checkpoint_dtype(self) -> str:
        """The dtype the checkpoint was saved in (HF's `dtype`, formerly `torch_dtype`)."""
        d = self.hf.get("dtype") or self.hf.get("torch_dtype") or "float32"
        return str(d).removeprefix("torch.")

    @property
    def kv_groups(self) -> KVGroups:
        """Which layers share a block table (one group unless local and global layers mix)."""
        if not self.layer_windows:
            return KVGroups.single(self.num_layers, self.sliding_window)
        return KVGroups.from_layer_windows(self.layer_windows)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer (what full attention keeps per token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_bytes_per_slot(self, dtype_bytes: int) -> int:
        """One slot of one KV block: K and V of one token in one group's layers."""
        slots = self.kv_groups.slots_per_group
        return 2 * slots * self.num_kv_heads * self.head_dim * dtype_bytes


def _layer_windows(d: dict[str, Any], model_type: str, window: int | None
                   ) -> tuple[int | None, ...]:
    """Which layers attend within the sliding window, by transformers' rules for each family:
    its `layer_types` when the config names them, else the family's default pattern."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"{model_type}: layer_types names {len(types)} layers, the model "
                             f"has {n}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"{model_type}: unsupported layer types {sorted(unknown)}")
        local = [t == "sliding_attention" for t in types]
    elif model_type == "gemma2":
        local = [i % 2 == 0 for i in range(n)]
    elif model_type == "gemma3_text":
        pattern = int(d.get("sliding_window_pattern", 6))
        local = [(i + 1) % pattern != 0 for i in range(n)]
    elif model_type in ("qwen2", "qwen3"):  # the layers from max_window_layers on
        first = int(d.get("max_window_layers", 28))
        local = [i >= first for i in range(n)]
    elif model_type == "qwen2_moe":  # every other layer below max_window_layers
        last = int(d.get("max_window_layers", 28))
        local = [(i + 1) % 2 == 1 and i < last for i in range(n)]
    elif model_type == "llama":  # transformers' Llama has no sliding window
        local = [False] * n
    else:  # mistral, mixtral, phi3: every layer when the config sets a window
        local = [True] * n
    if window is None:
        return (None,) * n
    return tuple(window if flag else None for flag in local)


def _sliding_window(d: dict[str, Any]) -> int | None:
    """HF's sliding_window when it applies (Qwen2/3 set it but switch it off with
    use_sliding_window false)."""
    window = d.get("sliding_window")
    if not window or d.get("use_sliding_window") is False:
        return None
    return int(window)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the scheduler needs; built by EngineArgs.scheduler_config (the defaults live there)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str
    scheduling_policy: str
    speculative: SpeculativeConfig | None = None
    long_prefill_token_threshold: int = 0  # 0: a prompt may take the whole budget
    max_num_partial_prefills: int = 0  # 0: as many prompts per step as the budget allows


SPECULATIVE_METHODS = ("ngram", "draft_model", "self_draft")
_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min",
                     "prompt_lookup_max", "num_draft_layers", "cost_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, from vLLM's `speculative_config` dict.

    `ngram` (prompt lookup) proposes the `num_speculative_tokens` tokens that followed the
    latest earlier occurrence of the sequence's last n tokens, n from `prompt_lookup_max` down
    to `prompt_lookup_min` (vLLM's defaults: one given sets the other; neither: both 5).
    `draft_model` drafts with a smaller model of the same vocabulary (`model`: its directory
    or installed name) over its own paged KV cache, greedily.
    `self_draft` (octavo's) drafts with the target's own first `num_draft_layers` layers and
    its LM head (default: a quarter of the layers), for a model with no smaller sibling.
    `cost_model` (octavo's): per sequence, speculate only as far as its acceptance rate pays
    for the extra tokens a step computes (False: always propose the full k).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    cost_model: bool = True
    num_draft_layers: int | None = None
    model: str | None = None  # the draft model (draft_model)

    @property
    def drafts_in_runner(self) -> bool:
        """The runner proposes the drafts (a model drafts them); else the scheduler does."""
        return self.method != "ngram"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        unknown = [k for k in d if k not in _SPECULATIVE_KEYS]
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} (keys: {', '.join(_SPECULATIVE_KEYS)})")
        method = d.get("method")
        if method is None and d.get("model") in ("ngram", "[ngram]"):
            method = "ngram"  # vLLM's older spelling
        if method is None:
            method = "draft_model" if d.get("model") else None
        if method is None:
            raise ValueError("'method' must be given (ngram)")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"method {method!r} is not supported (supported: "
                             f"{', '.join(SPECULATIVE_METHODS)})")
        model = d.get("model")
        if method == "draft_model" and not isinstance(model, str):
            raise ValueError("method 'draft_model' needs 'model': the draft model's directory")
        if method != "draft_model":
            model = None
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"'num_speculative_tokens' must be an int >= 1, got {k!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        lo, hi = (5, 5) if lo is None else (lo, hi)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name!r} must be an int >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"'prompt_lookup_min' ({lo}) must be <= 'prompt_lookup_max' ({hi})")
        cost = d.get("cost_model", True)
        if not isinstance(cost, bool):
            raise ValueError(f"'cost_model' must be true or false, got {cost!r}")
        layers = d.get("num_draft_layers")
        if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool)
                                   or layers < 1):
            raise ValueError(f"'num_draft_layers' must be an int >= 1, got {layers!r}")
        if layers is not None and method != "self_draft":
            raise ValueError("'num_draft_layers' is for method 'self_draft'")
        return cls(method, k, lo, hi, cost, layers, model)


@dataclass(frozen=True, slots=True)
class KVGroups:
    """KV cache groups: which layers share a block table (the hybrid KV cache, as in vLLM v1).

    Layers that attend the same way (full attention, or a sliding window of the same width) keep
    the same blocks, so they can share one block table. Where a model mixes them (Gemma 2 and 3
    interleave local and global layers) the block pool stays one pool of equal blocks and the
    layers are cut into groups of equal size, `slots_per_group` layers each, every group with its
    own block table: a block id belongs to one group at a time and holds K/V for that group's
    layers only. The KV tensors therefore have `slots_per_group` layer slots, not one per layer;
    layer `l` lives in slot `layer_slot[l]` of whatever block its group `layer_group[l]` points at.

    Gemma 3 270M (18 layers, every sixth global) becomes one full-attention group and five
    sliding groups of three layers each; a model with one kind of layer (Llama, Mistral) is one
    group of all its layers, which is the plain paged KV cache.
    """

    windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot in the KV tensors
    slots_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def has_window(self) -> bool:
        return any(w is not None for w in self.windows)

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVGroups:
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def from_layer_windows(cls, layer_windows: tuple[int | None, ...]) -> KVGroups:
        """Kinds of layers in order of first appearance; each kind cut into groups of the
        smallest kind's layer count (the last group of a kind may be smaller: its spare slots
        are simply unused)."""
        if not layer_windows:
            raise ValueError("a model needs at least one layer")
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            if window is not None and window < 1:
                raise ValueError(f"layer {layer}: sliding window {window} must be >= 1")
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        windows: list[int | None] = []
        layer_group = [0] * len(layer_windows)
        layer_slot = [0] * len(layer_windows)
        for window, layers in kinds.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_group[layer] = len(windows)
                    layer_slot[layer] = slot
                windows.append(window)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
