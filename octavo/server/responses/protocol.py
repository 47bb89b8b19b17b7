"""OpenAI's Responses API (`POST /v1/responses`) as pydantic models: the request, the response
object and its output items.

Only what octavo can serve is typed: text messages, function tools and their calls, structured
outputs through `text.format`. Other input items, content parts, tool types and tool choices
(images, files, web search, ...) are refused with a 400 that names them, before the unions
are tried, so the message says what is unsupported instead of listing every union member. The
streaming events are plain dicts (serving_responses.py); their shapes are OpenAI's.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from octavo.server.protocol import MaxTokens
from octavo.server.protocol_agent import FunctionName
from octavo.server.protocol_base import OpenAIBaseModel, RequestModel

TEXT_PARTS = ("input_text", "output_text")
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]


# ---- input items ----------------------------------------------------------------------------
class TextPart(RequestModel):
    """A text content part: input_text (user, system, developer) or output_text (an
    assistant's earlier output, sent back)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(RequestModel):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(RequestModel):
    """A function call the model made earlier (an output item, sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: FunctionName
    arguments: str  # a JSON object, as text
    id: str | None = None


class FunctionCallOutputItem(RequestModel):
    """The result of a function call, for the model to go on with."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None


class ReasoningItem(RequestModel):
    """An earlier reasoning output item, sent back; it does not reach the model (chat
    templates drop earlier reasoning too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None


def _item_tag(item: Any) -> str:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return {"function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
            "reasoning": "Reasoning"}.get(kind, "Message") if isinstance(kind, str) else "Message"


# Capitalised tags: errors.py leaves them out of the parameter path it reports.
InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | Annotated[ReasoningItem, Tag("Reasoning")],
    Discriminator(_item_tag),
]


def _check_item(i: int, item: Any) -> None:
    """A 400 naming what octavo does not serve: an item type, or a content part type."""
    if not isinstance(item, dict):
        return
    kind = item.get("type")
    if isinstance(kind, str) and kind not in INPUT_ITEM_TYPES:
        raise ValueError(f"item {i} has type {kind!r}, which is not supported: octavo takes "
                         f"{', '.join(INPUT_ITEM_TYPES)} items")
    if kind in (None, "message"):
        parts = item.get("content")
    elif kind == "function_call_output":
        parts = item.get("output")
    else:
        return
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        part_kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part_kind, str) and part_kind not in TEXT_PARTS:
            raise ValueError(f"item {i}: content part {j} has type {part_kind!r}, which is not "
                             f"supported: octavo serves text only ({', '.join(TEXT_PARTS)})")


# ---- tools and text format ------------------------------------------------------------------
class FunctionTool(RequestModel):
    """A function the model may call (flat, unlike chat's {"type", "function": {...}})."""

    type: Literal["function"] = "function"
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: FunctionName


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # BaseModel has schema()
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False,
                              populate_by_name=True)

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("text.format: a format of type json_schema needs a schema")
        return self


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# ---- the request ----------------------------------------------------------------------------
class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    metadata: Metadata | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted, not used
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None  # accepted, not used
    background: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, items: Any) -> Any:
        if isinstance(items, list):
            for i, item in enumerate(items):
                _check_item(i, item)
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        """Function tools, those of a `namespace` (a named group of functions) among them;
        OpenAI's hosted tools (web_search, file_search, mcp, custom, ...) are left out: the
        model is not told of them. Agent clients (Codex) send them with their functions."""
        if not isinstance(tools, list):
            return tools
        out = []
        for tool in tools:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind == "namespace" and isinstance(tool.get("tools"), list):
                out += [t for t in tool["tools"] if isinstance(t, dict)
                        and t.get("type", "function") == "function"]
            elif kind in (None, "function") or not isinstance(kind, str):
                out.append(tool)
        return out

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"a tool_choice of type {kind!r} is not supported: give none, "
                             'auto, required or {"type": "function", "name": ...}')
        return choice


# ---- the response object --------------------------------------------------------------------
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionToolCall(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(OpenAIBaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionToolCall | ReasoningOutput,
                       Field(discriminator="type")]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # the SDK's type requires it


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    background: bool = False


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
