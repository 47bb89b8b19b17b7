"""vLLM's POST /tokenize and /detokenize: the server's tokenizer, no engine round trip."""

from __future__ import annotations

from octavo.server.chat.serving import messages_to_dicts
from octavo.server.context import ServerContext
from octavo.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)


async def tokenize(ctx: ServerContext, body: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        ids = await ctx.apply_chat_template(messages_to_dicts(body.messages),
                                            body.add_generation_prompt)
    else:
        ids = await ctx.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = [ctx.token_str(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                            token_strs=strs)


async def detokenize(ctx: ServerContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(body.model)
    ctx.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=await ctx.decode(body.tokens))
