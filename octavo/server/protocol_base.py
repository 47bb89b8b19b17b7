"""The base models of every request and response of the HTTP API.

`RequestModel` is what clients send: strict types as OpenAI's spec types them, finite numbers,
and encodable text (see protocol.py for the rules); `OpenAIBaseModel` what the server sends.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Unencodable(ValueError):
    pass


def _normalised(value: Any, path: str) -> Any:
    """A JSON body as the strict models read it: every string checked to be valid Unicode (a
    lone surrogate is an error naming where it is), and every number with no fractional part
    an integer, as JSON Schema counts them (2.0 is the integer 2; 2.5 and "2" are not)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _Unencodable(f"{path or 'body'}: text is not valid Unicode (a lone "
                               f"surrogate at character {e.start})") from None
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            _normalised(key, path)
            out[key] = _normalised(item, f"{path}.{key}" if path else str(key))
        return out
    if isinstance(value, list):
        return [_normalised(item, f"{path}.{i}" if path else str(i))
                for i, item in enumerate(value)]
    return value


class RequestModel(OpenAIBaseModel):
    """What clients send: strict types, finite numbers, encodable text."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _json_values(cls, data: Any) -> Any:
        # before the fields: a lone surrogate gets this message wherever it sits
        return _normalised(data, "")
