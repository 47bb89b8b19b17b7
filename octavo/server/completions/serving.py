"""POST /v1/completions: one engine request per prompt, `n` choices each.

Choice i of prompt p has index p * n + i (OpenAI's and vLLM's numbering). Usage counts each
prompt once and every generated token of every choice, so `completion_tokens` is exact (vLLM's
serving benchmark relies on it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from octavo.engine.async_engine import RequestStream
from octavo.outputs import CompletionOutput, RequestOutput
from octavo.server.chat.structured import structured_outputs_of
from octavo.server.context import ServerContext
from octavo.server.errors import bad_request
from octavo.server.logprobs import completion_logprobs
from octavo.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from octavo.server.serving_common import (
    ENGINE_ERRORS,
    SSE_DONE,
    SSEResponse,
    StreamUsage,
    cancel_all,
    check_context_length,
    check_max_tokens,
    client_closed,
    collect,
    engine_error,
    merge,
    sse,
    sse_error,
    start_requests,
    to_sampling_params,
    usage,
)


@dataclass(slots=True)
class _Prompt:
    text: str | None  # None for token-id prompts until echo needs it
    token_ids: list[int]


def _num_prompts(prompt: str | list) -> int:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt)


def check_request_size(ctx: ServerContext, prompt: str | list, n: int) -> None:
    """Before any work: how many prompts, and prompts x n, one request may carry."""
    if isinstance(prompt, list) and not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    count, limits = _num_prompts(prompt), ctx.config
    if count > limits.max_prompts_per_request:
        raise bad_request(f"the request has {count} prompts; at most "
                          f"{limits.max_prompts_per_request} are allowed", "prompt")
    if count * n > limits.max_sequences_per_request:
        raise bad_request(f"{count} prompts x n={n} = {count * n} sequences; at most "
                          f"{limits.max_sequences_per_request} are allowed per request", "n")


async def _prompts(ctx: ServerContext, prompt: str | list) -> list[_Prompt]:
    if isinstance(prompt, str):
        return [_Prompt(prompt, await ctx.encode(prompt))]
    if isinstance(prompt[0], str):
        for i, p in enumerate(prompt):  # every bound first, then the work
            ctx.check_prompt_chars(len(p), f"prompt.{i}")
        return [_Prompt(p, await ctx.encode(p, param=f"prompt.{i}"))
                for i, p in enumerate(prompt)]
    if isinstance(prompt[0], int):
        return [_Prompt(None, list(prompt))]
    return [_Prompt(None, list(p)) for p in prompt]


async def create_completion(ctx: ServerContext, body: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(body.model)
    ctx.check_capacity()
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    check_request_size(ctx, body.prompt, body.n)
    check_max_tokens(ctx, max_tokens=body.max_tokens)
    prompts = await _prompts(ctx, body.prompt)
    for p in prompts:
        check_context_length(ctx, len(p.token_ids), body.max_tokens, "prompt")
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo and body.logprobs is not None:
        prompt_logprobs = body.logprobs
    constraint, constraint_param = structured_outputs_of(body, body.response_format)
    params = to_sampling_params(ctx, body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                prompt_logprobs=prompt_logprobs, structured_outputs=constraint)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    engine_prompts = [{"prompt_token_ids": p.token_ids, "prompt": p.text,
                       "cache_salt": body.cache_salt} for p in prompts]
    streams = await start_requests(ctx, request_id, engine_prompts, params, body.priority,
                                   constraint_param or "prompt")
    if body.echo:  # the text of token-id prompts, decoded off the loop
        for p in prompts:
            if p.text is None:
                p.text = await ctx.decode(p.token_ids)
    gen = _Generation(ctx, body, request_id, prompts)
    if body.stream:
        return SSEResponse(gen.stream(streams), on_close=lambda: cancel_all(streams))
    try:
        finals = await collect(raw, streams)
    except ENGINE_ERRORS as e:
        raise engine_error(e) from e
    if finals is None:
        return client_closed()
    return JSONResponse(gen.response(finals).model_dump())


class _Generation:
    """Builds the response (or the SSE chunks) of one completion request."""

    def __init__(self, ctx: ServerContext, body: CompletionRequest, request_id: str,
                 prompts: list[_Prompt]) -> None:
        self.ctx = ctx
        self.body = body
        self.id = request_id
        self.prompts = prompts
        self.created = int(time.time())

    def prompt_text(self, i: int) -> str:
        text = self.prompts[i].text
        assert text is not None, "echo decodes token-id prompts up front"
        return text

    def _logprobs(self, out: RequestOutput, o: CompletionOutput, start: int, offset: int,
                  echo: bool) -> CompletionLogprobs | None:
        """Logprobs of o's tokens from `start` (plus the prompt's when echoing)."""
        if self.body.logprobs is None:
            return None
        ids, positions = list(o.token_ids[start:]), list((o.logprobs or [])[start:])
        if echo:
            prompt_pos = list(out.prompt_logprobs or [])
            prompt_pos += [None] * (len(out.prompt_token_ids) - len(prompt_pos))
            ids, positions = list(out.prompt_token_ids) + ids, prompt_pos + positions
        return completion_logprobs(self.ctx, ids, positions, offset)

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict | None] | None:
        if self.body.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return [
            None if pos is None else {
                t: {"logprob": lp.logprob, "rank": lp.rank,
                    "decoded_token": self.ctx.token_str(t)}
                for t, lp in pos.items()
            }
            for pos in out.prompt_logprobs
        ]

    def response(self, finals: Sequence[RequestOutput]) -> CompletionResponse:
        n, echo = self.body.n, self.body.echo
        choices = []
        for i, out in enumerate(finals):
            prefix = self.prompt_text(i) if echo else ""
            for o in out.outputs:
                choices.append(CompletionChoice(
                    index=i * n + o.index, text=prefix + o.text,
                    logprobs=self._logprobs(out, o, 0, 0, echo),
                    finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                    prompt_logprobs=self._prompt_logprobs(out),
                ))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=self.id, created=self.created, model=self.ctx.model_name,
                                  choices=choices, usage=usage(finals))

    def _chunk(self, choices: list[CompletionChoice], usage_info: UsageInfo | None = None) -> str:
        return sse(CompletionResponse(
            id=self.id, created=self.created, model=self.ctx.model_name, choices=choices,
            usage=usage_info,
        ).model_dump_json())

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """The SSE chunks; the engine sends DELTA outputs (each only what its step added)."""
        opts = self.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        n, echo = self.body.n, self.body.echo
        sent: dict[int, _Sent] = {}
        counts = StreamUsage()
        try:
            async for i, out in merge(streams):
                counts.add(i, out)
                for o in out.outputs:
                    idx = i * n + o.index
                    st = sent.setdefault(idx, _Sent())
                    if st.done:
                        continue
                    first = echo and not st.echoed
                    wants_lp = self.body.logprobs is not None and bool(o.token_ids)
                    if not (o.text or o.finish_reason or first or wants_lp):
                        continue
                    prefix = self.prompt_text(i) if first else ""
                    lp = self._logprobs(out, o, 0, st.offset, first)
                    if lp is not None:
                        st.offset = lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else (
                            st.offset)
                    st.echoed = True
                    st.done = o.finish_reason is not None
                    choice = CompletionChoice(index=idx, text=prefix + o.text, logprobs=lp,
                                              finish_reason=o.finish_reason,
                                              stop_reason=o.stop_reason)
                    yield self._chunk([choice], counts.usage() if continuous else None)
            if include_usage:
                yield self._chunk([], counts.usage())
        except ENGINE_ERRORS as e:
            yield sse_error(e)
        finally:
            cancel_all(streams)
        yield SSE_DONE


@dataclass(slots=True)
class _Sent:
    """What one choice's client has been sent: its echo, the text offset of its logprobs."""

    offset: int = 0
    echoed: bool = False
    done: bool = False
