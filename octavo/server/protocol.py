"""OpenAI's HTTP protocol (plus vLLM's extensions) as pydantic models.

Requests are validated strictly for *types* here, as OpenAI's spec types them (a wrong type
becomes a 400 through errors.py): booleans are JSON booleans, integers (token ids, n, seeds)
JSON integers, numbers finite (no Infinity, 1e999 or NaN), roles one of the known ones, and
every string valid Unicode (no lone surrogate, which no tokenizer can encode). *Values*
(temperature range, n >= 1, ...) are left to SamplingParams so the server and the offline API
reject exactly the same things with the same messages. Unknown fields are ignored, as
OpenAI-compatible servers do, so newer clients keep working.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from octavo.server.args import MAX_LOGPROBS  # vLLM's default max_logprobs
from octavo.server.protocol_agent import (
    ChatTool,
    DeltaToolCall,
    GuidedFields,
    ResponseFormat,
    ToolCallIn,
    ToolCallOut,
    ToolChoice,
)
from octavo.server.protocol_base import OpenAIBaseModel, RequestModel

# Bounds a schema can state; what depends on the model (token ids < vocab size, prompt plus
# max_tokens within max_model_len) is checked by the handlers.
# "x-octavo-bound" names a bound the served model sets; server/openapi.py writes it in
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-octavo-bound": "token-id"})]
MaxTokens = Annotated[int, Field(ge=1, json_schema_extra={"x-octavo-bound": "max-tokens"})]
TokenIdString = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]  # logit_bias keys
StopString = Annotated[str, Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


# ---- errors --------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared pieces -------------------------------------------------------------------------
class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class SamplingFields(RequestModel):
    """Sampling fields common to completions and chat (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    logit_bias: dict[TokenIdString, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # vLLM
    bad_words: list[NonEmptyText] | None = None  # vLLM
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # vLLM: tokens of reasoning before the end-of-thinking marker is forced (--reasoning-budget)
    thinking_token_budget: int | None = Field(None, ge=0)
    # vLLM: requests with different salts never share prefix-cache blocks (it joins the hash
    # of every block), so one tenant cannot time another's prompts
    cache_salt: NonEmptyText | None = None


# ---- /v1/completions -----------------------------------------------------------------------
class CompletionRequest(SamplingFields, GuidedFields):
    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1)])
    max_tokens: MaxTokens | None = 16
    echo: bool = False
    logprobs: TopLogprobs | None = None
    suffix: str | None = None
    prompt_logprobs: TopLogprobs | None = None  # vLLM extension
    response_format: ResponseFormat | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        """One clear message for a prompt of the wrong shape (the union's would list every
        member)."""
        shapes = "a string, a list of strings, a list of token ids or a list of such lists"
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: at least one token is needed")
            return prompt
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"must be {shapes}" + ("; this list is empty" if prompt == []
                                                    else ""))
        kinds = {_prompt_kind(p) for p in prompt}
        if len(kinds) != 1 or None in kinds:
            raise ValueError(f"must be {shapes}, not a mix")
        for i, p in enumerate(prompt):
            if kinds != {"id"} and not p:
                raise ValueError(f"prompt {i} is empty: at least one token is needed")
        return prompt


def _prompt_kind(p: Any) -> str | None:
    if isinstance(p, str):
        return "text"
    if isinstance(p, int) and not isinstance(p, bool):
        return "id"
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return "ids"
    return None


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ------------------------------------------------------------------
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class TextContentPart(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    # name and other fields reach the template; the request checks the text (RequestModel)
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: Role
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs tool_call_id (the id of the "
                             "call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not '{self.role}'")
        return self


class ChatCompletionRequest(SamplingFields, GuidedFields):
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension (e.g. enable_thinking)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True  # vLLM extension
    continue_final_message: bool = False  # vLLM extension


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/models, /tokenize, /detokenize ----------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "octavo"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(RequestModel):
    """vLLM's /tokenize of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestModel):
    """vLLM's /tokenize of chat messages (through the chat template)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
