"""The request and response pieces of structured outputs and tool calling (OpenAI's shapes,
plus vLLM's `structured_outputs` field and its older `guided_*` fields).

Shapes only: what a constraint or a tool means is decided in server/chat/structured.py and
server/chat/tools.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from octavo.server.protocol_base import OpenAIBaseModel, RequestModel

FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")]


# ---- structured outputs ---------------------------------------------------------------------
class JsonSchemaFormat(RequestModel):
    name: str = "response"
    description: str | None = None
    # "schema" in OpenAI's JSON; pydantic's BaseModel has a schema() method
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False,
                              populate_by_name=True)


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class StructuredOutputsField(RequestModel):
    """vLLM's `structured_outputs` request field (StructuredOutputsParams' names)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False,
                              populate_by_name=True)


class GuidedFields(RequestModel):
    """vLLM's older spelling of structured outputs (guided_json, ...), still sent by clients."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputsField | None = None


# ---- tools ----------------------------------------------------------------------------------
class FunctionDefinition(RequestModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: FunctionName


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(RequestModel):
    name: FunctionName
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallIn(RequestModel):
    """A tool call of an earlier assistant message, as the client sends it back."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


# ---- responses ------------------------------------------------------------------------------
class FunctionCallOut(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCallOut(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class _OmitUnset(OpenAIBaseModel):
    """A streamed delta: fields it does not carry are left out, not sent as null. OpenAI and
    vLLM send them so, and the openai SDK's stream helpers merge deltas key by key: a
    `"type": null` on a continuation chunk replaces the call's "function" and fails them."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitUnset):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitUnset):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
