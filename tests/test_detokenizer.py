"""Incremental detokenizer: equals a full decode, never streams half a character, and handles
stop strings (earliest completed wins, truncation, hold-back while streaming)."""
import random

import pytest

from gpu_worker.detokenizer import Detokenizer

TEXTS = [
    "Hello 東京は日本の首都です。🙂🚀 élèves Über",
    "The quick brown fox jumps over the lazy dog.\n def main():\n    print(i * i)",
    "Привет, как дела? Γειά σου κόσμε ✨✨ 北京",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


def stream(tok, prompt_ids, out_ids, **kw):
    d = Detokenizer(tok, prompt_ids, **kw)
    deltas, stopped = [], None
    for i, t in enumerate(out_ids):
        stopped = d.add_token(t)
        last = stopped is not None or i == len(out_ids) - 1
        if last:
            d.flush()
        deltas.append(d.take_delta(finished=last))
        if stopped:
            break
    return d, deltas, stopped


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_breaks_a_character(tokenizer, text):
    prompt = tokenizer.encode("User: say it.")
    out = tokenizer.encode(text, add_special_tokens=False)
    d, deltas, _ = stream(tokenizer, prompt, out)
    assert "".join(deltas) == tokenizer.decode(out) == text
    assert all("\ufffd" not in x for x in deltas)
    # Multi-byte characters span tokens here, so some steps must have held text back.
    if not text.isascii():
        assert any(x == "" for x in deltas[:-1])


def test_random_token_soup_matches_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        out = [rng.randrange(5, tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        d, deltas, _ = stream(tokenizer, [1], out)
        assert "".join(deltas) == tokenizer.decode(out)


def test_special_tokens_skipped_or_kept(tokenizer):
    out = tokenizer.encode("one two", add_special_tokens=False) + [tokenizer.eos_token_id]
    _, deltas, _ = stream(tokenizer, [1], out)
    assert "".join(deltas) == "one two"
    _, deltas, _ = stream(tokenizer, [1], out, skip_special_tokens=False)
    assert "".join(deltas) == "one two" + tokenizer.eos_token


def test_stop_string_truncates_and_holds_back_partial_match(tokenizer):
    text = "one, two, three, four, five"
    out = tokenizer.encode(text, add_special_tokens=False)
    d, deltas, stopped = stream(tokenizer, [1], out, stop=["three,"])
    assert stopped == "three,"
    assert d.text == "one, two, "
    assert "".join(deltas) == "one, two, "
    # Nothing of "three" was ever streamed before the stop completed.
    assert all("t" not in x for x in deltas[:-1] if "two" not in x)
    d, deltas, _ = stream(tokenizer, [1], out, stop=["three,"], include_stop_str_in_output=True)
    assert "".join(deltas) == d.text == "one, two, three,"


def test_earliest_completed_stop_wins(tokenizer):
    text = "The capital of France is Paris."
    out = tokenizer.encode(text, add_special_tokens=False)
    # "is Paris" starts earlier but "France" completes first.
    d, deltas, stopped = stream(tokenizer, [1], out, stop=["is Paris", "France", "capital of X"])
    assert stopped == "France"
    assert "".join(deltas) == d.text == "The capital of "


def test_partial_stop_is_released_when_it_does_not_complete(tokenizer):
    text = "five six seven"
    out = tokenizer.encode(text, add_special_tokens=False)
    d, deltas, stopped = stream(tokenizer, [1], out, stop=["seventy"])
    assert stopped is None
    assert "".join(deltas) == text
    # "seven" was held back until the end.
    assert deltas[-1].endswith("seven") and not any("seven" in x for x in deltas[:-1])


def test_stop_check_can_be_deferred(tokenizer):
    # Below min_tokens the engine adds tokens without stop checks; an occurrence from then
    # is not matched later, a new one is.
    first = tokenizer.encode("one two", add_special_tokens=False)
    then = tokenizer.encode(" one", add_special_tokens=False)
    d = Detokenizer(tokenizer, [1], stop=["one"])
    assert [d.add_token(t, check_stop=False) for t in first] == [None] * len(first)
    assert d.text == "one two"
    results = [d.add_token(t) for t in then]
    assert results[-1] == "one" and d.text == "one two "
