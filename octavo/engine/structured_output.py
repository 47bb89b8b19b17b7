"""Structured outputs: a grammar matcher per sequence, and each step's token bitmask.

Built on llguidance (see docs/STRUCTURED_OUTPUTS.md for why not xgrammar): a constraint
(StructuredOutputsParams) compiles once to a grammar (cached), each sequence gets a matcher
from it when its request comes in, and

- after the scheduler plans a step, `bitmask(plan, seqs)` starts computing, on a worker
  thread, one row of allowed tokens for every constrained sequence that samples in the step
  (llguidance drops the GIL while it works, so this overlaps the forward pass); the runner
  waits for it only when it samples;
- when a token lands (scheduler.update_from_output), the sequence's matcher consumes it.

The matcher state is always that of the sequence's output tokens: preemption (recompute or
swap) keeps those tokens, so nothing needs rebuilding; a fork (n > 1) copies the matcher. No
torch here: llguidance fills int32 words (32 tokens each, bit set = allowed), which the worker
unpacks to one byte per token.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from octavo.sampling_params import StructuredOutputsParams
from octavo.step_plan import GrammarBitmask, StepPlan

GRAMMAR_CACHE_SIZE = 256

# JSON layout when the request does not ask for another: the separators json.dumps writes and
# no free whitespace, so every token carries content.
DEFAULT_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ",
                        "key_separator": ": "}
COMPACT_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",",
                        "key_separator": ":"}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the problem."""


MAX_ERROR_CHARS = 400


def error_text(message: str) -> str:
    """llguidance's message as a client may see it: on one line, short, never the Rust
    backtrace a panic's text carries."""
    for marker in ("<backtrace>", "stack backtrace:"):
        message = message.split(marker, 1)[0]
    text = " / ".join(line.strip() for line in message.splitlines() if line.strip())
    text = text or "the grammar compiler failed"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def json_schema_of(spec: StructuredOutputsParams) -> dict[str, Any]:
    """The schema a json/json_object constraint asks for, checked to be a JSON object."""
    if spec.json_object:
        return {"type": "object"}
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"structured outputs: the JSON schema is not valid JSON: {e}") \
                from None
    if not isinstance(schema, dict):
        raise GrammarError("structured outputs: a JSON schema must be a JSON object")
    if spec.disable_additional_properties:
        schema = _closed(schema)
    return schema


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties: false on every object that does not set it."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a constraint; not yet validated."""
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        options = dict(COMPACT_JSON_OPTIONS if spec.disable_any_whitespace
                       else DEFAULT_JSON_OPTIONS)
        if spec.whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
        schema = json_schema_of(spec)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise GrammarError(f"structured outputs: invalid JSON schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes: any choice text is matched literally.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    grammar = spec.grammar
    if "::=" in grammar:  # GBNF (llama.cpp's grammar format), as vLLM also accepts
        try:
            grammar = llguidance.gbnf_to_lark.gbnf_to_lark(grammar)
        except Exception as e:
            raise GrammarError(f"structured outputs: invalid GBNF grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(grammar)


@contextmanager
def rust_panics_as_errors() -> Iterator[None]:
    """A panic inside llguidance (pyo3's PanicException, a BaseException) as a GrammarError;
    GrammarErrors and ValueErrors with their text cut to its first line."""
    try:
        yield
    except GrammarError as e:
        raise GrammarError(error_text(str(e))) from None
    except ValueError as e:  # llguidance's own (a regex or grammar it cannot parse)
        raise GrammarError(f"structured outputs: {error_text(str(e))}") from None
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise GrammarError("structured outputs: the grammar compiler failed on this "
                           f"constraint: {error_text(str(e))}") from None


def spec_key(spec: StructuredOutputsParams) -> str:
    fields = {k: v for k, v in vars(spec).items() if k != "disable_fallback"}
    return json.dumps(fields, sort_keys=True, ensure_ascii=False)


class StructuredOutputs:
    """Compiles constraints (cached), makes matchers, and builds each step's bitmask."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._tokenizer: Any = None  # llguidance's, built on first use (~0.3 s)
        self._tokenizer_lock = threading.Lock()
        self._grammars: OrderedDict[str, str] = OrderedDict()
        # compile() and matcher() also run on a server's worker thread, beside the engine's
        self._grammars_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None

    @property
    def tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer,
                                                               n_vocab=self.vocab_size)
            return self._tokenizer

    # ---- requests ---------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputsParams) -> str:
        """The validated grammar of a constraint (raises GrammarError naming the problem)."""
        import llguidance

        key = spec_key(spec)
        with self._grammars_lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        with rust_panics_as_errors():
            grammar = grammar_source(spec)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self.tokenizer)
        if is_error:
            detail = error_text(messages[0]) if messages else "unknown error"
            raise GrammarError(f"structured outputs: the {spec.kind} constraint cannot be "
                               f"compiled: {detail}")
        with self._grammars_lock:
            self._grammars[key] = grammar
            if len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher (llguidance.LLMatcher) at the start of the constraint."""
        import llguidance

        grammar = self.compile(spec)
        with rust_panics_as_errors():
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"structured outputs: {error_text(m.get_error())}")
        return m

    # ---- steps ------------------------------------------------------------------------------
    def bitmask(self, plan: StepPlan, seqs: dict[int, Any]) -> GrammarBitmask | None:
        """Start computing the allowed tokens of every constrained sequence sampling in this
        plan; the runner collects the result. None when no sampling sequence is constrained."""
        rows: list[int] = []
        positions: list[int] = []
        jobs: list[tuple[Any, int, list[int]]] = []  # (matcher, first row, drafts)
        for chunk in plan.chunks:
            for seq_id in chunk.sample_seq_ids:
                m = seqs[seq_id].grammar
                if m is not None:
                    # speculative decoding: one row per draft position as well, each the
                    # mask after the drafts before it (the scheduler kept only drafts the
                    # grammar takes)
                    drafts = chunk.draft_token_ids if seq_id == chunk.seq_id else []
                    jobs.append((m, len(rows), list(drafts)))
                    rows.extend([seq_id] * (len(drafts) + 1))
                    positions.extend(range(len(drafts) + 1))
        if not rows:
            return None
        if self._pool is None:
            import llguidance

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="octavo-grammar")
            self._executor = llguidance.LLExecutor()
        pending: Future = self._pool.submit(self._fill, jobs, len(rows))
        return GrammarBitmask(seq_ids=rows, pending=pending, positions=positions)

    def _fill(self, jobs: list[tuple[Any, int, list[int]]], num_rows: int) -> np.ndarray:
        import llguidance.numpy as lln

        mask = np.full((num_rows, self.num_words), -1, dtype=np.int32)
        plain = [(m, i) for m, i, drafts in jobs if not drafts]
        if plain:
            lln.fill_next_token_bitmask_par(self._executor, plain, mask)
        speculative = [job for job in jobs if job[2]]
        if speculative:  # rows after each draft; the matchers are left as they were
            lln.fill_next_token_bitmask_par_with_draft_tokens(self._executor, speculative,
                                                              mask)
        # one byte per token (1 = allowed), unpacked here too, off the sampler's path
        allowed = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
        return np.ascontiguousarray(allowed[:, : self.vocab_size])

    @staticmethod
    def wait(plan: StepPlan) -> None:
        """Let a step's mask job end before matchers change (after a failed step)."""
        if plan.grammar_bitmask is not None:
            plan.grammar_bitmask.pending.exception()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
