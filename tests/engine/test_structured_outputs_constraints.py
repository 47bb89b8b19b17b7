"""Structured outputs (constrained decoding) end to end on the embedded SmolLM2 (fp32): what
each kind of constraint produces, and how constraints combine with the other sampling options.

Every output of a constrained request follows its constraint: sampled JSON against the bench
schemas (n=1, n=4, prefix-cache hits), regexes, choices, Lark and GBNF grammars, json_object.
Also: stop strings, logprobs, length cuts, bad constraints (ValueError, nothing leaked),
allowed_token_ids, bad_words, min_tokens, the JSON whitespace options, num_cached_tokens.
Preemption, chunked prefill, block sizes, speculative decoding and the brute-force reference
are in test_structured_outputs_exactness.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from octavo import LLM, SamplingParams
from octavo.bench.json_schemas import SCHEMAS
from octavo.sampling_params import StructuredOutputsParams as SO
from tests.engine.structured_outputs_helpers import (
    CHOICES,
    NAMES,
    REGEXES,
    assert_idle,
    chat,
    check_valid,
    json_params,
    json_problems,
    roomy_llm,
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return roomy_llm()


@pytest.fixture(scope="module")
def tok(llm):
    return llm.engine.tokenizer


# ---- 1-2. sampled JSON against the bench schemas --------------------------------------------

def test_sampled_json_all_valid(llm, tok):
    """204 sampled requests (34 seeds x 6 schemas, temperature 1) in one batch: all valid."""
    prompts, params, names = [], [], []
    for name in NAMES:
        for seed in range(34):
            prompts.append(chat(tok, f"Write a JSON object for a {name}."))
            params.append(json_params(name, temperature=1.0, seed=seed))
            names.append(name)
    outs = llm.generate(prompts, params, use_tqdm=False)
    comps = [o.outputs[0] for o in outs]
    problems = json_problems([(n, c.text) for n, c in zip(names, comps, strict=True)],
                             [c.finish_reason for c in comps])
    assert not problems, f"{len(problems)} of {len(comps)} invalid:\n" + "\n".join(problems)
    # the seeds give different outputs (sampling is really on)
    assert len({c.text for c in comps}) > len(comps) // 2
    # the final EOS is the last token; nothing after the JSON
    assert all(c.token_ids[-1] == llm.engine.eos_token_id for c in comps)
    assert_idle(llm)


LONG_SYSTEM = ("You are a careful assistant that writes data records for a test suite. "
               "Every record you write is a single JSON object, with no explanation before "
               "or after it, and with realistic values: names of people and companies, "
               "cities, street addresses, order numbers, product codes and small numbers. "
               ) * 4


def test_sampled_json_n4_with_prefix_cache_hits(llm, tok):
    """6 schemas x 4 seeds x n=4 = 96 samples behind a long shared system prompt: every
    sample valid, the 4 samples of a request forked from one matcher, the prefix cache hit."""
    prompts, params, names = [], [], []
    for name in NAMES:
        for seed in range(4):
            prompts.append(chat(tok, f"Write a JSON object for a {name}.", LONG_SYSTEM))
            params.append(json_params(name, n=4, temperature=1.0, seed=100 + seed))
            names.append(name)
    prefix_len = len(tok.encode(chat(tok, "x", LONG_SYSTEM)))
    assert prefix_len > 200
    before = llm.engine.stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.engine.stats()
    comps, comp_names = [], []
    for name, out in zip(names, outs, strict=True):
        assert len(out.outputs) == 4
        assert sorted(c.index for c in out.outputs) == [0, 1, 2, 3]
        comps += out.outputs
        comp_names += [name] * 4
    problems = json_problems([(n, c.text) for n, c in zip(comp_names, comps, strict=True)],
                             [c.finish_reason for c in comps])
    assert not problems, f"{len(problems)} of {len(comps)} invalid:\n" + "\n".join(problems)
    # the n samples of one request differ (each fork has its own matcher and stream)
    assert sum(len({c.text for c in o.outputs}) > 1 for o in outs) >= len(outs) // 2
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    full_prefix = prefix_len // 16 * 16 - 16  # the shared part, in whole blocks, conservatively
    assert hits >= (len(prompts) - 1) * full_prefix, (hits, prefix_len)
    assert_idle(llm)


# ---- 3. regex, choice, Lark, GBNF, json_object ----------------------------------------------

REGEX_PROMPTS = {
    "phone": "Give me a phone number.", "phone_ascii": "Give me a phone number.",
    "date": "Give me a date.", "date_d": "Give me a date.", "pet": "Name a pet.",
    "word_num": "Name a street and a house number.",
}

LARK = r"""
start: expr
expr: term | term OP term | term OP term OP term
term: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*" | "/"
NUMBER: /[0-9]{1,3}/
"""

GBNF = r"""
root ::= expr
expr ::= term ([-+*/] term){0,3}
term ::= num | "(" num [-+*/] num ")"
num ::= [0-9]{1,3}
"""


def parse_arithmetic(text: str) -> bool:
    """True when `text` is an arithmetic expression over integers with + - * / and parentheses
    (no spaces): a recursive-descent parser for expr := term (op term)*, term := num | (expr)."""
    pos = 0

    def number() -> bool:
        nonlocal pos
        start = pos
        while pos < len(text) and text[pos] in "0123456789":
            pos += 1
        return pos > start

    def term() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        return number()

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-*/":
            pos += 1
            if not term():
                return False
        return True

    return expr() and pos == len(text)


def test_parse_arithmetic_checker():
    assert parse_arithmetic("1+2*(3-4)/5")
    assert parse_arithmetic("(12)")
    for bad in ("", "1+", "(1", "1)", "a", "1 + 2", "+1", "1**2"):
        assert not parse_arithmetic(bad), bad


def test_regex_choice_grammars_json_object(llm, tok):
    """Sampled (temperature 1, 6 seeds each), in one batch: regex outputs fullmatch; choice
    outputs are exactly one choice (quotes, backslash, unicode, newline); Lark and GBNF outputs
    parse as arithmetic; json_object outputs are JSON objects."""
    cases: list[tuple[str, str, SO]] = []
    for key, rx in REGEXES.items():
        cases.append((f"regex:{key}", chat(tok, REGEX_PROMPTS[key]), SO(regex=rx)))
    cases.append(("choice", chat(tok, "Pick one of the options."), SO(choice=CHOICES)))
    expr_prompt = chat(tok, "Write an arithmetic expression.")
    cases.append(("lark", expr_prompt, SO(grammar=LARK)))
    cases.append(("gbnf", expr_prompt, SO(grammar=GBNF)))
    cases.append(("json_object", chat(tok, "Write a JSON object about a book."),
                  SO(json_object=True)))
    prompts, params, kinds = [], [], []
    for kind, prompt, so in cases:
        for seed in range(6):
            prompts.append(prompt)
            # json_object is unbounded (a string may go on for ever): a length cut is allowed
            # there, as long as it is never labelled 'stop'
            params.append(SamplingParams(temperature=1.0, seed=seed,
                                         max_tokens=150 if kind == "json_object" else 300,
                                         structured_outputs=so))
            kinds.append(kind)
    outs = llm.generate(prompts, params, use_tqdm=False)
    problems = []
    seen_choices = set()
    json_object_cut = 0
    for kind, out in zip(kinds, outs, strict=True):
        c = out.outputs[0]
        text = c.text
        if kind.startswith("regex:"):
            ok = re.fullmatch(REGEXES[kind[6:]], text) is not None
        elif kind == "choice":
            ok = text in CHOICES
            seen_choices.add(text)
        elif kind in ("lark", "gbnf"):
            ok = parse_arithmetic(text)
        else:
            try:
                ok = isinstance(json.loads(text), dict)
            except json.JSONDecodeError:
                ok = False
            if c.finish_reason == "length" and not ok:
                json_object_cut += 1
                continue
        if not ok or c.finish_reason != "stop":
            problems.append(f"{kind}: {c.finish_reason}: {text!r}")
    assert not problems, "\n".join(problems)
    assert len(seen_choices) >= 2  # sampling reaches more than one choice
    assert json_object_cut <= 3  # most json_object samples close their object
    assert_idle(llm)


# ---- 6. stop strings and logprobs ------------------------------------------------------------

def test_stop_string_inside_json(llm, tok):
    prompts = [chat(tok, "Write a JSON object for a person.")] * 3
    params = [json_params("person", temperature=t, seed=s, stop=['"age"'])
              for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == '"age"', c
        assert c.text.startswith('{"name": "') and c.text.endswith(", ")
        assert '"age"' not in c.text
    with_stop = json_params("person", temperature=0, stop=['"age"'],
                            include_stop_str_in_output=True)
    c = llm.generate(prompts[0], with_stop, use_tqdm=False)[0].outputs[0]
    assert c.text.endswith('"age"') and c.stop_reason == '"age"'
    assert_idle(llm)


def test_logprobs_with_constraints(llm, tok):
    kinds = ["person", "order", "weather"]
    prompts = [chat(tok, f"Write a JSON object for a {k}.") for k in kinds]
    prompts.append(chat(tok, "Give me a phone number."))
    params = [json_params(k, temperature=1.0, seed=3, logprobs=2) for k in kinds]
    params.append(SamplingParams(temperature=0, max_tokens=50, logprobs=2,
                                 structured_outputs=SO(regex=REGEXES["phone"])))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for kind, out in zip(kinds + ["regex:phone"], outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check_valid(kind, c.text), c.text
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for token, entry in zip(c.token_ids, c.logprobs, strict=True):
            assert token in entry
            assert 2 <= len(entry) <= 3
            ranks = sorted(lp.rank for lp in entry.values())
            assert ranks[:2] == [1, 2]
            assert all(lp.logprob <= 0.0 for lp in entry.values())
            total += entry[token].logprob
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)
    assert_idle(llm)


# ---- 7. limits and bad constraints -----------------------------------------------------------

def test_max_tokens_too_small_is_length_never_stop(llm, tok):
    prompts, params, names = [], [], []
    for name in NAMES:
        for mt, t in ((5, 0.0), (5, 1.0), (1, 1.0)):
            prompts.append(chat(tok, f"Write a JSON object for a {name}."))
            params.append(json_params(name, temperature=t, seed=11, max_tokens=mt))
            names.append(name)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for name, p, out in zip(names, params, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "length", (name, c)
        assert len(c.token_ids) == p.max_tokens
        with pytest.raises(json.JSONDecodeError):
            json.loads(c.text)
    assert_idle(llm)


BAD_CONSTRAINTS = {
    "json-unknown-type": (SO(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
                          "strin"),
    "json-bad-minimum": (SO(json={"type": "integer", "minimum": "x"}), "minimum"),
    "json-unsatisfiable": (SO(json={"type": "integer", "minimum": 5, "maximum": 1}),
                           "minimum"),
    "json-bad-ref": (SO(json={"$ref": "#/definitions/nope"}), "nope"),
    "json-text-not-json": (SO(json="{not json"), "not valid JSON"),
    "json-text-not-object": (SO(json="[1, 2]"), "JSON object"),
    "regex-unclosed": (SO(regex="(ab"), "unclosed group"),
    "regex-bad-repetition": (SO(regex="a{3,1}"), "repetition"),
    "lark-unknown-rule": (SO(grammar="start: foo"), "unknown name"),
    "gbnf-unclosed": (SO(grammar="root ::= ("), "GBNF"),
    "gbnf-unknown-rule": (SO(grammar="root ::= undefined"), "undefined"),
    "whitespace-pattern": (SO(json={"type": "object"}, whitespace_pattern="("), "unclosed"),
}


@pytest.mark.parametrize("case", list(BAD_CONSTRAINTS))
def test_bad_constraint_is_value_error_and_nothing_leaks(llm, tok, case):
    so, words = BAD_CONSTRAINTS[case]
    good = SamplingParams(temperature=0, max_tokens=3)
    prompt = chat(tok, "Hello.")
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        # a good request first: it is added, then aborted when the bad one is rejected
        llm.generate([prompt, prompt], [good, SamplingParams(max_tokens=8,
                                                             structured_outputs=so)],
                     use_tqdm=False)
    assert "structured outputs" in str(info.value)
    assert_idle(llm)
    # the engine keeps working, constrained or not
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20,
                                              structured_outputs=SO(choice=["ok", "fine"])),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("ok", "fine") and out.finish_reason == "stop"
    assert_idle(llm)


@pytest.mark.parametrize("kwargs", [
    {}, {"json_object": False}, {"json": {}, "regex": "a"}, {"choice": ["a"], "grammar": "x"},
    {"regex": "a", "json_object": True}, {"choice": []}, {"choice": ["a", ""]}, {"regex": ""},
    {"json": 3}, {"grammar": ""},
])
def test_structured_outputs_params_validation(kwargs):
    with pytest.raises(ValueError, match="structured outputs"):
        SO(**kwargs)


def test_structured_outputs_must_be_params():
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


# ---- JSON layout options ---------------------------------------------------------------------

def test_json_whitespace_and_additional_properties_options(llm, tok):
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "string", "maxLength": 8}},
                   "required": ["a", "b"]}
    prompt = chat(tok, "Write a JSON object for a person.")
    params = [
        json_params("person", temperature=0),  # default: ", " and ": "
        SamplingParams(temperature=0, max_tokens=400, structured_outputs=SO(
            json=SCHEMAS["person"], disable_any_whitespace=True)),
        SamplingParams(temperature=0, max_tokens=400, structured_outputs=SO(
            json=json.dumps(SCHEMAS["person"]))),  # the schema as text
    ]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=400, structured_outputs=SO(
        json=open_schema, disable_additional_properties=True)) for s in range(6)]
    outs = [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
    default, compact, as_text = outs[:3]
    obj = json.loads(default.text)
    jsonschema.validate(obj, SCHEMAS["person"])
    assert default.text == json.dumps(obj, ensure_ascii=False)
    cobj = json.loads(compact.text)
    jsonschema.validate(cobj, SCHEMAS["person"])
    assert compact.text == json.dumps(cobj, ensure_ascii=False, separators=(",", ":"))
    assert as_text.token_ids == default.token_ids
    for c in outs[3:]:
        closed = json.loads(c.text)
        jsonschema.validate(closed, open_schema)
        assert set(closed) <= {"a", "b"}, c.text
    assert_idle(llm)


# ---- 9. allowed_token_ids, bad_words, min_tokens ---------------------------------------------

def test_allowed_token_ids(llm, tok):
    eos = llm.engine.eos_token_id
    digits = [tok.encode(d, add_special_tokens=False)[0] for d in "123"]
    assert len(set(digits)) == 3
    prompt = chat(tok, "Count from one to three.")
    params = [
        SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=digits),
        SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=digits + [eos]),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, allowed_token_ids=digits),
        # with a constraint: the intersection of both
        SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=digits[:2] + [eos],
                       structured_outputs=SO(regex="[0-9]{1,4}")),
    ]
    outs = [o.outputs[0] for o in llm.generate([prompt] * 4, params, use_tqdm=False)]
    no_eos, with_eos, sampled, constrained = outs
    assert set(no_eos.token_ids) <= set(digits) and no_eos.finish_reason == "length"
    assert len(no_eos.token_ids) == 12
    assert set(with_eos.token_ids) <= set(digits) | {eos}
    assert set(sampled.token_ids) <= set(digits)
    assert set(constrained.token_ids) <= set(digits[:2]) | {eos}
    assert re.fullmatch("[12]{1,4}", constrained.text) and constrained.finish_reason == "stop"
    assert_idle(llm)


def test_allowed_token_ids_disjoint_from_grammar_never_stop(llm, tok):
    """Observed behaviour: allowed_token_ids that the grammar never allows leave a row with no
    token at all; the sampler takes argmax of an all -inf row (token 0), the matcher rejects
    it and the request finishes 'abort' (never 'stop'); the engine is fine afterwards."""
    letters = tok.encode("xyz", add_special_tokens=False)
    out = llm.generate(chat(tok, "Say a number."), SamplingParams(
        temperature=0, max_tokens=10, allowed_token_ids=letters,
        structured_outputs=SO(regex="[0-9]+")), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "abort"
    assert str(out.stop_reason).startswith("structured output error")
    assert "\n" not in out.stop_reason and len(out.stop_reason) < 300  # one line, readable
    assert_idle(llm)


def test_bad_words_with_constraint(llm, tok):
    prompt = chat(tok, "Write a JSON object for a person.")
    first = llm.generate(prompt, json_params("person", temperature=0),
                         use_tqdm=False)[0].outputs[0]
    name = json.loads(first.text)["name"]
    word = re.findall(r"[A-Za-z]{3,}", name)[0]
    banned_seqs = [tok.encode(word, add_special_tokens=False),
                   tok.encode(" " + word, add_special_tokens=False)]

    def contains(ids, sub):
        return any(ids[i:i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))

    assert any(contains(first.token_ids, s) for s in banned_seqs), (word, first.text)
    params = [json_params("person", temperature=0, bad_words=[word])]
    params += [json_params("person", temperature=1.0, seed=s, bad_words=[word])
               for s in range(4)]
    outs = [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
    for c in outs:
        for s in banned_seqs:
            assert not contains(c.token_ids, s), (word, c.text)
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS["person"])
    assert outs[0].text != first.text
    assert_idle(llm)


def test_min_tokens_with_grammar_that_completes_early(llm, tok):
    """choice ["a"] with min_tokens=5: the grammar allows only EOS after "a" while min_tokens
    bans EOS. The grammar wins: the sampler keeps a row's allowed tokens when the bans leave
    none, and the EOS of a complete grammar finishes the sequence ("a" + EOS, finish 'stop')
    rather than repeating until min_tokens."""
    eos = llm.engine.eos_token_id
    prompt = chat(tok, "Say a.")
    params = [SamplingParams(temperature=t, seed=1, min_tokens=5, max_tokens=20,
                             structured_outputs=SO(choice=["a"])) for t in (0.0, 1.0)]
    params.append(SamplingParams(temperature=0, min_tokens=0, max_tokens=20,
                                 structured_outputs=SO(choice=["a"])))
    outs = [o.outputs[0] for o in llm.generate([prompt] * 3, params, use_tqdm=False)]
    a = tok.encode("a", add_special_tokens=False)
    for c in outs:
        assert c.text == "a" and c.finish_reason == "stop", c
        assert c.token_ids == a + [eos]
    assert_idle(llm)


# ---- last: a finding outside structured outputs proper -----------------------------------------

def test_num_cached_tokens_reported(llm, tok):
    """RequestOutput.num_cached_tokens (vLLM's: prompt tokens served by the prefix cache)
    should count the hits of a request whose long prompt prefix is cached."""
    prompt = chat(tok, "Write a JSON object for a person.", LONG_SYSTEM)
    params = json_params("person", temperature=0, max_tokens=3)
    llm.generate(prompt, params, use_tqdm=False)
    before = llm.engine.stats()["prefix_cache_hit_tokens"]
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    hits = llm.engine.stats()["prefix_cache_hit_tokens"] - before
    assert hits > 200
    assert out.num_cached_tokens == hits
