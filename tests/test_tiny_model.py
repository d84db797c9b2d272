"""Tiny checkpoints load in transformers offline, tokenize any text, and give stable, varied greedy text."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from pagoda.gpu_worker.testing.tiny_model import BOS_FAMILIES, BYTE_LEVEL_FAMILIES, FAMILIES, TOOL_CALL_TOKENS, make_tiny_model

TEXTS = ["The quick brown fox", "héllo wörld 東京 🚀 Привет", "def f(x):\n    return x * 2\n",
         "Once upon a time", "  leading spaces and\ttabs", "User: What is 2+2?"]


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_every_family(tiny_model_factory, family):
    path = tiny_model_factory(family)
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.model_type == written["model_type"] == {"gemma3": "gemma3_text"}.get(family, family)
    assert written["architectures"] == [type(transformers.AutoModelForCausalLM.from_config(config)).__name__]
    assert config.num_key_value_heads < config.num_attention_heads       # GQA
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    params = dict(model.named_parameters())
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in params
    if family == "qwen3":
        assert config.head_dim * config.num_attention_heads != config.hidden_size
        assert "model.layers.0.self_attn.q_norm.weight" in params
    assert model.config.vocab_size == len(transformers.AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trips_and_matches_tokenizer_json(tiny_model_factory, family):
    path = tiny_model_factory(family)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    for text in TEXTS:
        ids = hf.encode(text)
        assert ids == raw.encode(text).ids
        assert hf.decode(ids, skip_special_tokens=True) == text
        assert (ids[0] == hf.bos_token_id) == (family in BOS_FAMILIES)
    # Tokens are whole characters (a multi-byte one spans byte-level tokens only in Qwen2's).
    assert (len(hf.encode("東", add_special_tokens=False)) > 1) == (family in BYTE_LEVEL_FAMILIES)


ROUND_TRIP = TEXTS + ["Les élèves étudient à l'école. Über den Wolken – “quoted” … €5 ½",
                      "Γειά σου κόσμε. Привет, как дела? 北京是中国的首都。🙂🚀✨",
                      "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\r\n\n\t  end  "]


def test_every_token_of_the_default_tokenizer_decodes_alone_to_text(tiny_model):
    """Each ordinary token alone decodes to valid text (no U+FFFD), so text round-trips token by
    token, streamed chunks carry whole tokens and clients count the real tokens."""
    from pagoda.runtime.tokenization import PromptTokenizer
    tok = PromptTokenizer.from_dir(tiny_model)
    special = set(tok.backend.get_added_tokens_decoder()) - {tok.token_to_id(t) for t in TOOL_CALL_TOKENS}
    for i in range(tok.vocab_size):
        piece = tok.decode([i], skip_special_tokens=False)
        assert piece and "\ufffd" not in piece, (i, piece)
        assert tok.decode([i], skip_special_tokens=True) == ("" if i in special else piece)
    for text in ROUND_TRIP:
        ids = tok.encode_text(text)[1:]                  # after BOS
        assert tok.decode(ids) == text == "".join(tok.decode([i]) for i in ids)
        assert tok.token_to_id("<unk>") not in ids
    # A character outside the alphabet is the explicit <unk>, not bytes.
    assert tok.encode_text("a\u16a0b")[1:] == [tok.token_to_id("a"), tok.token_to_id("<unk>"), tok.token_to_id("b")]


def test_chat_template_and_eos(tiny_model):
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model)
    msgs = [{"role": "user", "content": "Hi there"}]
    text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == hf.convert_tokens_to_ids("<|im_start|>")
    gen = transformers.GenerationConfig.from_pretrained(tiny_model)
    assert gen.eos_token_id == [hf.eos_token_id, hf.convert_tokens_to_ids("<|im_end|>")]


def _greedy(tok, model, prompt, n=12):
    x = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
    return out[0, x.shape[1]:].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_varies_across_prompts_and_is_stable(tiny_model_factory, family):
    path = tiny_model_factory(family)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = [_greedy(tok, model, p) for p in TEXTS[:4]]
    assert len({tuple(o) for o in outs}) == 4
    assert all(len(set(o)) > 3 for o in outs)          # not one token repeated
    again = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert _greedy(tok, again, TEXTS[0]) == outs[0]


def test_position_and_context_matter(tiny_model):
    """Sharp attention: the same last token after another prefix, or at other positions, differs."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(5, model.config.vocab_size, (1, 40), generator=g)
    y = torch.cat([torch.randint(5, model.config.vocab_size, (1, 39), generator=g), x[:, -1:]], 1)
    with torch.no_grad():
        base = model(x).logits[0, -1]
        other_prefix = model(y).logits[0, -1]
        shifted = model(x, position_ids=torch.arange(40)[None] * 3).logits[0, -1]
    assert (base - other_prefix).abs().max() > 1.0
    assert (base - shifted).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_peaked(tiny_model_factory, family):
    path = tiny_model_factory(family)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.randint(5, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        top2 = model(x).logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    assert margin.median() > 0.5              # nats: far above fp32 noise between implementations


def test_seed_changes_weights_and_same_seed_repeats(tmp_path):
    from safetensors.torch import load_file
    a = load_file(os.path.join(make_tiny_model(str(tmp_path / "a"), seed=1), "model.safetensors"))
    b = load_file(os.path.join(make_tiny_model(str(tmp_path / "b"), seed=1), "model.safetensors"))
    c = load_file(os.path.join(make_tiny_model(str(tmp_path / "c"), seed=2), "model.safetensors"))
    name = "model.embed_tokens.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


def test_cli_and_bad_family(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pagoda.gpu_worker.testing.tiny_model", str(tmp_path / "m"),
                          "--family", "qwen3", "--seed", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.load(open(tmp_path / "m" / "config.json"))["model_type"] == "qwen3"
    with pytest.raises(ValueError, match="family"):
        make_tiny_model(str(tmp_path / "x"), family="gpt2")


def test_vocab_size_trains_the_tokenizer_to_match(tmp_path):
    """vocab_size past what the corpus yields (1024): the tokenizer reaches it exactly, so every id
    the model can emit decodes (bench/vs_vllm.py's 8k-vocabulary model is loaded by vLLM too)."""
    path = make_tiny_model(str(tmp_path / "m"), vocab_size=1280)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["vocab_size"] == 1280
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == 1280
    assert tok.decode(tok.encode("The quick brown fox", add_special_tokens=False)) == "The quick brown fox"
    assert tok.convert_ids_to_tokens(1279) is not None
