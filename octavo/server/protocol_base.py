"""The base models of every request and response of the HTTP API.

`RequestModel` is what clients send: strict types as OpenAI's spec types them, finite numbers,
and encodable text (see protocol.py for the rules); `OpenAIBaseModel` what the server sends.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from pydantic import BaseModel, ConfigDict, ModelWrapValidatorHandler, model_validator

# set while a request body is validated: its strings and numbers were walked already
_WALKED: ContextVar[bool] = ContextVar("walked", default=False)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Unencodable(ValueError):
    pass


def _normalised(value: Any, path: str) -> Any:
    """A JSON body as the strict models read it: every string checked to be valid Unicode (a
    lone surrogate is an error naming where it is), and every number with no fractional part
    an integer, as JSON Schema counts them (2.0 is the integer 2; 2.5 and "2" are not).

    Walked without naming places (a body may hold 10^5 items, and this runs on the event
    loop); only when a string fails is the walk repeated to say where."""
    try:
        return _walk(value)
    except UnicodeEncodeError:
        _find_unencodable(value, path)
        raise


def _walk(value: Any) -> Any:
    kind = type(value)
    if kind is str:
        if not value.isascii():
            value.encode("utf-8")
        return value
    if kind is float:
        return int(value) if value.is_integer() else value
    if kind is list:
        if all(type(item) is str for item in value):  # texts: checked all at once
            "".join(value).encode("utf-8")
            return value
        if all(type(item) is int for item in value):  # token ids
            return value
        return [_walk(item) for item in value]
    if kind is dict:
        "".join(value).encode("utf-8")  # the keys
        return {key: _walk(item) for key, item in value.items()}
    return value


def _find_unencodable(value: Any, path: str) -> None:
    """Raise _Unencodable naming the first string in `value` with a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _Unencodable(f"{path or 'body'}: text is not valid Unicode (a lone "
                               f"surrogate at character {e.start})") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _find_unencodable(key, path)
            _find_unencodable(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _find_unencodable(item, f"{path}.{i}" if path else str(i))


class RequestModel(OpenAIBaseModel):
    """What clients send: strict types, finite numbers, encodable text."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="wrap")
    @classmethod
    def _json_values(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        # before the fields: a lone surrogate gets this message wherever it sits; once per
        # body (the models inside it see the outer one's result)
        if _WALKED.get():
            return handler(data)
        token = _WALKED.set(True)
        try:
            return handler(_normalised(data, ""))
        finally:
            _WALKED.reset(token)
