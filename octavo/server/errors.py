"""Every error leaves the server in OpenAI's shape: {"error": {message, type, param, code}}.

OpenAI's clients (and vLLM's benchmark) read `error.message`; FastAPI's defaults would answer a
malformed body with a 422 and a different shape, and an unexpected exception with a bare 500.
So validation errors, invalid JSON and HTTP errors are all mapped here, and the catch-all keeps
tracebacks in the log, never in the response.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from octavo.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# vLLM's error type names, by status
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "PayloadTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """Raise anywhere in a handler to answer with `status` in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status,
                        headers=headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _is_type_tag(part: object) -> bool:
    """pydantic names the member of a union it tried (`prompt.list[int].0`,
    `stop.constrained-str`): not a field."""
    return isinstance(part, str) and (
        "[" in part or "-" in part or part in _TYPE_TAGS or part[:1].isupper())


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    parts, first_param = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_type_tag(x)]
        param = ".".join(loc) or None
        msg = str(err.get("msg"))
        if err.get("type") == "json_invalid":
            parts.append(f"invalid JSON: {err.get('ctx', {}).get('error', msg)}")
        elif param is None and msg.startswith("Value error, "):
            # a whole-request check (protocol.RequestModel) names the field itself
            msg = msg.removeprefix("Value error, ")
            param = msg.split(":", 1)[0] if ":" in msg else None
            parts.append(msg)
        else:
            parts.append(f"{param or 'body'}: {msg.removeprefix('Value error, ')}")
        first_param = first_param or param
    return "; ".join(parts), first_param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # keeps Starlette's headers: `Allow` on a 405 (RFC 9110)
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal server error ({type(exc).__name__})")
