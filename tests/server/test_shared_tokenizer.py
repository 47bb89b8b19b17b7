"""The server's front end shares the engine's tokenizer (a large vocabulary's takes hundreds of
MB: Gemma 3's 262k tokens 275 MB, once instead of three times), and one tokenizer serves the
event loop, the tokenizing worker and the engine thread at once: they only read it (encode,
decode, chat templates), never reconfigure it, so no call waits on or breaks another."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from octavo.engine.async_engine import AsyncLLMEngine
from octavo.llm import LLM
from octavo.server.args import ServerConfig
from octavo.server.context import ServerContext

TEXTS = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 7 + 1)
         for i in range(64)]


def test_the_front_end_uses_the_engines_tokenizer(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16)
    engine = AsyncLLMEngine(llm.engine)
    ctx = ServerContext(engine, ServerConfig())
    try:
        assert ctx.tokenizer is llm.engine.tokenizer
        assert ctx.bounded.tokenizer is llm.engine.tokenizer
    finally:
        ctx.close()


def test_threads_share_one_tokenizer(default_model_dir):
    tok = LLM(str(default_model_dir), num_kv_blocks=16).engine.tokenizer
    want = [(tok.encode(t), tok.decode(tok.encode(t)),
             tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False))
            for t in TEXTS]

    def work(i: int):
        t = TEXTS[i % len(TEXTS)]
        ids = tok.encode(t)
        return ids, tok.decode(ids), tok.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False)

    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(work, range(4 * len(TEXTS))))
    assert got == want * 4
