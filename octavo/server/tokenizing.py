"""A prompt's text -> token ids, within bounds that keep one request from holding the thread
that tokenizes for everyone: `octavo serve` (context.py) and `octavo router` (its prompt
hashing) use the same.

- characters: a text longer than max_model_len tokens of the vocabulary's longest token cannot
  fit, and is refused without being tokenized (a free check);
- tokens: a text that passes it may still be far too long (4 MB of CJK passes a vocabulary with
  long tokens, and takes seconds to tokenize whole), so a text longer than max_model_len
  characters is first counted in pieces of CHUNK_CHARS, cut at white space where there is
  some; the count stops, and the prompt is refused, as soon as it shows max_model_len tokens.
  Work is then bounded by max_model_len whatever the text's size; the ids of a prompt that
  fits still come from tokenizing it whole, so they are exact;
- chat templates: rendered within a time budget, the request's own template only when trusted
  (template_render.py), then tokenized as above.

Not thread-safe (an HF fast tokenizer is not): each instance is used from one thread.
"""

from __future__ import annotations

from typing import Any

from octavo.server.errors import OpenAIError, bad_request
from octavo.server.template_render import (
    TemplateTimeout,
    render_deadline,
    reserved_kwargs,
    split_template_kwargs,
)

CHUNK_CHARS = 4096
# a cut inside a word may change the tokens next to it: the count may be this much too high
SLACK_PER_CUT = 4


def longest_token_chars(tokenizer: Any) -> int:
    """The longest text one token of the vocabulary stands for (at least 1)."""
    vocab = tokenizer.get_vocab()
    return max((len(tokenizer.convert_tokens_to_string([t])) for t in vocab), default=1) or 1


class BoundedTokenizer:
    def __init__(self, tokenizer: Any, max_model_len: int | None, *,
                 chat_template_timeout: float, trust_request_chat_template: bool = False,
                 longest_token: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len  # None: not known yet (the router, at start)
        self.chat_template_timeout = chat_template_timeout
        self.trust_request_chat_template = trust_request_chat_template
        self.longest_token = longest_token or longest_token_chars(tokenizer)
        self.reserved = reserved_kwargs(tokenizer)

    @property
    def max_prompt_chars(self) -> int | None:
        if self.max_model_len is None:
            return None
        return self.max_model_len * self.longest_token

    # ---- text --------------------------------------------------------------------------------
    def check_chars(self, num_chars: int, param: str) -> None:
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise bad_request(  # worded as vLLM's context-length error (serving_common.py)
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"the prompt has {num_chars} characters, more than {self.max_model_len} tokens "
                f"of this vocabulary can hold (at most {limit} characters). "
                "Please reduce the length of the messages.", param,
            )

    def encode(self, text: str, add_special_tokens: bool = True,
               param: str = "prompt") -> list[int]:
        self.check_chars(len(text), param)
        if self.max_model_len is not None and len(text) > self.max_model_len:
            self.check_tokens(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_tokens(self, text: str, param: str) -> None:
        """400 once pieces of `text` hold max_model_len tokens (the count may stop early)."""
        limit = self.max_model_len
        assert limit is not None
        count, start, cuts = 0, 0, 0
        while start < len(text):
            end = piece_end(text, start)
            count += len(self.tokenizer.encode(text[start:end], add_special_tokens=False))
            if end < len(text):
                cuts += 1
            if count - SLACK_PER_CUT * cuts >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested at least {count - SLACK_PER_CUT * cuts} tokens in the prompt "
                    f"(counted in its first {end} of {len(text)} characters), leaving no room "
                    "for a generated token. Please reduce the length of the messages.", param)
            start = end

    # ---- chat --------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None,
               chat_template: str | None = None) -> str:
        """The chat template's text for `messages` (400 for what a request may not do, a
        template error, or a render past its time budget)."""
        template, extra = split_template_kwargs(template_kwargs, chat_template, self.reserved,
                                                self.trust_request_chat_template)
        if template is None and not self.tokenizer.chat_template:
            raise bad_request("the model's tokenizer has no chat template", "messages")
        self.check_chars(text_length(messages) + text_length(tools), "messages")
        try:
            with render_deadline(self.chat_template_timeout):
                return self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=add_generation_prompt and not
                    continue_final_message, continue_final_message=continue_final_message,
                    tokenize=False, chat_template=template, **extra)
        except OpenAIError:
            raise
        except TemplateTimeout as e:
            raise bad_request(f"could not apply the chat template: {e}", "messages") from None
        except Exception as e:  # jinja errors, a template's own raise_exception(...)
            raise bad_request(f"could not apply the chat template: {e}", "messages") from None

    def apply_chat_template(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """render()'s text as token ids (tokenized as HF's apply_chat_template does: no special
        tokens added; the template writes its own)."""
        return self.encode(self.render(messages, **options), add_special_tokens=False,
                           param="messages")


def piece_end(text: str, start: int) -> int:
    """Where the piece of `text` from `start` ends: CHUNK_CHARS on, moved back to just before
    white space in its last quarter if there is some (a word's tokens then stay whole)."""
    end = start + CHUNK_CHARS
    if end >= len(text):
        return len(text)
    floor = end - CHUNK_CHARS // 4
    for sep in (" ", "\n"):
        cut = text.rfind(sep, floor, end)
        if cut > start:
            return cut
    return end


def text_length(value: Any) -> int:
    """Characters of text anywhere in a message (content, content parts, names, ...)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_length(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(text_length(v) for v in value)
    return 0
