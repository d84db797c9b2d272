"""Incremental detokenizer: equals transformers' full decode, never streams half a character, and
handles stop strings (earliest completed wins, truncation, hold-back while streaming). It decodes
with the worker's one tokenizer (PromptTokenizer); transformers' AutoTokenizer is the reference."""
import json
import os
import random
import shutil

import pytest

from pagoda.gpu_worker.core.detokenizer import Detokenizer
from pagoda.runtime.tokenization import PromptTokenizer

TEXTS = [
    "Hello 東京は日本の首都です。🙂🚀 élèves Über",
    "The quick brown fox jumps over the lazy dog.\n def main():\n    print(i * i)",
    "Привет, как дела? Γειά σου κόσμε ✨✨ 北京",
]


# The default tiny model's tokens are whole characters; Qwen2's tiny model keeps a byte-level BPE,
# whose multi-byte characters span tokens.
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    tok = PromptTokenizer.from_dir(model_dir)
    assert not tok.clean_up_tokenization_spaces
    return tok


def _forced_clean_up_copy(src: str, dst) -> str:
    # The tiny tokenizer, told to clean up spaces even though it is BPE (transformers then
    # rewrites " ," to "," and so on after decoding; DecodeStream knows nothing of it).
    os.makedirs(dst)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg.update(clean_up_tokenization_spaces=True,
               clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


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
def test_incremental_equals_full_decode_and_never_breaks_a_character(tokenizer, hf, text):
    prompt = tokenizer.encode_text("User: say it.")
    out = hf.encode(text, add_special_tokens=False)
    d, deltas, _ = stream(tokenizer, prompt, out)
    assert "".join(deltas) == hf.decode(out) == text
    assert all("\ufffd" not in x for x in deltas)
    # With a byte-level BPE multi-byte characters span tokens, so some steps must have held text
    # back; over characters every token is text at once.
    byte_level = "ByteLevel" in tokenizer.tokenizer_json
    if not text.isascii():
        assert any(x == "" for x in deltas[:-1]) == byte_level


def test_random_token_soup_matches_full_decode(tokenizer, hf):
    rng = random.Random(0)
    for _ in range(20):
        out = [rng.randrange(5, hf.vocab_size) for _ in range(rng.randrange(1, 40))]
        d, deltas, _ = stream(tokenizer, [1], out)
        assert "".join(deltas) == hf.decode(out, skip_special_tokens=True)


def test_special_tokens_skipped_or_kept(tokenizer, hf):
    out = hf.encode("one two", add_special_tokens=False) + [hf.eos_token_id]
    _, deltas, _ = stream(tokenizer, [1], out)
    assert "".join(deltas) == "one two"
    _, deltas, _ = stream(tokenizer, [1], out, skip_special_tokens=False)
    assert "".join(deltas) == "one two" + hf.eos_token


def test_stop_string_truncates_and_holds_back_partial_match(tokenizer, hf):
    text = "one, two, three, four, five"
    out = hf.encode(text, add_special_tokens=False)
    d, deltas, stopped = stream(tokenizer, [1], out, stop=["three,"])
    assert stopped == "three,"
    assert d.text == "one, two, "
    assert "".join(deltas) == "one, two, "
    # Nothing of "three" was ever streamed before the stop completed.
    assert all("t" not in x for x in deltas[:-1] if "two" not in x)
    d, deltas, _ = stream(tokenizer, [1], out, stop=["three,"], include_stop_str_in_output=True)
    assert "".join(deltas) == d.text == "one, two, three,"


def test_earliest_completed_stop_wins(tokenizer, hf):
    text = "The capital of France is Paris."
    out = hf.encode(text, add_special_tokens=False)
    # "is Paris" starts earlier but "France" completes first.
    d, deltas, stopped = stream(tokenizer, [1], out, stop=["is Paris", "France", "capital of X"])
    assert stopped == "France"
    assert "".join(deltas) == d.text == "The capital of "


def test_partial_stop_is_released_when_it_does_not_complete(tokenizer, hf):
    text = "five six seven"
    out = hf.encode(text, add_special_tokens=False)
    d, deltas, stopped = stream(tokenizer, [1], out, stop=["seventy"])
    assert stopped is None
    assert "".join(deltas) == text
    # "seven" was held back until the end.
    assert deltas[-1].endswith("seven") and not any("seven" in x for x in deltas[:-1])


def test_stop_check_can_be_deferred(tokenizer, hf):
    # Below min_tokens the engine adds tokens without stop checks; an occurrence from then
    # is not matched later, a new one is.
    first = hf.encode("one two", add_special_tokens=False)
    then = hf.encode(" one", add_special_tokens=False)
    d = Detokenizer(tokenizer, [1], stop=["one"])
    assert [d.add_token(t, check_stop=False) for t in first] == [None] * len(first)
    assert d.text == "one two"
    results = [d.add_token(t) for t in then]
    assert results[-1] == "one" and d.text == "one two "


@pytest.fixture(scope="module")
def clean_up_pair(tiny_model, tmp_path_factory):
    from transformers import AutoTokenizer
    d = _forced_clean_up_copy(tiny_model, tmp_path_factory.mktemp("clean") / "tok")
    tok = PromptTokenizer.from_dir(d)
    assert tok.clean_up_tokenization_spaces
    return AutoTokenizer.from_pretrained(d), tok


@pytest.mark.parametrize("text", TEXTS)
def test_clean_up_streams_what_a_full_decode_gives(clean_up_pair, text):
    hf, tok = clean_up_pair
    out = hf.encode(text + " Is it , or . ? Do n't ' s", add_special_tokens=False)
    _, deltas, _ = stream(tok, tok.encode_text("User: say it."), out)
    assert "".join(deltas) == hf.decode(out, skip_special_tokens=True) == tok.decode(out, skip_special_tokens=True)
    assert "".join(deltas).endswith("Is it, or.? Don't's")


def test_clean_up_random_soup_and_held_back_spaces(clean_up_pair):
    hf, tok = clean_up_pair
    pieces = [hf.encode(w, add_special_tokens=False) for w in [" a", " .", " ,", " !", " ?", " '", " n't", " 's",
                                                                " 're", " 've", " 'm", " x", "'", "n", "t", " "]]
    rng = random.Random(1)
    for _ in range(300):
        out = [t for _ in range(rng.randrange(1, 30)) for t in rng.choice(pieces)]
        _, deltas, _ = stream(tok, [1], out)
        assert "".join(deltas) == hf.decode(out, skip_special_tokens=True), out
    # A streamed space may still vanish, so it waits for the next text.
    d = Detokenizer(tok, [1])
    for t in hf.encode(" a ", add_special_tokens=False):
        d.add_token(t)
    assert d.take_delta(False).rstrip() == d.text.rstrip() and not d.take_delta(False)


def test_clean_up_stop_string_sees_the_cleaned_text(clean_up_pair):
    hf, tok = clean_up_pair
    out = hf.encode(" one , two , three", add_special_tokens=False)
    d, deltas, stopped = stream(tok, [1], out, stop=["one,"])
    assert stopped == "one," and "".join(deltas) == " "
