"""What every endpoint shares: the async engine, the server's settings, a tokenizer copy.

The server keeps its OWN tokenizer instance, used only on the event loop: the engine thread
uses the engine's, and HF fast tokenizers raise "Already borrowed" when one instance is used
from two threads. Tokenizing on the loop also keeps that CPU work off the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import AutoTokenizer

from octavo.engine.async_engine import AsyncLLMEngine
from octavo.server.args import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS
from octavo.server.errors import OpenAIError, bad_request
from octavo.server.metrics import ServerMetrics

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass(slots=True)
class ServerConfig:
    """Settings of the HTTP layer (the engine's are in EngineConfig)."""

    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_logprobs: int = MAX_LOGPROBS

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )


class ServerContext:
    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        llm = engine.engine
        self.engine = engine
        self.config = config
        self.model_dir = str(llm.model_dir)
        if not config.served_model_names:
            config.served_model_names = [llm.model_dir.name]
        self.model_name = config.served_model_names[0]
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.model_config.vocab_size
        self.max_num_seqs = llm.args.max_num_seqs
        self.scheduling_policy = llm.args.scheduling_policy
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.model_dir)
        self.metrics = ServerMetrics(self.model_name, engine.stats)
        engine.observer = self.metrics
        self._token_strs: dict[int, str] = {}

    # ---- checks shared by the generating endpoints ---------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.served_model_names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model")

    def check_capacity(self) -> None:
        limit = self.config.max_waiting_requests
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

    # ---- tokens --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_str(self, token_id: int) -> str:
        """The text of one token as logprobs show it (cached: the same ids recur)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            self._token_strs[token_id] = s
        return s

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        if not self.tokenizer.chat_template:
            raise bad_request("the model's tokenizer has no chat template", "messages")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt and not
                continue_final_message, continue_final_message=continue_final_message,
                tokenize=True, return_dict=False,
            )
        except Exception as e:  # jinja errors, a template's own raise_exception(...)
            raise bad_request(f"could not apply the chat template: {e}", "messages") from e
        return list(ids)
