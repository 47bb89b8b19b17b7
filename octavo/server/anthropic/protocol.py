"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as pydantic models.

Requests follow protocol.py's rules (strict types, finite numbers, valid Unicode, unknown fields
ignored) so the same body mistakes get the same answers; server/anthropic/serving.py translates
them into chat completions. Content a text model cannot take (images, documents) is accepted
here and refused there with a message saying so, rather than as an unknown block type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from octavo.server.protocol import MaxTokens, StopString
from octavo.server.protocol_agent import FunctionName
from octavo.server.protocol_base import OpenAIBaseModel, RequestModel

BlockId = Annotated[str, Field(min_length=1)]


# ---- request content blocks -----------------------------------------------------------------
class TextBlockParam(RequestModel):
    type: Literal["text"]
    text: str


class MediaBlockParam(RequestModel):
    """An image or a document: valid Anthropic, refused by a text-only model."""

    type: Literal["image", "document"]
    source: dict[str, Any]


class ToolUseBlockParam(RequestModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    type: Literal["tool_use"]
    id: BlockId
    name: FunctionName
    input: dict[str, Any]


class ToolResultBlockParam(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: BlockId
    content: str | list[Annotated[TextBlockParam | MediaBlockParam,
                                  Field(discriminator="type")]] | None = None
    is_error: bool = False


class ThinkingBlockParam(RequestModel):
    """An earlier turn's reasoning; sent back by clients, left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ContentBlockParam = Annotated[
    TextBlockParam | MediaBlockParam | ToolUseBlockParam | ToolResultBlockParam
    | ThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(RequestModel):
    # "system" is not Anthropic's, but Claude Code sends system messages inside `messages`
    # (as vLLM and SGLang accept them): they join the system prompt
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]


# ---- tools ----------------------------------------------------------------------------------
class ToolParam(RequestModel):
    """A client tool (Anthropic's server tools, which have no input_schema, are not served)."""

    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoiceParam = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                            Field(discriminator="type")]


class ThinkingParam(RequestModel):
    """A model's reasoning (--reasoning-parser) is always shown; `budget_tokens` of an enabled
    one is the request's reasoning budget (thinking_token_budget)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


# ---- requests -------------------------------------------------------------------------------
class CountTokensRequest(RequestModel):
    """What the prompt is made of: /v1/messages/count_tokens takes exactly this."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: MaxTokens
    stop_sequences: list[StopString] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None  # accepted, not used


# ---- responses ------------------------------------------------------------------------------
class TextBlock(OpenAIBaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(OpenAIBaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # no signature: nothing here verifies reasoning sent back


class ToolUseBlock(OpenAIBaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(OpenAIBaseModel):
    input_tokens: int


class AnthropicErrorInfo(OpenAIBaseModel):
    type: str  # invalid_request_error, not_found_error, overloaded_error, api_error, ...
    message: str


class AnthropicErrorResponse(OpenAIBaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
