"""Prompt intake: tokenize, validate, and build the Request the scheduler will run.

Everything that can be wrong with a request is found here, before it reaches the scheduler, and
reported as a ValueError naming the problem.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octavo.config import ModelConfig
from octavo.engine.beam_search import BeamSearchState, beam_sampling_params
from octavo.engine.request import Request
from octavo.engine.structured_output import StructuredOutputs
from octavo.paging.block_hash import BlockHasher
from octavo.sampling_params import THINK_END, THINK_START, BeamSearchParams, SamplingParams


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_id(tokenizer: Any, model: ModelConfig) -> int | None:
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return model.eos_token_ids[0] if model.eos_token_ids else None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request's costly fields made ready off the engine thread (a server's worker does it,
    server/request_budget.py): its bad_words as token ids, and a grammar
    matcher at the start of its constraint (each request takes a copy). What is None here is
    done by `process` itself."""

    bad_words_token_ids: list[list[int]] | None = None
    matcher: Any = None


class InputProcessor:
    def __init__(self, tokenizer: Any, model: ModelConfig, max_model_len: int,
                 hasher: BlockHasher | None,
                 structured: StructuredOutputs | None = None) -> None:
        self.tokenizer = tokenizer
        self.structured = structured or StructuredOutputs(tokenizer, model.vocab_size)
        self.vocab_size = model.vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id(tokenizer, model)
        # the model's EOS ids (config.json's eos_token_id, an int or a list): requests stop on
        # all of them, the ones besides the tokenizer's EOS as stop token ids
        self.generation_config: dict[str, Any] = {"eos_token_id": list(model.eos_token_ids)}
        self.hasher = hasher  # None when prefix caching is off: nothing is hashed
        self._arrivals = itertools.count()

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids' (vLLM's TokensPrompt)")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        return prompt, self.tokenizer.encode(prompt)

    def process(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        beam_params: BeamSearchParams | None = None,
        prepared: Prepared | None = None,
    ) -> Request:
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        if beam_params is not None:
            limit = self.max_model_len - len(token_ids)
            beam_params = dataclasses.replace(
                beam_params, max_tokens=min(beam_params.max_tokens, limit))
            params = beam_sampling_params(beam_params)
        else:
            # the engine's own copy: every EOS id stops it (the model's others as stop token
            # ids) and joins the ids banned before min_tokens
            params = (params or SamplingParams()).clone()
            params.update_from_generation_config(self.generation_config, self.eos_token_id)
            for name, ids in (("logit_bias", params.logit_bias or {}),
                              ("allowed_token_ids", params.allowed_token_ids or [])):
                bad = [t for t in ids if t >= self.vocab_size]
                if bad:
                    raise ValueError(f"{name} token id {bad[0]} is out of range "
                                     f"[0, {self.vocab_size})")
            if params.bad_words:
                params.bad_words_token_ids = (
                    prepared.bad_words_token_ids
                    if prepared is not None and prepared.bad_words_token_ids is not None
                    else bad_words_token_ids(self.tokenizer, params.bad_words))
            if params.thinking_token_budget is not None:
                for name, marker in (("think_start_token_ids", THINK_START),
                                     ("think_end_token_ids", THINK_END)):
                    if getattr(params, name) is None:
                        setattr(params, name, list(self.tokenizer.encode(
                            marker, add_special_tokens=False)))
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival_index=next(self._arrivals),
            priority=priority,
            cache_salt=prompt.get("cache_salt") if isinstance(prompt, dict) else None,
            eos_token_id=self.eos_token_id,
            hasher=self.hasher,
        )
        if params.structured_outputs is not None:
            request.seqs[0].grammar = (
                prepared.matcher.deep_copy() if prepared is not None and prepared.matcher
                is not None else self.structured.matcher(params.structured_outputs))
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if beam_params is not None:
            request.beam = BeamSearchState(beam_params, self.eos_token_id)
        return request

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len}: "
                "it must be shorter, leaving room for at least one generated token"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, at the start of a text and after a space (vLLM's rule: the
    spaced form counts only when it is a different first token of the same length)."""
    result: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        result.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            result.append(spaced)
    return result
