"""Pieces both generating endpoints use: request -> SamplingParams, submitting prompts,
waiting for results while watching the client, merging streams, Server-Sent Events.

Cancellation is explicit everywhere: whatever way a handler ends (finished, error, client gone,
task cancelled), the streams it started are cancelled in a `finally`, which aborts unfinished
requests in the engine and returns their KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from octavo.engine.async_engine import (
    EngineStepError,
    NewRequest,
    RequestAbortedError,
    RequestStream,
)
from octavo.outputs import RequestOutput
from octavo.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from octavo.server.context import ServerContext
from octavo.server.errors import OpenAIError, bad_request, error_body
from octavo.server.protocol import PromptTokensDetails, SamplingFields, UsageInfo

LOGIT_BIAS_MAX_ENTRIES = 300  # OpenAI's limit

# Status for a client that left before its answer (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499


def to_sampling_params(
    ctx: ServerContext, body: SamplingFields, *, max_tokens: int | None,
    logprobs: int | None, prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Map OpenAI/vLLM request fields to SamplingParams; its ValueErrors become 400s."""
    logit_bias = None
    if body.logit_bias:
        if len(body.logit_bias) > LOGIT_BIAS_MAX_ENTRIES:
            raise bad_request(f"logit_bias has {len(body.logit_bias)} entries; at most "
                              f"{LOGIT_BIAS_MAX_ENTRIES}", "logit_bias")
        logit_bias = {int(k): v for k, v in body.logit_bias.items()}  # the schema: digits only
        ctx.check_token_ids(list(logit_bias), "logit_bias")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    if body.n > ctx.max_num_seqs:
        raise bad_request(f"n={body.n} exceeds max_num_seqs={ctx.max_num_seqs}", "n")
    for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if k is not None and k > ctx.config.max_logprobs:
            raise bad_request(f"{name}={k} exceeds the limit of {ctx.config.max_logprobs}", name)
    if body.priority != 0 and ctx.scheduling_policy != "priority":
        raise bad_request("priority needs the server to run with --scheduling-policy priority",
                          "priority")
    if body.stop_token_ids:
        ctx.check_token_ids(body.stop_token_ids, "stop_token_ids")
    if body.allowed_token_ids:
        ctx.check_token_ids(body.allowed_token_ids, "allowed_token_ids")
    budget = body.thinking_token_budget
    if budget is None and ctx.config.reasoning_budget >= 0:
        budget = ctx.config.reasoning_budget
    try:
        return SamplingParams(
            n=body.n,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=_or(body.repetition_penalty, 1.0),
            temperature=_or(body.temperature, 1.0),
            top_p=_or(body.top_p, 1.0),
            top_k=_or(body.top_k, 0),
            min_p=_or(body.min_p, 0.0),
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=logit_bias,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            thinking_token_budget=budget,
            structured_outputs=structured_outputs,
            # a stream sends what each step adds; a whole response needs only the end
            output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        )
    except (ValueError, TypeError) as e:
        raise bad_request(str(e)) from e


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def check_max_tokens(ctx: ServerContext, **given: int | None) -> None:
    """A max_tokens-like field (max_tokens, max_completion_tokens) below max_model_len, as the
    OpenAPI document states, whether or not it is the one used."""
    for name, value in given.items():
        if value is not None and value >= ctx.max_model_len:
            raise bad_request(f"{name}={value} is not below max_model_len "
                              f"({ctx.max_model_len})", name)


def check_context_length(ctx: ServerContext, num_prompt: int, max_tokens: int | None,
                         param: str) -> None:
    """vLLM's check, in vLLM's (and OpenAI's) words: prompt + max_tokens must fit in
    max_model_len. Clients recognise an over-long prompt by this wording (LiteLLM raises its
    ContextWindowExceededError, and routes to a fallback, on "This model's maximum context
    length is")."""
    m = ctx.max_model_len
    if max_tokens is None and num_prompt >= m:
        raise bad_request(
            f"This model's maximum context length is {m} tokens. However, you requested "
            f"{num_prompt} tokens in the messages, Please reduce the length of the messages.",
            param,
        )
    if max_tokens is not None and num_prompt + max_tokens > m:
        raise bad_request(
            f"This model's maximum context length is {m} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in "
            "the completion). Please reduce the length of the messages or completion.",
            "max_tokens" if num_prompt < m else param,
        )


async def start_requests(
    ctx: ServerContext, base_id: str, prompts: Sequence[dict[str, Any]],
    params: SamplingParams, priority: int, param: str,
) -> list[RequestStream]:
    """Submit one engine request per prompt, all in one command: all or nothing (the engine
    takes none of them if one is bad)."""
    requests = [NewRequest(base_id if len(prompts) == 1 else f"{base_id}-{i}", p, params, priority)
                for i, p in enumerate(prompts)]
    try:
        return await ctx.engine.add_requests(requests)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param) from e
    except RequestAbortedError as e:
        raise OpenAIError(503, str(e)) from e


def cancel_all(streams: Sequence[RequestStream]) -> None:
    for s in streams:
        s.cancel()


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) from several streams as outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def collect(raw: Request, streams: Sequence[RequestStream]) -> list[RequestOutput] | None:
    """The final output of every stream, or None if the client disconnected first."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def drain() -> None:
        async for i, out in merge(streams):
            finals[i] = out

    work = asyncio.create_task(drain())
    watcher = asyncio.create_task(_wait_disconnect(raw))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            return None  # the client left: the finally below aborts its requests
        work.result()  # re-raise engine errors
    finally:
        for t in (work, watcher):
            t.cancel()
        cancel_all(streams)
    return [f for f in finals if f is not None]


async def _wait_disconnect(raw: Request) -> None:
    """Return when the client disconnects (the body was read; receive() now waits for that)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


ENGINE_ERRORS = (RequestAbortedError, EngineStepError)


def engine_error(e: RequestAbortedError | EngineStepError) -> OpenAIError:
    """Shutdown aborts are 503 (retry elsewhere); a failed model step is a genuine 500."""
    return OpenAIError(503 if isinstance(e, RequestAbortedError) else 500, str(e))


def usage(outputs: Sequence[RequestOutput]) -> UsageInfo:
    """Token counts of whole (cumulative or final) outputs; cached_tokens: the prompt tokens
    the prefix cache held (OpenAI's prompt_tokens_details)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class StreamUsage:
    """Token counts of a stream of DELTA outputs, added up as they arrive."""

    def __init__(self) -> None:
        self._prompt: dict[int, int] = {}  # per prompt index
        self._cached: dict[int, int] = {}
        self.completion = 0

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self._prompt[prompt_index] = len(out.prompt_token_ids)
        self._cached[prompt_index] = out.num_cached_tokens
        self.completion += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> UsageInfo:
        prompt = sum(self._prompt.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion,
                         total_tokens=prompt + self.completion,
                         prompt_tokens_details=PromptTokensDetails(
                             cached_tokens=sum(self._cached.values())))


# Characters JSON leaves raw that str.splitlines() (httpx's aiter_lines, many SSE readers)
# takes for line breaks; inside a JSON string their \u escapes mean the same.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                         "\u2029": "\\u2029"})


def sse(payload: str) -> str:
    """One Server-Sent Event; `payload` is JSON, so no raw line break may stay in it."""
    return f"data: {payload.translate(_LINE_BREAKS_JSON_KEEPS)}\n\n"


def sse_error(e: BaseException) -> str:
    status = 503 if isinstance(e, RequestAbortedError) else 500
    return sse(json.dumps(error_body(status, str(e)).model_dump()))


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however the stream ends.

    Starlette cancels a streaming body when the client disconnects, but the async generator
    itself is only closed when garbage-collected; `on_close` (cancel the engine requests)
    must not wait for that.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def client_closed() -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
