"""PromptTokenizer (tokenizers + jinja2 only) gives the same ids, text and EOS as the Hugging Face tokenizer."""
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pagoda.runtime.tokenization import PromptTokenizer, clean_up_cut, clean_up_tokenization

transformers = pytest.importorskip("transformers")

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs!",
          "pagoda serves language models over gRPC; routers pick workers by prefix.",
          "Ünïcödé text, emoji 🙂 and numbers 12345 also appear."] * 20

LLAMA_STYLE = ("{{ bos_token }}{% for m in messages %}"
               "{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>\n"
               "{% else %}[{{ m['role'] | upper }}] {{ m['content'] | trim }}{{ eos_token }}\n{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
CHATML_STYLE = ("{%- for message in messages %}\n    {{- '<|im_start|>' + message.role + '\\n' + message.content"
                " + '<|im_end|>\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
                "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

MESSAGES = [[{"role": "user", "content": "Hello there"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is 2+2?  "},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 🙂?"}]]
TEXTS = ["", "hello", "The quick brown fox", "  leading spaces and trailing  ", "Ünïcödé 🙂 12345",
         "literal <s> and </s> in text"]


def _train(specials, post_processor=None) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if post_processor is not None:
        tok.post_processor = post_processor
    return tok


def _write(path, tok, config, jinja=None):
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return str(path)


@pytest.fixture(params=["llama_bos_flag", "chatml_jinja_file", "post_processor_in_json", "eos_flag_and_dict_tokens"])
def tokenizer_dir(request, tmp_path):
    kind = request.param
    if kind == "llama_bos_flag":
        tok = _train(["<unk>", "<s>", "</s>"])
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>", "add_bos_token": True, "chat_template": LLAMA_STYLE}
        return _write(tmp_path / kind, tok, cfg)
    if kind == "chatml_jinja_file":
        tok = _train(["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"])
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        return _write(tmp_path / kind, tok, cfg, jinja=CHATML_STYLE)
    if kind == "post_processor_in_json":
        tok = _train(["<unk>", "<s>", "</s>"])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "chat_template": LLAMA_STYLE}
        return _write(tmp_path / kind, tok, cfg)
    tok = _train(["<unk>", "<s>"])
    # eos not in tokenizer.json: both sides must append it as a special token.
    # transformers ignores add_*_token when tokenizer.json exists; ours must too.
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast",
           "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
           "eos_token": {"__type": "AddedToken", "content": "<eos>", "special": True},
           "add_bos_token": False, "add_eos_token": True,
           "chat_template": [{"name": "default", "template": LLAMA_STYLE}, {"name": "other", "template": "x"}]}
    return _write(tmp_path / kind, tok, cfg)


def test_text_ids_match_hf(tokenizer_dir):
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ours = PromptTokenizer.from_dir(tokenizer_dir)
    for text in TEXTS:
        assert ours.encode_text(text) == hf.encode(text), text
    assert ours.vocab_size == len(hf)


def test_chat_ids_match_hf(tokenizer_dir):
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ours = PromptTokenizer.from_dir(tokenizer_dir)
    for msgs in MESSAGES:
        for agp in (True, False):
            want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp, return_dict=False)
            assert ours.encode_chat(msgs, add_generation_prompt=agp) == list(want)


def test_served_texts_rebuild_the_same_tokenizer(tokenizer_dir):
    # A router builds from the two texts a worker serves; the result must not depend on the dir.
    a = PromptTokenizer.from_dir(tokenizer_dir)
    b = PromptTokenizer(a.tokenizer_json, a.tokenizer_config_json)
    for msgs in MESSAGES:
        assert a.encode_chat(msgs) == b.encode_chat(msgs)
    assert a.encode_text("hello world") == b.encode_text("hello world")


def test_no_template_and_bad_messages_name_the_field(tmp_path):
    d = _write(tmp_path / "plain", _train(["<unk>"]), {})
    tok = PromptTokenizer.from_dir(d)
    with pytest.raises(ValueError, match="messages"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="text"):
        tok.encode_text(123)


def test_template_raise_exception_becomes_value_error(tmp_path):
    cfg = {"chat_template": "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
                            "{% endif %}{{ messages[0].content }}"}
    tok = PromptTokenizer.from_dir(_write(tmp_path / "strict", _train(["<unk>"]), cfg))
    with pytest.raises(ValueError, match="messages.*first must be user"):
        tok.encode_chat([{"role": "system", "content": "x"}])
    assert tok.encode_chat([{"role": "user", "content": "fox"}]) == tok.encode_text("fox")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_model_tokenizer_matches_hf(tiny_model_factory, family):
    d = tiny_model_factory(family)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    ours = PromptTokenizer.from_dir(d)
    for text in TEXTS:
        assert ours.encode_text(text) == hf.encode(text), text
    for msgs in MESSAGES:
        want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ours.encode_chat(msgs) == list(want)


def _word_level() -> Tokenizer:
    # Not BPE, so transformers honours clean_up_tokenization_spaces; "</s>", "!", "it" and "x" are
    # plain vocabulary entries until a config names them special.
    words = ["<unk>", "hello", "world", "</s>", "<s>", ".", ",", "!", "?", "'s", "it", "n't", "do", "'", "x"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


DECODE_CASES = {
    "clean_up": (_word_level, {"eos_token": "</s>", "bos_token": "<s>", "clean_up_tokenization_spaces": True}, None),
    "extra_special_in_vocab": (_word_level, {"eos_token": "</s>", "additional_special_tokens": ["x"]}, None),
    "legacy_special_tokens_map": (_word_level, {"eos_token": "</s>"}, {"eos_token": "!", "additional_special_tokens": ["it"]}),
    "bpe_clean_up_ignored": (lambda: _train(["<unk>", "<s>", "</s>"]),
                             {"eos_token": "</s>", "clean_up_tokenization_spaces": True}, None),
    "bpe_clean_up_forced": (lambda: _train(["<unk>", "<s>", "</s>"]),
                            {"eos_token": "</s>", "clean_up_tokenization_spaces": True,
                             "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}, None),
}


def _assert_decodes_like_hf(hf, ours):
    import random
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
    for text in TEXTS + ["hello world . it 's ! do n't , x ?"]:     # what clean-up rewrites
        ids = hf.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.decode([hf.eos_token_id]) == hf.decode([hf.eos_token_id])      # both default to keeping it
    assert ours.eos_token_id == hf.eos_token_id and ours.eos_token == hf.eos_token
    assert ours.vocab_size == len(hf)


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_eos_and_ids_match_hf(tmp_path, case):
    # What a worker needs beyond prompts (its one tokenizer also detokenizes and names EOS).
    build, cfg, special_tokens_map = DECODE_CASES[case]
    d = _write(tmp_path / case, build(), {"tokenizer_class": "PreTrainedTokenizerFast", **cfg})
    if special_tokens_map is not None:
        (tmp_path / case / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    hf = transformers.AutoTokenizer.from_pretrained(d)
    ours = PromptTokenizer.from_dir(d)
    _assert_decodes_like_hf(hf, ours)
    for text in TEXTS + ["hello world . it 's ! x do n't", "hello </s> world <s> it x"]:
        assert ours.encode_text(text) == hf.encode(text), text
    # The served texts carry all of it (a router rebuilds the same tokenizer).
    again = PromptTokenizer(ours.tokenizer_json, ours.tokenizer_config_json)
    assert (again.eos_token_id, again.clean_up_tokenization_spaces) == (ours.eos_token_id, ours.clean_up_tokenization_spaces)
    assert again.decode(list(range(len(hf)))) == ours.decode(list(range(len(hf))))


def test_clean_up_follows_the_backend_decode(tmp_path):
    build, cfg, _ = DECODE_CASES["clean_up"]
    ours = PromptTokenizer.from_dir(_write(tmp_path / "c", build(), cfg))
    assert ours.clean_up_tokenization_spaces and ours.backend.decode([1, 5, 10, 9]) == "hello . it 's"
    assert ours.decode([1, 5, 10, 9]) == "hello. it's"       # not "hello . it 's"


def test_decode_and_eos_match_hf_on_fixtures(tokenizer_dir):
    _assert_decodes_like_hf(transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
                            PromptTokenizer.from_dir(tokenizer_dir))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_model_decode_and_eos_match_hf(tiny_model_factory, family):
    d = tiny_model_factory(family)
    _assert_decodes_like_hf(transformers.AutoTokenizer.from_pretrained(d), PromptTokenizer.from_dir(d))


def test_clean_up_cut_is_never_spanned_by_a_rewrite():
    # What lets the detokenizer clean up streamed text once: whatever follows, the text before
    # the cut cleans up on its own. The " ' " rewrite joins text for later ones (" n ' t").
    import random
    rng = random.Random(0)
    for a, b in [("xvs n ' ", "tr."), ("?v  ", "' sx"), ("it ", "'s"), ("a ' ", "s"), ("a b", " ,")]:
        cut = clean_up_cut(a)
        assert clean_up_tokenization(a + b) == clean_up_tokenization(a[:cut]) + clean_up_tokenization(a[cut:] + b)
    for _ in range(20000):
        a, b = ("".join(rng.choice("   ''.ntsvermx,?!") for _ in range(rng.randrange(n))) for n in (14, 8))
        cut = clean_up_cut(a)
        assert clean_up_tokenization(a + b) == clean_up_tokenization(a[:cut]) + clean_up_tokenization(a[cut:] + b)
    assert clean_up_cut("hello world") == 11 and clean_up_cut("a b c d") == 7    # nothing to hold
    assert clean_up_cut("hello ") == 5 and clean_up_cut("do n'") == 2
