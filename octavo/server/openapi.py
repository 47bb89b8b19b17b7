"""The OpenAPI document, made to say what the server really answers.

FastAPI's default promises 422 for validation errors (octavo answers 400, in OpenAI's error
shape, see errors.py) and knows nothing of the errors the handlers and middlewares raise. This
adds, per operation, the error statuses it can return with the ErrorResponse schema: 400 and
413 for bodies, 401 when an API key is set, 404 for an unknown model, 500 for a failed model
step and 503 while overloaded or shutting down. Bounds that depend on the served model (token
ids below its vocabulary size, max_tokens below max_model_len) are written into the schemas.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from octavo.server.protocol import ErrorResponse

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
DESCRIPTIONS = {
    400: "invalid request: a wrong type, a value out of range, or a prompt that does not fit",
    401: "missing or invalid API key",
    404: "the model named in the request is not served here",
    413: "request body larger than --max-request-body-bytes",
    500: "the model step failed",
    503: "overloaded (too many requests waiting or in flight) or shutting down",
}
# operations that take a `model` field, and those that run the engine
NAMES_A_MODEL = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
GENERATES = {"/v1/completions", "/v1/chat/completions"}


def error_statuses(path: str, method: str, api_key: bool, open_paths: set[str],
                   has_query: bool = False) -> list[int]:
    statuses = []
    if method == "post":
        statuses += [400, 413]
    if has_query:  # a query parameter out of its range or choices
        statuses.append(400)
    if api_key and path not in open_paths:
        statuses.append(401)
    if path in NAMES_A_MODEL:
        statuses.append(404)
    if path in GENERATES:
        statuses.append(500)
    statuses.append(503)  # any request, past --limit-concurrency in flight
    return sorted(set(statuses))


def write_bounds(node: Any, bounds: dict[str, int]) -> None:
    """Replace each `x-octavo-bound` marker with the served model's maximum."""
    if isinstance(node, dict):
        name = node.pop("x-octavo-bound", None)
        if name is not None:
            node["maximum"] = bounds[name]
        for value in node.values():
            write_bounds(value, bounds)
    elif isinstance(node, list):
        for value in node:
            write_bounds(value, bounds)


def install_openapi(app: FastAPI, *, api_key: bool, open_paths: set[str], vocab_size: int,
                    max_model_len: int) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(error.pop("$defs", {}))
        components["ErrorResponse"] = error
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for path, operations in schema.get("paths", {}).items():
            for method, op in operations.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                has_query = any(p.get("in") == "query" for p in op.get("parameters", []))
                for status in error_statuses(path, method, api_key, open_paths, has_query):
                    responses[str(status)] = {
                        "description": DESCRIPTIONS[status],
                        "content": {"application/json": {"schema": ERROR_REF}},
                    }
        write_bounds(schema, {"token-id": vocab_size - 1, "max-tokens": max_model_len - 1})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
