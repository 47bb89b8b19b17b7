"""Helpers shared by the structured-outputs tests (test_structured_outputs_*.py): engines built
through _build (every one of them checked idle at the end by test_every_engine_idle_at_the_end),
chat prompts, the idle check, validation (JSON against the bench schemas, regexes, choices),
and the regexes and choices both files constrain to.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jsonschema

from octavo import LLM, SamplingParams
from octavo.bench.json_schemas import SCHEMAS
from octavo.sampling_params import StructuredOutputsParams as SO

ROOMY_BLOCKS = 1024  # bs 16: 16k tokens, far more than any batch here needs
NAMES = list(SCHEMAS)

# ---- engines ------------------------------------------------------------------------------

_ENGINES: list[LLM] = []


def _build(**options: Any) -> LLM:
    llm = LLM(dtype="float32", **options)
    _ENGINES.append(llm)
    return llm


@functools.cache
def roomy_llm() -> LLM:
    """The roomy engine (block size 16, prefix caching on) most tests share, built once for
    both structured-outputs test files (every engine lives on in _ENGINES anyway)."""
    return _build(num_kv_blocks=ROOMY_BLOCKS, block_size=16, enable_prefix_caching=True)


def chat(tok, message: str, system: str | None = None) -> str:
    conv = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": message}]
    return tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


def assert_idle(llm: LLM) -> None:
    """No request left, no KV block held (device or host), the allocator consistent."""
    s = llm.engine.stats()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.requests == {}
    assert s["kv_blocks_used"] == 0, s
    assert s["kv_cpu_blocks_used"] == 0, s
    assert s["num_requests_running"] == s["num_requests_waiting"] == 0
    assert s["num_requests_swapped"] == 0
    llm.engine.check_invariants()


def json_problems(texts_and_schemas, finish_reasons) -> list[str]:
    """Every output that is not valid JSON following its schema, or did not finish 'stop'."""
    problems = []
    for (name, text), reason in zip(texts_and_schemas, finish_reasons, strict=True):
        if reason != "stop":
            problems.append(f"{name}: finish_reason={reason!r}: {text!r}")
            continue
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            problems.append(f"{name}: {type(e).__name__}: {str(e)[:200]}: {text!r}")
    return problems


def json_params(name: str, **kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 400)
    return SamplingParams(structured_outputs=SO(json=SCHEMAS[name]), **kw)


REGEXES = {
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "phone_ascii": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "date_d": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "pet": r"(cat|dog|bird)s?",
    "word_num": r"[A-Z][a-z]{1,8} [0-9]{1,3}",
}

CHOICES = ['say "hi"', "back\\slash", "café ☕", "plain", "日本語", "new\nline"]


def check_valid(kind: str, text: str) -> bool:
    if kind.startswith("regex:"):
        return re.fullmatch(REGEXES[kind[6:]], text) is not None
    if kind == "choice":
        return text in CHOICES
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[kind])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True
