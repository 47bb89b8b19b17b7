"""IncrementalDetokenizer on the real tokenizer: deltas concatenate to the full decode."""

from __future__ import annotations

import random

import pytest

from octavo.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "  leading spaces and\ttabs\nnew lines\n\n  indented",
    "héllo naïve café — “quotes” … ½ ° ß",
    "你好，世界！今天天气很好。日本語のテキストも。한국어 텍스트",
    "emoji 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 done",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "mixed 数学 ∑∫∂ math ≤≥ and 🤖 robots. 12345 67.89",
]


def run(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    deltas = []
    pos = 0
    for size in chunks:
        deltas.append(detok.append(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Say something:")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = run(detok, ids, [1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids) == detok.output_text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.token_ids == ids


def test_random_sequences_and_chunkings(tokenizer):
    rng = random.Random(0)
    pieces = [w for t in TEXTS for w in t.split(" ")] + ["🎉", "你", "é", "\n", "  "]
    for _ in range(60):
        text = " ".join(rng.choice(pieces) for _ in range(rng.randint(1, 25)))
        ids = tokenizer.encode(text)
        chunks = []
        left = len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 3)))
            left -= chunks[-1]
        prompt = tokenizer.encode(rng.choice(TEXTS))[: rng.randint(0, 12)]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        assert "".join(run(detok, ids, chunks)) == tokenizer.decode(ids)


def test_random_token_ids_match_decode(tokenizer):
    # Arbitrary ids (not from encode) include lone byte tokens: the final text still matches.
    rng = random.Random(1)
    vocab = len(tokenizer)
    for _ in range(30):
        ids = [rng.randrange(17, vocab) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tokenizer, [])
        assert "".join(run(detok, ids, [1] * len(ids))) == tokenizer.decode(ids)


def test_multibyte_character_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("a🎉")
    emoji_ids = ids[1:]
    assert len(emoji_ids) > 1  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.append(ids[:1]) == "a"
    for tid in emoji_ids[:-1]:
        assert detok.append([tid]) == ""
    assert detok.append(emoji_ids[-1:]) == "🎉"


def test_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi there") + [eos]
    skip = IncrementalDetokenizer(tokenizer, [1, 2])
    assert "".join(run(skip, ids, [1] * len(ids))) == "Hi there"
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    text = "".join(run(keep, ids, [1] * len(ids)))
    assert text == tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith(tokenizer.eos_token)


def test_leading_space_of_first_output_token(tokenizer):
    prompt = tokenizer.encode("The answer is")
    out = tokenizer.encode(" forty two")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.append(out[:1]).startswith(" ")
    full = tokenizer.decode(prompt + out)
    detok.append(out[1:])
    assert full == tokenizer.decode(prompt) + detok.output_text
