"""What every endpoint shares: the async engine, the server's settings, tokenizer copies.

Work that grows with the input never runs on the event loop: tokenizing a prompt and rendering
a chat template go to one worker thread (HF's Rust tokenizer releases the GIL while it works),
after a check that costs nothing: a text longer than max_model_len tokens of the vocabulary's
longest token cannot fit, and is refused without being tokenized. The worker and the loop each
have their OWN tokenizer instance (the loop's only decodes single tokens for logprobs), and the
engine thread has the engine's: HF fast tokenizers raise "Already borrowed" when one instance
is used from two threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from transformers import AutoTokenizer

from octavo.engine.async_engine import AsyncLLMEngine
from octavo.server.args import ServerConfig
from octavo.server.errors import OpenAIError, bad_request
from octavo.server.metrics import ServerMetrics

T = TypeVar("T")


class ServerContext:
    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        info = engine.model_info  # the server reads the engine through AsyncLLMEngine only
        self.engine = engine
        self.config = config
        self.model_dir = str(info.model_dir)
        if not config.served_model_names:
            config = config.replace(served_model_names=[info.model_dir.name])
            self.config = config
        self.model_name = config.served_model_names[0]
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.max_num_seqs = info.max_num_seqs
        self.scheduling_policy = info.scheduling_policy
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.model_dir)
        self._worker_tokenizer: Any = AutoTokenizer.from_pretrained(self.model_dir)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="octavo-tokenize")
        longest = max((len(s) for s in self._token_texts()), default=1)
        self.max_prompt_chars = self.max_model_len * max(longest, 1)
        self.metrics = ServerMetrics(self.model_name, engine.stats,
                                     max_model_len=self.max_model_len,
                                     cache_config=dict(info.cache_config))
        engine.observer = self.metrics
        self._token_strs: dict[int, str] = {}

    def _token_texts(self) -> list[str]:
        tok = self.tokenizer
        return [tok.convert_tokens_to_string([t]) for t in tok.get_vocab()]

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    # ---- checks shared by the generating endpoints ---------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.served_model_names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model")

    def check_capacity(self) -> None:
        limit = self.config.max_waiting_requests
        if self.engine.dead is not None:
            raise OpenAIError(503, f"the engine is dead: {self.engine.dead}")
        if not self.engine.accepting:
            raise OpenAIError(503, "the server is shutting down")
        if limit is not None and self.engine.num_waiting >= limit:
            raise OpenAIError(
                503, f"the server is overloaded: {self.engine.num_waiting} requests are waiting "
                f"(limit {limit}); retry later",
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {self.vocab_size})", param)

    # ---- tokens (off the event loop) -----------------------------------------------------
    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise bad_request(  # worded as vLLM's context-length error (serving_common.py)
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"the prompt has {num_chars} characters, more than {self.max_model_len} tokens "
                f"of this vocabulary can hold (at most {self.max_prompt_chars} characters). "
                "Please reduce the length of the messages.", param,
            )

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True,
                     param: str = "prompt") -> list[int]:
        self.check_prompt_chars(len(text), param)
        ids = await self._off_loop(
            lambda: self._worker_tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(ids)

    def token_str(self, token_id: int) -> str:
        """The text of one token as logprobs show it (cached: the same ids recur)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            self._token_strs[token_id] = s
        return s

    async def decode(self, token_ids: list[int]) -> str:
        return await self._off_loop(self._worker_tokenizer.decode, token_ids)

    @property
    def chat_template(self) -> str | None:
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default") or next(iter(template.values()), None)
        return template

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, *, tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        if not self._worker_tokenizer.chat_template:
            raise bad_request("the model's tokenizer has no chat template", "messages")
        self.check_prompt_chars(sum(_text_length(m) for m in messages) + _text_length(tools),
                                "messages")
        extra = dict(template_kwargs or {})
        for reserved in ("messages", "tools", "tokenize", "add_generation_prompt",
                         "continue_final_message", "return_dict"):
            if reserved in extra:
                raise bad_request(f"chat_template_kwargs may not set {reserved!r}",
                                  "chat_template_kwargs")

        def render() -> list[int]:
            return list(self._worker_tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt and not
                continue_final_message, continue_final_message=continue_final_message,
                tokenize=True, return_dict=False, **extra,
            ))

        try:
            return await self._off_loop(render)
        except Exception as e:  # jinja errors, a template's own raise_exception(...)
            raise bad_request(f"could not apply the chat template: {e}", "messages") from e


def _text_length(value: Any) -> int:
    """Characters of text anywhere in a message (content, content parts, names, ...)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_length(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_text_length(v) for v in value)
    return 0
