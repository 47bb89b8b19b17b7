"""A request's prompt as the replicas will see it: token ids, then full-block hashes.

The router loads the replicas' tokenizer (the same model directory) and renders each prompt the
way `octavo serve` does: a completion's text through `tokenizer.encode`, token-id prompts as
they are, chat messages through the server's own message handling and the model's chat
template; Anthropic Messages and Responses requests are first translated to chat by the
server's own translators. The hashes come from the engine's `BlockHasher` at the replicas'
block size, so they are the names the replicas' prefix caches give the same blocks.

Tokenizing and rendering run within the server's own bounds (server/tokenizing.py): a prompt
that cannot fit max_model_len, a reserved `chat_template_kwargs` key, a request's own chat
template the operator does not trust, a render past its time budget: each is refused here with
the replica's 400 (`RefusedPrompt`), before any replica sees it.

A prompt that cannot be rendered so for another reason (a body the server would refuse for its
shape, a Responses turn whose earlier turns live on a replica) falls back to hashing its text
(its first MAX_TEXT_HASH_BYTES, enough to route it): the
UTF-8 bytes of its prompt parts, `TEXT_BYTES_PER_TOKEN` bytes standing for one token, under
their own extra key (they never collide with token blocks). Such hashes match no replica's
cache, but equal texts still hash equally, so requests sharing a prefix still meet on the
same replica.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from octavo.paging.block_hash import BlockHasher
from octavo.server.anthropic.protocol import MessagesRequest
from octavo.server.anthropic.serving import to_chat_request as messages_to_chat
from octavo.server.chat.serving import messages_to_dicts
from octavo.server.chat.tools import (
    check_tool_messages,
    plan_tools,
    template_messages,
    template_renders_tools,
    with_tool_prompt,
)
from octavo.server.errors import OpenAIError
from octavo.server.protocol import ChatCompletionRequest
from octavo.server.request_budget import check_count_of_tools
from octavo.server.responses.protocol import ResponsesRequest
from octavo.server.responses.serving import conversation_messages
from octavo.server.responses.serving import to_chat_request as responses_to_chat
from octavo.server.tokenizing import BoundedTokenizer

logger = logging.getLogger(__name__)

TEXT_BYTES_PER_TOKEN = 4
TEXT_EXTRA_KEY = "octavo-router:text"
MAX_TEXT_HASH_BYTES = 256 << 10
MAX_HASHED_PROMPTS = 128  # of a batched completion (`octavo serve` takes 128 by default)

# the POST endpoints whose prompt fills a replica's KV cache, and how to read their bodies
PROMPT_KINDS = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """`block_hashes`: the prompt's full blocks (the first prompt of a batch: the routing key);
    `more`: the other prompts of a batched completion (recorded on the same replica);
    `num_tokens`: tokens hashed; `exact`: token ids as the replicas compute them (False:
    text bytes)."""

    block_hashes: list[bytes]
    num_tokens: int
    exact: bool
    more: list[list[bytes]] = field(default_factory=list)

    @property
    def all_block_hashes(self) -> list[list[bytes]]:
        return [self.block_hashes, *self.more]


NO_KEYS = PromptKeys([], 0, False)


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class RefusedPrompt(Exception):
    """The replicas would refuse this prompt (`error`: their answer); the router answers it."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


class PromptHasher:
    """Not thread-safe (an HF fast tokenizer is not): call it from one thread."""

    def __init__(self, tokenizer: Any | None, block_size: int, *,
                 enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, max_model_len: int | None = None,
                 chat_template_timeout: float = 2.0,
                 trust_request_chat_template: bool = False) -> None:
        self.tokenizer = tokenizer
        self.bounded = None if tokenizer is None else BoundedTokenizer(
            tokenizer, max_model_len, chat_template_timeout=chat_template_timeout,
            trust_request_chat_template=trust_request_chat_template)
        self.block_size = block_size
        self.hasher = BlockHasher(block_size)
        self.text_hasher = BlockHasher(block_size * TEXT_BYTES_PER_TOKEN)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser

    # ---- the entry point --------------------------------------------------------------------
    @property
    def max_model_len(self) -> int | None:
        return None if self.bounded is None else self.bounded.max_model_len

    @max_model_len.setter
    def max_model_len(self, value: int | None) -> None:
        if self.bounded is not None:
            self.bounded.max_model_len = value

    def keys(self, path: str, raw: bytes) -> PromptKeys:
        """The block hashes of the prompt of a POST to `path` with body `raw` (NO_KEYS for an
        endpoint that computes nothing in the KV cache); RefusedPrompt where the replicas would
        refuse it within the bounds."""
        kind = PROMPT_KINDS.get(path)
        if kind is None:
            return NO_KEYS
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return self.text_keys(raw.decode("utf-8", "replace"))
        if not isinstance(body, dict):
            return self.text_keys(raw.decode("utf-8", "replace"))
        if self.tokenizer is not None:
            try:
                prompts = self.token_ids(kind, body)
            except OpenAIError as e:  # the bounds: the replica would say the same
                raise RefusedPrompt(e) from None
            except Exception as e:  # refused by the server's own checks, template errors, ...
                logger.debug("router: %s prompt not rendered (%s); hashing its text", path, e)
            else:
                hashes = [self.token_keys(ids) for ids in prompts]
                return PromptKeys(hashes[0], len(prompts[0]), True, hashes[1:])
        return self.text_keys(prompt_text(kind, body, raw))

    # ---- token ids, as `octavo serve` computes them ----------------------------------------
    def token_ids(self, kind: str, body: dict[str, Any]) -> list[list[int]]:
        """Every prompt of the request (a completion may batch several); raises where the
        replica would refuse the request or render it from state the router lacks."""
        if kind == "completion":
            return self.completion_ids(body.get("prompt"))
        if kind == "chat":
            chat = ChatCompletionRequest.model_validate(body)
        elif kind == "messages":
            chat = messages_to_chat(MessagesRequest.model_validate(body))
        else:
            request = ResponsesRequest.model_validate(body)
            if request.previous_response_id is not None:
                raise ValueError("the earlier turns are stored on a replica")
            chat = responses_to_chat(request, conversation_messages(request, []))
        return [self.chat_ids(chat)]

    def completion_ids(self, prompt: Any) -> list[list[int]]:
        assert self.bounded is not None
        if isinstance(prompt, str):
            return [self.bounded.encode(prompt)]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a string or a non-empty list")
        if all(_is_token(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            prompt = prompt[:MAX_HASHED_PROMPTS]
            for i, p in enumerate(prompt):  # every bound first, then the work
                self.bounded.check_chars(len(p), f"prompt.{i}")
            return [self.bounded.encode(p, param=f"prompt.{i}") for i, p in enumerate(prompt)]
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return [list(p) for p in prompt[:MAX_HASHED_PROMPTS]]
        raise ValueError("prompt holds neither texts nor token ids")

    def chat_ids(self, chat: ChatCompletionRequest) -> list[int]:
        """serving_chat.render_chat_prompt's rendering, on this thread, within its bounds."""
        assert self.bounded is not None
        check_count_of_tools(chat.tools)
        check_tool_messages(chat.messages)
        tools = plan_tools(chat, auto_enabled=self.enable_auto_tool_choice,
                           parser_name=self.tool_call_parser)
        messages = template_messages(messages_to_dicts(chat.messages))
        template_tools = None
        if tools.tools:
            if template_renders_tools(chat.chat_template or self.tokenizer.chat_template):
                template_tools = tools.tools
            else:
                messages = with_tool_prompt(messages, tools)
        return self.bounded.apply_chat_template(
            messages, tools=template_tools, add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            template_kwargs=chat.chat_template_kwargs, chat_template=chat.chat_template)

    # ---- hashes -----------------------------------------------------------------------------
    def token_keys(self, token_ids: list[int]) -> list[bytes]:
        hashes: list[bytes] = []
        self.hasher.extend(hashes, token_ids, None)  # the server sets no cache salt
        return hashes

    def text_keys(self, text: str) -> PromptKeys:
        data = text[:MAX_TEXT_HASH_BYTES].encode("utf-8", "replace")[:MAX_TEXT_HASH_BYTES]
        hashes: list[bytes] = []
        self.text_hasher.extend(hashes, list(data), TEXT_EXTRA_KEY)
        return PromptKeys(hashes, len(data) // TEXT_BYTES_PER_TOKEN, False)


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def prompt_text(kind: str, body: dict[str, Any], raw: bytes) -> str:
    """The prompt parts of a body, in prompt order, as text (for the fallback hashes)."""
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(_is_token(t) for t in prompt):
            prompt = prompt[0]  # a batch: the first prompt routes it
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    parts = {
        "chat": [body.get("messages")],
        "messages": [body.get("system"), body.get("messages")],
        "responses": [body.get("instructions"), body.get("input")],
    }.get(kind)
    if parts is None or all(p is None for p in parts):
        return raw.decode("utf-8", "replace")
    return json.dumps(parts, sort_keys=True, ensure_ascii=False)
