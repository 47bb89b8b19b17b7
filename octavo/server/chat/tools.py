"""Tool calling on chat completions: checking a request's tools and messages, what the model is
told, the constraint that enforces `required` and named choices, and reading calls back.

tool_choice, as OpenAI and vLLM define it:
- "none": the model answers in text (tools still reach the template, as in vLLM);
- "auto" (the default when tools are given): the model decides; its calls are read from its
  text by the server's --tool-call-parser, which --enable-auto-tool-choice must allow;
- "required": the output is constrained to a JSON array of calls `[{"name": ..., "parameters":
  {...}}]` (one call when parallel_tool_calls is false), each matching its tool's schema;
- a named function: the output is constrained to that function's arguments object.
Forced calls always parse and validate; their finish_reason is "tool_calls" ("stop" for a
named function, as OpenAI answers).

A chat template that does not render `tools` (the embedded SmolLM2's does not) gets them in
the system message instead, written the way the tool-call parser reads them back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from octavo.sampling_params import StructuredOutputsParams
from octavo.server.chat.tool_parsers import ToolParser, get_tool_parser
from octavo.server.chat.tool_parsers.base import ToolCall
from octavo.server.errors import bad_request
from octavo.server.protocol import ChatCompletionRequest, ChatMessage
from octavo.server.protocol_agent import NamedToolChoice

ToolMode = Literal["none", "auto", "required", "named"]
# a tool without `parameters` takes none (OpenAI's reading): its arguments are {}
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                    "additionalProperties": False}


@dataclass
class ToolPlan:
    mode: ToolMode
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool dicts
    function: str | None = None  # the named function
    parser: ToolParser | None = None  # for "auto"
    constraint: StructuredOutputsParams | None = None  # for "required" and named

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def plan_tools(body: ChatCompletionRequest, *, auto_enabled: bool,
               parser_name: str | None) -> ToolPlan:
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and not tools and choice != "none":
        raise bad_request("tool_choice needs tools", "tool_choice")
    if not tools:
        return ToolPlan("none")
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad_request(f"two tools are named {dup!r}", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among "
                              f"the tools ({', '.join(names)})", "tool_choice")
        params = _parameters(tools[names.index(name)])
        return ToolPlan("named", tools, function=name,
                        constraint=StructuredOutputsParams(json=params))
    if choice == "required":
        return ToolPlan("required", tools,
                        constraint=StructuredOutputsParams(json=required_schema(
                            tools, body.parallel_tool_calls)))
    if choice == "auto":
        if not (auto_enabled and parser_name):
            raise bad_request('"auto" tool choice needs the server to run with '
                              "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
        return ToolPlan("auto", tools, parser=get_tool_parser(parser_name, tools))
    return ToolPlan("none", tools,
                    parser=get_tool_parser(parser_name, tools) if parser_name else None)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each {"name": one tool, "parameters": its arguments}."""
    calls = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                       "parameters": _parameters(t)},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- messages -------------------------------------------------------------------------------
def check_tool_messages(messages: list[ChatMessage]) -> None:
    """Every tool message answers a call an earlier assistant message made, and every call's
    arguments are a JSON object (OpenAI's rules)."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.tool_calls or []:
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError as e:
                raise bad_request(f"messages[{i}]: the arguments of tool call {call.id!r} are "
                                  f"not valid JSON: {e}", f"messages.{i}.tool_calls") from None
            if not isinstance(args, dict):
                raise bad_request(f"messages[{i}]: the arguments of tool call {call.id!r} must "
                                  "be a JSON object", f"messages.{i}.tool_calls")
            calls.add(call.id)
        if m.role == "tool" and m.tool_call_id not in calls:
            raise bad_request(f"messages[{i}]: a tool message must answer a tool call of an "
                              f"earlier assistant message; no call has id {m.tool_call_id!r}",
                              f"messages.{i}.tool_call_id")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: tool-call arguments as dicts (Llama 3's and
    Mistral's templates iterate over them), no None fields."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"],
                                   "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def with_tool_prompt(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The tools described in the system message, for a template that does not render them."""
    text = tool_prompt(plan)
    if not text:
        return messages
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def tool_prompt(plan: ToolPlan) -> str:
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["function"]["name"] == plan.function)
        return (f"Call the function {plan.function}. Reply with its arguments only, as one "
                f"JSON object matching this schema:\n{json.dumps(_parameters(tool))}\n"
                f"Function: {json.dumps(tool['function'])}")
    if plan.mode == "required":
        return ("You must call one or more of these functions. Reply only with a JSON list of "
                'calls, each {"name": <function name>, "parameters": <arguments object>}.\n'
                "Functions:\n" + "\n".join(json.dumps(t["function"]) for t in plan.tools))
    if plan.parser is not None:
        return plan.parser.system_prompt(plan.tools)
    return ""


# ---- output ---------------------------------------------------------------------------------
def forced_calls(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The calls of a constrained (required / named) output; the grammar made it valid JSON,
    but a length-cut output is not, and gives no call."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if plan.mode == "named":
        assert plan.function is not None
        return [ToolCall(name=plan.function, arguments=text.strip())] if isinstance(
            value, dict) else []
    return [ToolCall(name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False))
            for c in value if isinstance(c, dict)] if isinstance(value, list) else []
