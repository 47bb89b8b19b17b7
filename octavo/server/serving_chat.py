"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request.

Streaming follows OpenAI: a first chunk per choice carries only the role, then content deltas,
then a chunk with the finish reason, then (if asked) a usage chunk with no choices.
`max_tokens` defaults to what fits in max_model_len, as in vLLM.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from octavo.engine.async_engine import RequestStream
from octavo.outputs import RequestOutput
from octavo.server.context import ServerContext
from octavo.server.errors import bad_request
from octavo.server.logprobs import chat_logprobs
from octavo.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from octavo.server.serving_common import (
    ENGINE_ERRORS,
    SSE_DONE,
    SSEResponse,
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


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the template; text content parts are joined (no images here)."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    result = []
    for m in messages:
        d = m.model_dump()
        if isinstance(m.content, list):
            d["content"] = "".join(part.text for part in m.content)
        elif m.content is None:
            d["content"] = ""
        result.append(d)
    return result


async def create_chat_completion(
    ctx: ServerContext, body: ChatCompletionRequest, raw: Request
) -> Response:
    ctx.check_model(body.model)
    ctx.check_capacity()
    top_k = None
    if body.logprobs:
        top_k = body.top_logprobs or 0
    elif body.top_logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    check_max_tokens(ctx, max_tokens=body.max_tokens,
                     max_completion_tokens=body.max_completion_tokens)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else (
        body.max_tokens)
    ids = await ctx.apply_chat_template(messages_to_dicts(body.messages),
                                        body.add_generation_prompt, body.continue_final_message)
    check_context_length(ctx, len(ids), max_tokens, "messages")
    params = to_sampling_params(ctx, body, max_tokens=max_tokens, logprobs=top_k)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await start_requests(ctx, request_id, [{"prompt_token_ids": ids}], params,
                                   body.priority, "messages")
    gen = _ChatGeneration(ctx, body, request_id, top_k)
    if body.stream:
        return SSEResponse(gen.stream(streams), on_close=lambda: cancel_all(streams))
    try:
        finals = await collect(raw, streams)
    except ENGINE_ERRORS as e:
        raise engine_error(e) from e
    if finals is None:
        return client_closed()
    return JSONResponse(gen.response(finals[0]).model_dump())


class _ChatGeneration:
    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, request_id: str,
                 top_k: int | None) -> None:
        self.ctx = ctx
        self.body = body
        self.id = request_id
        self.top_k = top_k
        self.created = int(time.time())

    def _logprobs(self, token_ids: list[int], positions: list | None
                  ) -> ChatChoiceLogprobs | None:
        if self.top_k is None:
            return None
        return chat_logprobs(self.ctx, token_ids, positions or [], self.top_k)

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=o.index, message=ChatResponseMessage(content=o.text),
                logprobs=self._logprobs(o.token_ids, o.logprobs),
                finish_reason=o.finish_reason, stop_reason=o.stop_reason,
            )
            for o in sorted(out.outputs, key=lambda o: o.index)
        ]
        return ChatCompletionResponse(id=self.id, created=self.created,
                                      model=self.ctx.model_name, choices=choices,
                                      usage=usage([out]))

    def _chunk(self, choices: list[ChatStreamChoice], usage_info: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(
            id=self.id, created=self.created, model=self.ctx.model_name, choices=choices,
            usage=usage_info,
        ).model_dump_json())

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        opts = self.body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        sent_text = [0] * self.body.n
        sent_tokens = [0] * self.body.n
        done = [False] * self.body.n
        last: RequestOutput | None = None
        try:
            for i in range(self.body.n):
                role = DeltaMessage(role="assistant", content="")
                yield self._chunk([ChatStreamChoice(index=i, delta=role)])
            async for _, out in merge(streams):
                last = out
                for o in out.outputs:
                    i = o.index
                    if done[i]:
                        continue
                    text = o.text[sent_text[i]:] if len(o.text) > sent_text[i] else ""
                    new_tokens = len(o.token_ids) > sent_tokens[i]
                    if not (text or o.finish_reason or (self.top_k is not None and new_tokens)):
                        continue
                    lp = self._logprobs(o.token_ids[sent_tokens[i]:],
                                        (o.logprobs or [])[sent_tokens[i]:])
                    sent_text[i], sent_tokens[i] = len(o.text), len(o.token_ids)
                    done[i] = o.finish_reason is not None
                    choice = ChatStreamChoice(
                        index=i, delta=DeltaMessage(content=text), logprobs=lp,
                        finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                    )
                    yield self._chunk([choice], usage([out]) if continuous else None)
            if include_usage and last is not None:
                yield self._chunk([], usage([last]))
        except ENGINE_ERRORS as e:
            yield sse_error(e)
        finally:
            cancel_all(streams)
        yield SSE_DONE
