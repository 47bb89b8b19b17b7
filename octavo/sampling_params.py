"""Per-request sampling settings, with vLLM's names, defaults and validation.

Names and defaults follow vLLM so that users (and the OpenAI server layer) can pass the same
arguments. Validation happens once, at construction, so the engine and runner can trust the
values and never re-check them on the hot path. A neutral module: every layer may import it,
and it imports nothing of octavo.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

# The reasoning markers of thinking models (DeepSeek-R1, Qwen3): thinking_token_budget's default
THINK_START, THINK_END = "<think>", "</think>"

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS): dividing logits by a
# near-zero temperature overflows, and the result is argmax anyway.
SAMPLING_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's StructuredOutputsParams): exactly one of `json` (a
    JSON schema, as a dict or its text), `regex`, `choice` (the output is one of these
    strings), `grammar` (Lark, or GBNF as llama.cpp writes it) or `json_object` (any JSON
    object).

    JSON options: by default the output has no free whitespace (items ", " and keys ": " are
    not padded further), so every token carries content and a small model at temperature 1
    cannot run out of tokens emitting spaces; `whitespace_pattern` (a regex) allows the
    whitespace it matches between tokens; `disable_any_whitespace` writes the most compact
    JSON (separators "," and ":"); `disable_additional_properties` closes every object schema
    that does not say otherwise. `disable_fallback` is accepted for vLLM compatibility (there is
    one backend, llguidance, and no fallback)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, "
                             f"grammar or json_object; got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of "
                             "non-empty strings")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("structured outputs: json must be a schema (a dict or its JSON "
                             "text)")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names): CUMULATIVE, the whole text
    and token list so far (the default, what `LLM.generate` returns); DELTA, only what is new
    since the request's previous output (a streaming server: no step copies a stream's earlier
    tokens); FINAL_ONLY, one output when the request finishes (a server's whole response)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Sampling settings of one request (see vLLM's SamplingParams for the semantics)."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 bans
    # a token, 100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Words (strings) the output must not contain as tokens: the last token of each word's
    # tokenization is banned after its preceding tokens (vLLM's bad_words); the engine turns
    # them into token ids (bad_words_token_ids) with the tokenizer.
    bad_words: list[str] | None = None
    # A constraint the output follows: a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # A reasoning budget (vLLM's thinking_token_budget, llama-server's --reasoning-budget):
    # once the model has written this many tokens after the start-of-thinking marker without
    # ending its reasoning, the end-of-thinking marker is forced, token by token. The markers'
    # token ids default to those of "<think>" and "</think>" (the engine fills them in).
    thinking_token_budget: int | None = None
    think_start_token_ids: list[int] | None = None
    think_end_token_ids: list[int] | None = None
    # Free-form arguments for custom logits processors (vLLM's extra_args).
    extra_args: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine from the tokenizer/config (vLLM keeps the same private fields):
    # EOS plus stop_token_ids, banned while fewer than min_tokens were generated.
    all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False, compare=False)
    # bad_words as token id sequences (each one or more tokens long), set by the engine.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False,
                                                 compare=False)

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else []
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == -1:
            # vLLM historically used -1 for "disabled" and now uses 0; store one spelling.
            self.top_k = 0
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            _check_finite(name, getattr(self, name))
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        _check_int("best_of", self.best_of)
        if self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and "
                f"best_of={self.best_of}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}"
            )
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < 0:
                    raise ValueError(f"{name} must be non-negative, got {value}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id)
        if any(s == "" for s in self.stop):
            raise ValueError("stop cannot contain an empty string")
        for token_id, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias token id", token_id)
            if token_id < 0:
                raise ValueError(f"logit_bias token id must be non-negative, got {token_id}")
            _check_finite("logit_bias value", bias)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id)
                if token_id < 0:
                    raise ValueError(f"allowed_token_ids must be non-negative, got {token_id}")
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip()
                                                  for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget)
            if self.thinking_token_budget < 0:
                raise ValueError("thinking_token_budget must be non-negative, got "
                                 f"{self.thinking_token_budget}")
        for name in ("think_start_token_ids", "think_end_token_ids"):
            ids = getattr(self, name)
            if ids is not None:
                if not ids:
                    raise ValueError(f"{name} must not be empty")
                for token_id in ids:
                    _check_int(name, token_id)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the row takes argmax (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    def update_from_tokenizer(self, eos_token_id: int | None) -> None:
        """Record EOS among the tokens banned before min_tokens (unless ignore_eos)."""
        if eos_token_id is not None and not self.ignore_eos:
            self.all_stop_token_ids.add(eos_token_id)

    def update_from_generation_config(self, generation_config: dict[str, Any],
                                      model_eos_token_id: int | None = None) -> None:
        """Stop on every EOS id of the model (vLLM's update_from_generation_config).

        `model_eos_token_id` (the tokenizer's EOS) is the one the stop checker knows as EOS;
        the other ids of generation_config["eos_token_id"] (an int or a list, e.g. Gemma 3's
        [1, 106], 106 = <end_of_turn>) join stop_token_ids, so a request stops on them with
        finish_reason "stop" and stop_reason the id, as vLLM reports them. All of them are
        banned while fewer than min_tokens were generated. With ignore_eos none of them stops
        a request or is banned (unlike vLLM, which still bans them before min_tokens: here
        ignore_eos leaves the tokenizer's EOS alone too, see update_from_tokenizer); explicit
        stop_token_ids are kept either way.
        """
        self.update_from_tokenizer(model_eos_token_id)
        eos = generation_config.get("eos_token_id")
        if eos is None or self.ignore_eos:
            return
        ids = [eos] if isinstance(eos, int) else list(eos)
        extra = [t for t in dict.fromkeys(ids) if t != model_eos_token_id]
        self.all_stop_token_ids.update(extra)
        self.stop_token_ids = list(self.stop_token_ids or []) + [
            t for t in extra if t not in (self.stop_token_ids or [])]

    def clone(self) -> SamplingParams:
        """Deep-enough copy: lists are copied so per-sequence edits don't leak."""
        from copy import deepcopy

        return deepcopy(self)


@dataclass
class BeamSearchParams:
    """Settings of a beam search request (vLLM's BeamSearchParams)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_finite("temperature", self.temperature)
        _check_finite("length_penalty", self.length_penalty)
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")


def _normalise_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    stop = list(stop)
    if not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    return stop


def _check_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass; True as n=1 is almost certainly a caller bug.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
