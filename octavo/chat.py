"""`octavo chat`: an interactive terminal chat that streams tokens and keeps the conversation."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator

from octavo.llm import LLM
from octavo.sampling_params import SamplingParams

HELP = "commands: /reset clears the conversation, /quit leaves"


def stream_reply(llm: LLM, conversation: list[dict[str, str]], params: SamplingParams,
                 request_id: str) -> Iterator[str]:
    """Yield text deltas of the assistant's reply as the engine produces them."""
    engine = llm.engine
    ids = llm.apply_chat_template(conversation)
    engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    sent = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                text = out.outputs[0].text
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
                if out.finished:
                    return
    finally:
        engine.abort_request(request_id)  # no-op when finished; frees blocks on Ctrl-C


def run_chat(llm: LLM, params: SamplingParams, *, system: str | None = None,
             read: Callable[[str], str] = input) -> int:
    system_turn = [{"role": "system", "content": system}] if system else []
    conversation = list(system_turn)
    ids = itertools.count()
    print(f"octavo chat ({llm.engine.model_dir.name}); {HELP}", flush=True)
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line == "/quit":
            return 0
        if line == "/reset":
            conversation = list(system_turn)
            print("(conversation cleared)", flush=True)
            continue
        if line.startswith("/"):
            print(f"unknown command {line!r}; {HELP}", flush=True)
            continue
        conversation.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        reply = []
        try:
            for delta in stream_reply(llm, conversation, params, f"chat-{next(ids)}"):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]")
        sys.stdout.write("\n")
        conversation.append({"role": "assistant", "content": "".join(reply).strip()})
