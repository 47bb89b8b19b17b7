"""Incremental detokenization: turn generated token ids into text deltas as they arrive.

Decoding each token alone is wrong twice over: byte-level BPE splits multi-byte characters
(emoji, CJK) across tokens, and SentencePiece decoders drop a token's leading space at the
start of a string. So each step decodes a small window twice, from the same start: the
already-emitted tail (prefix) and the tail plus the new tokens; the delta is the difference.
The window starts inside the prompt so the first output token is decoded in context, as in a
decode of the whole sequence. A delta ending in U+FFFD is an incomplete character: nothing is
emitted and the window grows until the character completes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Prompt tokens kept as decoding context (vLLM uses the same small window).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: special tokens and added ones."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


class IncrementalDetokenizer:
    """Text of one sequence's output, built token by token.

    The concatenation of the deltas returned by `append` (plus `finish`) equals the
    tokenizer's decode of the output ids for byte-level BPE tokenizers.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Iterable[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._skip_ids = special_token_ids(tokenizer) if skip_special_tokens else set()
        # Slow tokenizers decode added tokens outside the model vocab themselves; only then
        # does spaces_between_special_tokens change anything (as in HF and vLLM).
        self._added_tokens: set[str] = (
            set()
            if getattr(tokenizer, "is_fast", True)
            else set((tokenizer.get_added_vocab() or {}).keys())
        )
        context = [i for i in prompt_token_ids if i not in self._skip_ids]
        context = context[-_PROMPT_CONTEXT_TOKENS:]
        self._tokens: list[str] = list(tokenizer.convert_ids_to_tokens(context)) if context else []
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.token_ids: list[int] = []
        self.output_text = ""

    def append(self, token_ids: Iterable[int]) -> str:
        """Add generated tokens; return the newly completed text (possibly empty)."""
        new_ids = list(token_ids)
        self.token_ids.extend(new_ids)
        kept = [i for i in new_ids if i not in self._skip_ids]
        if not kept:
            return ""
        self._tokens.extend(self.tokenizer.convert_ids_to_tokens(kept))
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character (or nothing visible yet): hold back
        return self._emit(new_text[len(prefix_text) :])

    def finish(self) -> str:
        """Flush text held back for an incomplete character (it decodes to U+FFFD, as HF does)."""
        if self._read_offset >= len(self._tokens):
            return ""
        prefix_text, new_text = self._window_texts()
        return self._emit(new_text[len(prefix_text) :])

    def _window_texts(self) -> tuple[str, str]:
        prefix = self._to_string(self._tokens[self._prefix_offset : self._read_offset])
        full = self._to_string(self._tokens[self._prefix_offset :])
        return prefix, full

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.output_text += delta
        return delta

    def _to_string(self, tokens: list[str]) -> str:
        if not tokens:
            return ""
        if not self._added_tokens:
            return self.tokenizer.convert_tokens_to_string(tokens)
        # Slow tokenizer with added tokens: decode runs of ordinary tokens, keep added ones
        # verbatim, and join with spaces if asked (HF's slow `_decode`).
        parts: list[str] = []
        run: list[str] = []
        for tok in tokens:
            if tok in self._added_tokens:
                if run:
                    parts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(tok)
            else:
                run.append(tok)
        if run:
            parts.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if self.spaces_between_special_tokens else "").join(parts)
