"""Deciding when a sequence is finished, and keeping partial stop strings out of streams.

Two halves, in vLLM v1's split: the scheduler checks what tokens alone decide (EOS, stop token
ids, length) as each token lands, so a finished sequence frees its blocks at once; the output
processor checks stop strings in the detokenized text. Stop strings can span token boundaries,
so they are searched only where an occurrence could overlap the newly added characters. Plain
values in, plain values out: testable alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from octavo.sampling_params import SamplingParams

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StopDecision:
    """Why a sequence finished and, when its text must change, the text to keep."""

    finish_reason: FinishReason
    # Stop token id or stop string that ended it (vLLM's stop_reason); None for EOS/length.
    stop_reason: int | str | None = None
    # Final output text after truncation; None when the text stays as it is.
    output_text: str | None = None


def find_stop_string(
    output_text: str,
    new_char_count: int,
    stop: Sequence[str],
    include_stop_str_in_output: bool = False,
) -> tuple[str, str] | None:
    """Earliest stop string occurrence that overlaps the last `new_char_count` characters.

    Returns (stop_str, truncated_text): the text is cut before the stop string, or right after
    it with include_stop_str_in_output. Earlier text was checked on earlier steps.
    """
    if not stop or new_char_count <= 0:
        return None
    best: tuple[int, str] | None = None
    new_start = len(output_text) - new_char_count
    for stop_str in stop:
        index = output_text.find(stop_str, max(0, new_start - len(stop_str) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    end = index + len(stop_str) if include_stop_str_in_output else index
    return stop_str, output_text[:end]


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    Only these characters could still turn into a stop string, so holding back exactly them
    is enough and streams the rest sooner than the fixed buffer.
    """
    longest = 0
    for stop_str in stop:
        for size in range(min(len(stop_str) - 1, len(text)), longest, -1):
            if text.endswith(stop_str[:size]):
                longest = size
                break
    return longest


def check_token_stop(
    params: SamplingParams,
    output_token_ids: Sequence[int],
    eos_token_id: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
) -> StopDecision | None:
    """The scheduler's check after each new token (vLLM's StopChecker order, token part).

    "stop": EOS (unless ignore_eos) or a stop token id, but neither before min_tokens outputs;
    "length": max_tokens outputs or max_model_len total tokens. Stop strings need the text:
    check_text_stop adds them.
    """
    num_out = len(output_token_ids)
    if num_out and num_out >= params.min_tokens:
        last = output_token_ids[-1]
        if not params.ignore_eos and eos_token_id is not None and last == eos_token_id:
            return StopDecision("stop")
        if last in (params.stop_token_ids or ()):
            return StopDecision("stop", last)
    if num_prompt_tokens + num_out >= max_model_len:
        return StopDecision("length")
    if params.max_tokens is not None and num_out >= params.max_tokens:
        return StopDecision("length")
    return None


def check_text_stop(
    params: SamplingParams,
    token_decision: StopDecision | None,
    num_output_tokens: int,
    output_text: str,
    new_char_count: int,
) -> StopDecision | None:
    """The output processor's check once the step's tokens are detokenized.

    A stop string that overlaps the new text ends the sequence ("stop", even on its last
    allowed token: it wins over "length"); the text is cut before it, or after it with
    include_stop_str_in_output. EOS and stop-token text (visible only with
    skip_special_tokens=False) is dropped like a stop string. `new_char_count` is how many
    characters this step's tokens added to `output_text`.
    """
    if token_decision is not None and token_decision.finish_reason == "stop":
        text = None
        if new_char_count:
            eos = token_decision.stop_reason is None
            hide = not params.include_stop_str_in_output if eos else not params.skip_special_tokens
            if hide:
                text = output_text[:-new_char_count]
        return StopDecision("stop", token_decision.stop_reason, text)
    if params.detokenize and params.stop and num_output_tokens >= params.min_tokens:
        found = find_stop_string(
            output_text, new_char_count, params.stop, params.include_stop_str_in_output
        )
        if found is not None:
            return StopDecision("stop", found[0], found[1])
    return token_decision
