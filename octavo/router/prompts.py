"""A request's prompt as the replicas will see it: token ids, then full-block hashes.

The router loads the replicas' tokenizer (the same model directory) and renders each prompt the
way `octavo serve` does: a completion's text through `tokenizer.encode`, token-id prompts as
they are, chat messages through the server's own message handling and the model's chat
template; Anthropic Messages and Responses requests are first translated to chat by the
server's own translators. The hashes come from the engine's `BlockHasher` at the replicas'
block size, so they are the names the replicas' prefix caches give the same blocks.

A prompt that cannot be rendered so (a body the server would refuse, a template error, a
Responses turn whose earlier turns live on a replica) falls back to hashing its text: the
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
from octavo.server.protocol import ChatCompletionRequest
from octavo.server.responses.protocol import ResponsesRequest
from octavo.server.responses.serving import conversation_messages
from octavo.server.responses.serving import to_chat_request as responses_to_chat

logger = logging.getLogger(__name__)

TEXT_BYTES_PER_TOKEN = 4
TEXT_EXTRA_KEY = "octavo-router:text"

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


class PromptHasher:
    """Not thread-safe (an HF fast tokenizer is not): call it from one thread."""

    def __init__(self, tokenizer: Any | None, block_size: int, *,
                 enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.hasher = BlockHasher(block_size)
        self.text_hasher = BlockHasher(block_size * TEXT_BYTES_PER_TOKEN)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser

    # ---- the entry point --------------------------------------------------------------------
    def keys(self, path: str, raw: bytes) -> PromptKeys:
        """The block hashes of the prompt of a POST to `path` with body `raw` (NO_KEYS for an
        endpoint that computes nothing in the KV cache)."""
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
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a string or a non-empty list")
        if all(_is_token(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [self.tokenizer.encode(p) for p in prompt]
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
        raise ValueError("prompt holds neither texts nor token ids")

    def chat_ids(self, chat: ChatCompletionRequest) -> list[int]:
        """serving_chat.render_chat_prompt's rendering, on this thread."""
        check_tool_messages(chat.messages)
        tools = plan_tools(chat, auto_enabled=self.enable_auto_tool_choice,
                           parser_name=self.tool_call_parser)
        messages = template_messages(messages_to_dicts(chat.messages))
        template_tools = None
        if tools.tools:
            if template_renders_tools(self.tokenizer.chat_template):
                template_tools = tools.tools
            else:
                messages = with_tool_prompt(messages, tools)
        if not self.tokenizer.chat_template:
            raise ValueError("the model's tokenizer has no chat template")
        cont = chat.continue_final_message
        return list(self.tokenizer.apply_chat_template(
            messages, tools=template_tools,
            add_generation_prompt=chat.add_generation_prompt and not cont,
            continue_final_message=cont, tokenize=True, return_dict=False,
            **(chat.chat_template_kwargs or {})))

    # ---- hashes -----------------------------------------------------------------------------
    def token_keys(self, token_ids: list[int]) -> list[bytes]:
        hashes: list[bytes] = []
        self.hasher.extend(hashes, token_ids, None)  # the server sets no cache salt
        return hashes

    def text_keys(self, text: str) -> PromptKeys:
        data = text.encode("utf-8", "replace")
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
