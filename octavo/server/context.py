"""What every endpoint shares: the async engine, the server's settings, the tokenizer.

Work that grows with the input never runs on the event loop, nor on the engine thread:
tokenizing a prompt, rendering a chat template and preparing a request's costly fields
(bad_words as token ids, a structured-output constraint's matcher: engine/input_processor.py's
`Prepared`) go to one worker thread (HF's Rust tokenizer and llguidance release the GIL while
they work), within the bounds of tokenizing.py and request_budget.py. The worker, the loop (it
only decodes single tokens for logprobs) and the engine thread share the engine's tokenizer: HF
fast tokenizers raise "Already borrowed" only when a call reconfigures one (truncation,
padding) while another uses it, and nothing here sets either, so encode, decode and templates
run side by side (tests/server/test_shared_tokenizer.py). A copy each would hold a large
vocabulary's tokenizer (Gemma 3's: 275 MB) three times.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from transformers import AutoTokenizer

from octavo.engine.async_engine import AsyncLLMEngine
from octavo.engine.input_processor import Prepared
from octavo.sampling_params import SamplingParams
from octavo.server.args import ServerConfig
from octavo.server.errors import OpenAIError, bad_request
from octavo.server.metrics import ServerMetrics
from octavo.server.request_budget import check_fields, prepare_fields
from octavo.server.tokenizing import BoundedTokenizer

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
        # the engine's (module doc)
        self.tokenizer: Any = info.tokenizer or AutoTokenizer.from_pretrained(self.model_dir)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="octavo-tokenize")
        self.bounded = BoundedTokenizer(
            self.tokenizer, self.max_model_len,
            chat_template_timeout=config.chat_template_timeout,
            trust_request_chat_template=config.trust_request_chat_template)
        self.max_prompt_chars = self.bounded.max_prompt_chars
        self.metrics = ServerMetrics(self.model_name, engine.stats,
                                     max_model_len=self.max_model_len,
                                     cache_config=dict(info.cache_config))
        engine.observer = self.metrics
        self._token_strs: dict[int, str] = {}

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
        self.bounded.check_chars(num_chars, param)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True,
                     param: str = "prompt") -> list[int]:
        self.check_prompt_chars(len(text), param)  # before queueing for the worker
        return await self._off_loop(self.bounded.encode, text, add_special_tokens, param)

    async def prepare(self, params: SamplingParams, constraint_param: str) -> Prepared:
        """The request's costly fields made ready for the engine, on the worker thread (400
        past the request's budget or for a constraint that does not compile; such errors name
        `constraint_param`)."""
        structured = self.engine.structured
        if not params.bad_words and params.structured_outputs is None:  # nothing costly
            check_fields(params, structured.vocab_size, constraint_param)
            return Prepared()
        return await self._off_loop(prepare_fields, params, self.tokenizer, structured,
                                    constraint_param)

    def token_str(self, token_id: int) -> str:
        """The text of one token as logprobs show it (cached: the same ids recur)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            self._token_strs[token_id] = s
        return s

    async def decode(self, token_ids: list[int]) -> str:
        return await self._off_loop(self.tokenizer.decode, token_ids)

    @property
    def chat_template(self) -> str | None:
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default") or next(iter(template.values()), None)
        return template

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, *, tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
    ) -> list[int]:
        return await self._off_loop(lambda: self.bounded.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            template_kwargs=template_kwargs, chat_template=chat_template))
