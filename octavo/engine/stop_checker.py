"""Deciding when a sequence is finished, and keeping partial stop strings out of streams.

Stop strings can span token boundaries, so they are searched in the incrementally decoded
text: only where an occurrence could overlap the newly added characters. No engine types are
used here; the engine passes plain values, so this is testable alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from octavo.engine.sampling_params import SamplingParams

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


def stop_hold_back(stop: Sequence[str], include_stop_str_in_output: bool = False) -> int:
    """Characters a stream must hold back: max(len(stop)) - 1 (vLLM's fixed buffer)."""
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1


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


class StreamBuffer:
    """Hands out streaming deltas of a growing text, never a possible partial stop string.

    Call `delta(text, finished)` with the full (already truncated) output text after each
    step; on the final call everything left is released.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stop = [] if include_stop_str_in_output else list(stop)
        self.sent = 0

    def delta(self, text: str, finished: bool = False) -> str:
        end = len(text) if finished else len(text) - partial_stop_len(text, self._stop)
        end = max(end, self.sent)
        out = text[self.sent : end]
        self.sent = end
        return out


def check_stop(
    params: SamplingParams,
    output_token_ids: Sequence[int],
    output_text: str,
    new_char_count: int,
    eos_token_id: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
) -> StopDecision | None:
    """Finish reason after a step, or None to continue (vLLM's StopChecker order).

    "stop": EOS (unless ignore_eos), a stop token id, or a stop string, but none of these
    before min_tokens outputs; "length": max_tokens outputs or max_model_len total tokens.
    `new_char_count` is how many characters this step's tokens added to `output_text`.
    """
    num_out = len(output_token_ids)
    if num_out and num_out >= params.min_tokens:
        last = output_token_ids[-1]
        if not params.ignore_eos and eos_token_id is not None and last == eos_token_id:
            # EOS text only shows with skip_special_tokens=False; drop it like a stop string.
            text = None
            if new_char_count and not params.include_stop_str_in_output:
                text = output_text[:-new_char_count]
            return StopDecision("stop", None, text)
        if last in (params.stop_token_ids or ()):
            text = None
            if new_char_count and not params.skip_special_tokens:
                text = output_text[:-new_char_count]
            return StopDecision("stop", last, text)
        if params.detokenize and params.stop:
            found = find_stop_string(
                output_text, new_char_count, params.stop, params.include_stop_str_in_output
            )
            if found is not None:
                return StopDecision("stop", found[0], found[1])
    if num_prompt_tokens + num_out >= max_model_len:
        return StopDecision("length")
    if params.max_tokens is not None and num_out >= params.max_tokens:
        return StopDecision("length")
    return None
