"""The FastAPI app: routes, error handlers, middlewares, and the engine thread's lifetime.

`build_app` takes an AsyncLLMEngine that is not started yet; the app's lifespan starts its
thread on the server's event loop and stops it (aborting what is left) on shutdown, so the
same function serves `octavo serve` and tests that run several servers in one process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from octavo import __version__
from octavo.engine.async_engine import AsyncLLMEngine
from octavo.server.anthropic.serving import messages_router
from octavo.server.args import ServerConfig
from octavo.server.chat.serving import create_chat_completion
from octavo.server.completions.serving import create_completion
from octavo.server.completions.tokens import detokenize, tokenize
from octavo.server.context import ServerContext
from octavo.server.dashboard import dashboard_router
from octavo.server.errors import OpenAIError, install_error_handlers
from octavo.server.front_door import install_front_door
from octavo.server.openapi import install_openapi
from octavo.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from octavo.server.responses.serving import responses_router


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    ctx = ServerContext(engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()
            ctx.close()

    app = FastAPI(title="octavo", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "the engine runs and takes requests (empty body)", "content": {}}})
    async def health() -> Response:
        if not engine.is_running:
            raise OpenAIError(503, "the engine is not running")
        if engine.dead is not None:
            raise OpenAIError(503, f"the engine is dead: {engine.dead}")
        if not engine.accepting:
            raise OpenAIError(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, root=ctx.model_dir, max_model_len=ctx.max_model_len)
            for name in config.served_model_names
        ])

    @app.post("/v1/completions", response_class=Response, responses=generated(CompletionResponse))
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions", response_class=Response,
              responses=generated(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, body, raw)

    app.include_router(messages_router(ctx))  # /v1/messages, Anthropic's errors
    app.include_router(responses_router(ctx))  # /v1/responses, GET/DELETE by id
    app.include_router(dashboard_router(ctx))  # /dashboard, /v1/kv_map (+ /stream)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(ctx, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(ctx, body)

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    open_paths = install_front_door(app, config, config.host)
    install_openapi(app, api_key=bool(config.api_key), open_paths=open_paths,
                    vocab_size=ctx.vocab_size, max_model_len=ctx.max_model_len)
    return app


def generated(model: type) -> dict[int | str, dict[str, Any]]:
    """The 200 of a generating endpoint: JSON, or Server-Sent Events with `stream`."""
    return {200: {"model": model, "description": "the completion, or with `stream: true` "
                  "Server-Sent Events of chunks, then `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


# One Server-Sent Event: `data` holds a JSON chunk (or `[DONE]`, the last one).
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
