"""PromptTokenizer (tokenizers + jinja2 only) gives the same ids as the Hugging Face tokenizer."""
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from protos.tokenization import PromptTokenizer

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
