"""Rendering a chat template within a time budget, and what a request may pass to it.

HF renders chat templates in jinja2's ImmutableSandboxedEnvironment (no attribute access to
Python internals, `range` capped at 100,000 items), but nothing bounds the time: nested loops
render for seconds or for ever, on the one thread that tokenizes for the whole server. Jinja
compiles a template to Python code (its frames' file name is "<template>"), so a trace function
that follows only those frames sees every line a template runs, loops included, and raises
TemplateTimeout once the budget is spent; the render unwinds and the thread is free again. No
other frame is traced, so the model's own templates pay a clock read per template line.

A request's own chat template (`chat_template`, or the same key in `chat_template_kwargs`) is
refused unless the operator trusts requests with it (--trust-request-chat-template, vLLM's
name): a template decides the whole prompt. The keyword arguments of apply_chat_template
itself (messages, tokenize, ...) may not be set through `chat_template_kwargs` at all.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from octavo.server.errors import bad_request

TEMPLATE_FILENAME = "<template>"  # what jinja2 names the code it compiles from a string
TEMPLATE_PARAM = "chat_template"
# set by the server itself, whatever apply_chat_template's signature says
ALWAYS_RESERVED = frozenset({"messages", "conversation", "tools", "tokenize",
                             "add_generation_prompt", "continue_final_message", "return_dict",
                             "documents"})


class TemplateTimeout(Exception):
    """A chat-template render ran past its time budget."""


@contextmanager
def render_deadline(seconds: float) -> Iterator[None]:
    """Within the block, template code running on this thread raises TemplateTimeout once
    `seconds` have passed (the thread's earlier trace function is put back after)."""
    deadline = time.monotonic() + seconds

    def line(frame: FrameType, event: str, arg: Any) -> Callable | None:
        if event == "line" and time.monotonic() > deadline:
            raise TemplateTimeout(f"the chat template ran longer than {seconds:g} s")
        return line

    def call(frame: FrameType, event: str, arg: Any) -> Callable | None:
        return line if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield
    finally:
        sys.settrace(previous)


def reserved_kwargs(tokenizer: Any) -> frozenset[str]:
    """What `chat_template_kwargs` may not set: apply_chat_template's own parameters."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    return ALWAYS_RESERVED | {name for name, p in params.items()
                              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def split_template_kwargs(template_kwargs: dict[str, Any] | None, chat_template: str | None,
                          reserved: frozenset[str], trusted: bool
                          ) -> tuple[str | None, dict[str, Any]]:
    """(the request's own template or None, the rest of its template kwargs); 400 for a
    reserved key, or for a template the operator does not trust requests with."""
    extra = dict(template_kwargs or {})
    from_kwargs = extra.pop(TEMPLATE_PARAM, None)
    for key in extra:
        if key in reserved:
            raise bad_request(f"chat_template_kwargs may not set {key!r}",
                              "chat_template_kwargs")
    if from_kwargs is not None and chat_template is not None:
        raise bad_request("give chat_template once, not also in chat_template_kwargs",
                          "chat_template")
    template = chat_template if chat_template is not None else from_kwargs
    if template is None:
        return None, extra
    param = TEMPLATE_PARAM if chat_template is not None else "chat_template_kwargs"
    if not trusted:
        raise bad_request("this server does not take chat templates from requests (its "
                          "operator may allow them with --trust-request-chat-template)", param)
    if not isinstance(template, str) or not template.strip():
        raise bad_request("chat_template must be a non-empty string", param)
    return template, extra
