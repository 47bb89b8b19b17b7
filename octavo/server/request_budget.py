"""Bounds on the request fields that cost work per request or per step, and their preparation
off the engine thread.

Some fields bypass the prompt's length check and cost the engine work: bad_words are tokenized
(twice each), every stop string is searched for at every step of every sequence, a choice list
or a grammar is compiled by llguidance and then walked for every token's mask. Unbounded, one
request with 10^5 of them froze every stream for seconds. So each is bounded in count and size
(FIELD_LIMITS, a 400 naming the field), and their sum, weighted by how often the work recurs,
is held to a per-request budget (REQUEST_BUDGET characters): stop strings count once per
sequence (n), bad_words twice. What passes is prepared here, on the server's worker thread
(`prepare_fields`): bad_words as token ids and the constraint's grammar matcher, handed to the
engine with the request (engine/input_processor.py's Prepared), so the engine thread only takes
them. llguidance's errors (a Rust panic's text included) reach the client on one short line,
without a backtrace (engine/structured_output.py's error_text).
"""

from __future__ import annotations

import json
from typing import Any

from octavo.engine.input_processor import Prepared, bad_words_token_ids
from octavo.engine.structured_output import GrammarError, StructuredOutputs
from octavo.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.server.errors import bad_request

# field -> (most entries, most characters per entry)
FIELD_LIMITS = {
    "stop": (64, 512),
    "bad_words": (256, 512),
    "stop_token_ids": (1024, None),
    "choice": (1024, 1024),
}
MAX_CONSTRAINT_CHARS = 64 << 10  # a regex, a grammar, or a JSON schema as JSON text
REQUEST_BUDGET = 256 << 10  # characters of weighted work per request
MAX_TOOLS = 128  # OpenAI's limit


def check_count(name: str, values: list[Any] | None, param: str | None = None) -> None:
    """400 when a list field has more entries, or longer ones, than FIELD_LIMITS allow."""
    if not values:
        return
    most, longest = FIELD_LIMITS[name]
    if len(values) > most:
        raise bad_request(f"{name} has {len(values)} entries; at most {most} are accepted",
                          param or name)
    if longest is not None:
        for i, v in enumerate(values):
            if len(v) > longest:
                raise bad_request(f"{name}[{i}] has {len(v)} characters; at most {longest} are "
                                  "accepted", param or name)


def check_count_of_tools(tools: list[Any] | None) -> None:
    if tools and len(tools) > MAX_TOOLS:
        raise bad_request(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are accepted",
                          "tools")


def constraint_chars(spec: StructuredOutputsParams) -> int:
    """The size of a constraint as text (what llguidance compiles)."""
    chars = len(spec.whitespace_pattern or "")
    if spec.choice is not None:
        return chars + sum(len(c) for c in spec.choice)
    if spec.json is not None:
        return chars + (len(spec.json) if isinstance(spec.json, str) else len(
            json.dumps(spec.json, ensure_ascii=False)))
    return chars + len(spec.regex or spec.grammar or "")


def check_fields(params: SamplingParams, vocab_size: int,
                 constraint_param: str = "structured_outputs") -> int:
    """400 for a field past its limit or a request past its budget; the weighted cost.
    `constraint_param`: the request field the constraint came from (errors name it)."""
    check_count("stop", params.stop)
    check_count("bad_words", params.bad_words)
    check_count("stop_token_ids", params.stop_token_ids)
    if params.allowed_token_ids and len(params.allowed_token_ids) > vocab_size:
        raise bad_request(f"allowed_token_ids has {len(params.allowed_token_ids)} entries, more "
                          f"than the vocabulary's {vocab_size} tokens", "allowed_token_ids")
    cost = params.n * sum(len(s) for s in params.stop) + 2 * sum(
        len(w) for w in params.bad_words or ())
    spec = params.structured_outputs
    if spec is not None:
        check_count("choice", spec.choice, constraint_param)
        chars = constraint_chars(spec)
        if chars > MAX_CONSTRAINT_CHARS:
            raise bad_request(f"the structured-output constraint has {chars} characters; at most "
                              f"{MAX_CONSTRAINT_CHARS} are accepted", constraint_param)
        cost += chars
    if cost > REQUEST_BUDGET:
        raise bad_request(
            f"this request's stop strings (times n), bad_words (twice) and constraint add up to "
            f"{cost} characters of work; at most {REQUEST_BUDGET} are accepted", "stop"
            if params.stop else "bad_words" if params.bad_words else constraint_param)
    return cost


def prepare_fields(params: SamplingParams, tokenizer: Any, structured: StructuredOutputs,
                   constraint_param: str = "structured_outputs") -> Prepared:
    """Check the fields, then do their costly work (call on the server's worker thread: it
    owns `tokenizer`); 400 past a bound or for a constraint that does not compile."""
    check_fields(params, structured.vocab_size, constraint_param)
    words = bad_words_token_ids(tokenizer, params.bad_words) if params.bad_words else None
    matcher = None
    if params.structured_outputs is not None:
        try:
            matcher = structured.matcher(params.structured_outputs)
        except GrammarError as e:
            raise bad_request(str(e), constraint_param) from None
    return Prepared(bad_words_token_ids=words, matcher=matcher)
