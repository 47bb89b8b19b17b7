"""Request fields -> the engine's StructuredOutputsParams.

Three spellings reach the same constraint: OpenAI's `response_format` (json_object,
json_schema), vLLM's `structured_outputs` object, and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (with `guided_whitespace_pattern`). A request
may use one of them; a constraint the grammar compiler rejects is a 400 naming the problem.
"""

from __future__ import annotations

from typing import Any

from octavo.sampling_params import StructuredOutputsParams
from octavo.server.errors import bad_request
from octavo.server.protocol_agent import GuidedFields, ResponseFormat


def structured_outputs_of(body: GuidedFields, response_format: ResponseFormat | None
                          ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (errors name that field)."""
    given: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        else:
            assert response_format.json_schema is not None  # the model checks it
            given.append(("response_format", {"json": response_format.json_schema.json_schema}))
    if body.structured_outputs is not None:
        fields = body.structured_outputs.model_dump(exclude_none=True)
        if "json_" in fields:
            fields["json"] = fields.pop("json_")
        given.append(("structured_outputs", fields))
    guided = {name: getattr(body, f"guided_{name}") for name in ("json", "regex", "choice",
                                                                 "grammar")}
    guided = {k: v for k, v in guided.items() if v is not None}
    if guided:
        if body.guided_whitespace_pattern is not None:
            guided["whitespace_pattern"] = body.guided_whitespace_pattern
        given.append(("guided_" + next(iter(guided)), guided))
    if not given:
        return None, None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"give one structured-output constraint, not several ({names})",
                          given[1][0])
    param, fields = given[0]
    try:
        return StructuredOutputsParams(**fields), param
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param) from e
