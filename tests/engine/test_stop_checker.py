"""Stop strings across token boundaries, stream hold-back, and finish reasons: the scheduler's
token checks (EOS, stop ids, length) composed with the output processor's text checks."""

from __future__ import annotations

from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.engine.stop_checker import (
    StopDecision,
    check_text_stop,
    check_token_stop,
    find_stop_string,
    partial_stop_len,
)
from octavo.sampling_params import SamplingParams


def check_stop(params, output_ids, text, new_chars, eos, prompt_len, max_model_len):
    """The decision the engine reaches for a sequence after one token: the scheduler's check
    on the tokens, then the output processor's on the detokenized text."""
    token = check_token_stop(params, output_ids, eos, prompt_len, max_model_len)
    return check_text_stop(params, token, len(output_ids), text, new_chars)


class StreamBuffer:
    """What a streaming client receives: the output processor's held-back text (everything but
    a tail that could still become a stop string), as deltas."""

    def __init__(self, stop, include_stop_str_in_output=False):
        self.stop = [] if include_stop_str_in_output else list(stop)
        self.sent = 0

    def delta(self, text, finished=False):
        end = len(text) if finished else len(text) - partial_stop_len(text, self.stop)
        end = max(end, self.sent)
        out, self.sent = text[self.sent : end], end
        return out


def test_find_stop_string_only_overlapping_new_text():
    assert find_stop_string("abcSTOPdef", 3, ["STOP"]) is None  # wholly in old text
    assert find_stop_string("abcST", 2, ["STOP"]) is None
    assert find_stop_string("abcSTOP", 2, ["STOP"]) == ("STOP", "abc")
    assert find_stop_string("abcSTOPx", 1, ["STOP"]) is None
    assert find_stop_string("abcSTOPxy", 3, ["STOP"], True) == ("STOP", "abcSTOP")
    assert find_stop_string("abc", 0, ["c"]) is None


def test_find_stop_string_earliest_wins():
    text = "hello world, bye"
    assert find_stop_string(text, len(text), ["bye", "world", "o w"]) == ("o w", "hell")
    assert find_stop_string(text, 5, ["bye", ", "]) == (", ", "hello world")


def test_hold_back_sizes():
    assert partial_stop_len("xxab", ["abcd"]) == 2
    assert partial_stop_len("xxabcd", ["abcd"]) == 0  # complete: the stop checker's job
    assert partial_stop_len("xx", ["abcd", "x!"]) == 1


def test_stream_never_emits_partial_stop_string():
    stop = ["</end>"]
    final = "Hello </ex and "
    buf = StreamBuffer(stop)
    text, streamed = "", ""
    for piece in ["Hello", " <", "/e", "x", " and </", "en", "d> tail"]:
        text += piece
        found = find_stop_string(text, len(piece), stop)
        if found:
            streamed += buf.delta(found[1], finished=True)
            break
        streamed += buf.delta(text)
        assert final.startswith(streamed)  # nothing of the stop string ever went out
    assert streamed == final


def test_stream_releases_everything_when_finished():
    buf = StreamBuffer(["STOP"])
    assert buf.delta("abcST") == "abc"
    assert buf.delta("abcSTx") == "STx"
    assert buf.delta("abcSTxS") == ""
    assert buf.delta("abcSTxS", finished=True) == "S"
    assert StreamBuffer(["STOP"], include_stop_str_in_output=True).delta("abST") == "abST"


def stop_after(text_pieces, params, eos=None, prompt_len=3, max_model_len=100):
    """Feed text pieces one token each; return (decision, step)."""
    text, ids = "", []
    for step, piece in enumerate(text_pieces):
        ids.append(1000 + step)
        text += piece
        decision = check_stop(params, ids, text, len(piece), eos, prompt_len, max_model_len)
        if decision:
            return decision, step
    return None, None


def test_check_stop_string_across_tokens_and_include():
    params = SamplingParams(stop=["###"], max_tokens=50)
    assert stop_after(["ab", "c#", "#", "#d"], params) == (StopDecision("stop", "###", "abc"), 3)
    params = SamplingParams(stop=["###"], include_stop_str_in_output=True)
    decision, _ = stop_after(["ab", "c#", "##d"], params)
    assert decision == StopDecision("stop", "###", "abc###")


def test_check_stop_eos_and_stop_tokens_and_min_tokens():
    eos = 2
    p = SamplingParams(max_tokens=10)
    assert check_stop(p, [5, eos], "hi", 0, eos, 3, 100) == StopDecision("stop")
    assert check_stop(SamplingParams(ignore_eos=True), [5, eos], "hi", 0, eos, 3, 100) is None
    # EOS text visible (skip_special_tokens=False) is removed from the output
    p = SamplingParams(skip_special_tokens=False)
    got = check_stop(p, [5, eos], "hi<eos>", 5, eos, 3, 100)
    assert got == StopDecision("stop", None, "hi")
    p = SamplingParams(stop_token_ids=[42])
    assert check_stop(p, [42], "x", 1, eos, 3, 100) == StopDecision("stop", 42, None)
    # not before min_tokens, for EOS, stop ids and stop strings alike
    p = SamplingParams(min_tokens=3, stop_token_ids=[42], stop=["x"])
    assert check_stop(p, [5, eos], "x", 1, eos, 3, 100) is None
    assert check_stop(p, [5, 42], "x", 1, eos, 3, 100) is None
    assert check_stop(p, [5, 6, 42], "x", 1, eos, 3, 100) == StopDecision("stop", 42)


def test_check_stop_length():
    p = SamplingParams(max_tokens=3)
    assert check_stop(p, [1, 2], "ab", 1, None, 3, 100) is None
    assert check_stop(p, [1, 2, 3], "abc", 1, None, 3, 100) == StopDecision("length")
    p = SamplingParams(max_tokens=None)
    assert check_stop(p, [1] * 6, "a", 1, None, 4, 10) == StopDecision("length")
    assert check_stop(p, [1] * 5, "a", 1, None, 4, 10) is None
    # a stop string on the last allowed token still reports "stop"
    p = SamplingParams(max_tokens=2, stop=["b"])
    assert check_stop(p, [1, 2], "ab", 1, None, 3, 100) == StopDecision("stop", "b", "a")


def test_stop_string_with_real_tokenizer(tokenizer):
    text = "The result is 42.\nQuestion: what next?"
    ids = tokenizer.encode(text)
    params = SamplingParams(stop=["\nQuestion"], max_tokens=100)
    detok = IncrementalDetokenizer(tokenizer, [])
    buf = StreamBuffer(params.stop)
    streamed = ""
    for i, tid in enumerate(ids):
        delta = detok.append([tid])
        decision = check_stop(params, ids[: i + 1], detok.output_text, len(delta), None, 0, 999)
        if decision:
            streamed += buf.delta(decision.output_text, finished=True)
            break
        streamed += buf.delta(detok.output_text)
        assert "\n" not in streamed
    assert decision == StopDecision("stop", "\nQuestion", "The result is 42.")
    assert streamed == "The result is 42."
