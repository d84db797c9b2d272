"""Small random Hugging Face checkpoints of every family in the parity matrix, with a real BPE tokenizer
(over characters, so that every token decodes to valid text on its own).

Native families (Llama, Mistral, Qwen2, Qwen3) and transformers-backend families (Gemma 2, Gemma 3
text, Phi-3, OLMo 2, Granite, Mixtral, Qwen3-MoE). Each non-native family turns on what makes it
different: Gemma 2 alternating sliding windows, attention and final soft-capping and
query_pre_attn_scalar; Gemma 3 local/global rope and q/k norms; Granite's multipliers; the MoE
families several experts with top-2 routing.

Used by tests, `pagoda up` and `pagoda make-tiny-model`: a directory that transformers loads
offline exactly like a real checkpoint (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json with a ChatML chat template).

Weights are drawn here with numpy under HF's parameter names (for the native families without
importing torch or transformers, so the default CLI is quick; the other families take their
parameter names and shapes from transformers' model built on the meta device). Random tiny
models have nearly flat logits, so greedy decoding would flip on rounding noise between
implementations. Weights are drawn wider than usual and the final norm is scaled up so that
top-1 margins are large; q/k weights are wider still so that attention is sharp (near
uniform attention would hide rope and masking errors); norm weights and biases are randomised
so that a loader that skips them produces visibly different logits.

    python -m pagoda.gpu_worker.testing.tiny_model DIR [--family F] [--seed N]
"""
from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

NATIVE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TRANSFORMERS_FAMILIES = ("gemma2", "gemma3", "phi3", "olmo2", "granite", "mixtral", "qwen3_moe")
FAMILIES = NATIVE_FAMILIES + TRANSFORMERS_FAMILIES
# As the real ones: Qwen, OLMo and Granite add no BOS.
BOS_FAMILIES = ("llama", "mistral", "gemma2", "gemma3", "phi3", "mixtral")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 keeps a byte-level BPE (build_tokenizer says why); every other family's tokens are characters.
BYTE_LEVEL_FAMILIES = ("qwen2",)
# Gemma-style RMSNorm multiplies by (1 + weight).
_NORM_PLUS_ONE = ("gemma2", "gemma3_text")

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# <unk> last, so that the other ids stay what they were (pad 0, bos 1, eos 2, im 3 and 4).
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END, UNK]
# Hermes-style tool-call tags: one token each, not special (skip_special_tokens keeps them).
TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]
VOCAB_SIZE = 1024          # with the tool-call tokens; a multiple of 4 for tensor-parallel tests
BYTE_LEVEL_VOCAB_SIZE = 640  # the corpus holds fewer byte-level merges

# ChatML. With `tools`, a system turn lists them and says how to call one; an assistant turn's
# tool_calls and a `tool` turn's result are written in the Hermes form that
# `--tool-call-parser hermes` reads back. Without tools the text is plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'Tools you may call, one JSON signature per line:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call one, answer <tool_call>{\\\"name\\\": NAME, \\\"arguments\\\": {...}}</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>{\\\"name\\\": ' + (f['name'] | tojson) + ', \\\"arguments\\\": ' }}"
    "{{- (f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson)) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Enough varied text for the merges; the character alphabet (_alphabet) covers the rest.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged cache keeps keys and values in blocks.
Once upon a time there was a small model that answered questions about the weather, the sea,
the mountains and the stars. It liked to count: one, two, three, four, five, six, seven, eight.
Requests arrive at the router, which sends each one to the worker that holds its prefix.
def main():\n    for i in range(10):\n        print(i * i)\n    return {"ok": True}
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Summarise this document in three sentences. Assistant: Here is a short summary.
Les élèves étudient la physique à l'école. Über den Wolken muss die Freiheit grenzenlos sein.
東京は日本の首都です。北京是中国的首都。Привет, как дела? Γειά σου κόσμε. ¡Hola, señor!
Numbers 0123456789, symbols !@#$%^&*()[]{}<>?/\\|~`+-=_;:'", and emoji 🙂🚀✨ are text too.
In the beginning the engine scheduled every running request before any waiting request,
and when blocks ran out it preempted the newest one and recomputed it later from its prompt.
Hello, how are you today? I am fine, thank you, and I hope that you are well and happy.
She said that they would be there in the morning, but he was not sure what time it was.
We have been working on this for a long time, and we will keep going until it is done.
This is a good question. Let me think about it for a moment before I give you an answer.
The people of the city were very proud of their new bridge, which was built of stone.
There are many ways to solve a problem; some of them are simple and some are not.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
"""


def _alphabet() -> list[str]:
    """Every character a token starts from: ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic and
    common punctuation; spaces are "▁" inside the model (Llama's convention, so that llguidance
    reads the vocabulary). A character outside it and the corpus encodes as <unk>."""
    ranges = [(0x20, 0x7E), (0xA1, 0xFF), (0x100, 0x17F), (0x391, 0x3A9), (0x3B1, 0x3C9), (0x400, 0x45F),
              (0x2013, 0x2014), (0x2018, 0x201E), (0x2020, 0x2022), (0x2026, 0x2026), (0x20AC, 0x20AC)]
    chars = [chr(c) for lo, hi in ranges for c in range(lo, hi + 1)] + ["\n", "\t", "\r"]
    return [c.replace(" ", "\u2581") for c in chars]

def family_config(family: str, vocab_size: int, special_ids: dict[str, int]) -> dict:
    """The config.json dict for a family, with the real model_type and architectures."""
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        hidden_act="silu", vocab_size=vocab_size, initializer_range=0.1, attention_dropout=0.0,
        bos_token_id=special_ids[BOS], eos_token_id=special_ids[EOS], pad_token_id=special_ids[PAD],
        torch_dtype="float32", use_cache=True,
    )
    if family == "llama":
        return dict(common, model_type="llama", architectures=["LlamaForCausalLM"],
                    rope_theta=10000.0, attention_bias=False, mlp_bias=False,
                    tie_word_embeddings=False, head_dim=16)
    if family == "mistral":
        return dict(common, model_type="mistral", architectures=["MistralForCausalLM"],
                    rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False,
                    head_dim=16)
    if family == "qwen2":
        # Qwen2 carries a bias on q/k/v (hard-wired in its attention) and ties embeddings.
        return dict(common, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                    rope_theta=1000000.0, use_sliding_window=False, sliding_window=None,
                    max_window_layers=2, tie_word_embeddings=True)
    if family == "qwen3":
        # Qwen3: explicit head_dim (not hidden / heads) and per-head q/k RMSNorm.
        return dict(common, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                    rope_theta=1000000.0, head_dim=32, attention_bias=False,
                    use_sliding_window=False, sliding_window=None, max_window_layers=2,
                    tie_word_embeddings=True)
    # The Gemmas: one sliding-window layer, one global, with a window shorter than most prompts.
    gemma = dict(head_dim=16, sliding_window=48, layer_types=["sliding_attention", "full_attention"],
                 query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False)
    if family == "gemma2":
        return dict(common, **gemma, model_type="gemma2", architectures=["Gemma2ForCausalLM"],
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if family == "gemma3":
        return dict(common, **gemma, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    if family == "phi3":
        return dict(common, model_type="phi3", architectures=["Phi3ForCausalLM"], rope_theta=10000.0,
                    original_max_position_embeddings=1024, tie_word_embeddings=False)
    if family == "olmo2":
        return dict(common, model_type="olmo2", architectures=["Olmo2ForCausalLM"], rope_theta=10000.0,
                    tie_word_embeddings=False)
    if family == "granite":
        # Multipliers on embeddings, residuals, attention scores (the scale) and logits.
        return dict(common, model_type="granite", architectures=["GraniteForCausalLM"], rope_theta=10000.0,
                    embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1,
                    logits_scaling=0.5, tie_word_embeddings=False)
    if family == "mixtral":
        return dict(common, model_type="mixtral", architectures=["MixtralForCausalLM"], rope_theta=1000000.0,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=None, head_dim=16,
                    tie_word_embeddings=False)
    if family == "qwen3_moe":
        return dict(common, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], rope_theta=1000000.0,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                    sliding_window=None, tie_word_embeddings=False)
    raise ValueError(f"family: must be one of {', '.join(FAMILIES)} (got {family!r})")


def build_tokenizer(add_bos: bool, byte_level: bool = False, vocab_size: int | None = None):
    """A BPE over characters, trained in-process: every token is whole characters, so each one
    decodes to valid text on its own (a byte-level BPE splits a multi-byte character over
    tokens that decode alone to U+FFFD), and text round-trips exactly. A character outside the
    alphabet is the explicit <unk>. Laid out as Llama 2's tokenizer.json (spaces as "\u2581", a
    Replace + ByteFallback + Fuse decoder; no byte tokens exist, so ByteFallback never fires),
    which transformers, `tokenizers` and llguidance all read.

    byte_level: a byte-level BPE instead, for Qwen2: transformers rebuilds a qwen2 checkpoint's
    tokenizer in Qwen2's byte-level layout whatever tokenizer.json says.
    vocab_size: the whole vocabulary, tool-call tokens included (default VOCAB_SIZE, or
    BYTE_LEVEL_VOCAB_SIZE). Past what the corpus yields, seeded made-up words (syllables of a
    consonant and a vowel) give the trainer enough pairs to reach it exactly."""
    natural = BYTE_LEVEL_VOCAB_SIZE if byte_level else VOCAB_SIZE
    vocab = (vocab_size or natural) - len(TOOL_CALL_TOKENS)
    if byte_level:
        tok = Tokenizer(models.BPE())
        # Qwen2's own layout (NFC, its split pattern, then bytes), which transformers rebuilds.
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token=UNK))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(
            Regex("\u2581?\\p{L}+|\u2581?\\p{N}|\u2581?[^\u2581\\s\\p{L}\\p{N}]+|\\s|\u2581"),
            behavior="isolated")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        alphabet = _alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=alphabet, limit_alphabet=10_000, show_progress=False)
    extra = _made_up_lines(vocab_size) if vocab_size and vocab_size > natural else []
    tok.train_from_iterator([CORPUS] + extra, trainer=trainer)
    if tok.get_vocab_size() != vocab:     # a shorter corpus would change the model's shapes
        raise ValueError(f"vocab_size: the tokenizer reached {tok.get_vocab_size() + len(TOOL_CALL_TOKENS)} "
                         f"tokens, not {vocab + len(TOOL_CALL_TOKENS)}")
    tok.add_tokens(TOOL_CALL_TOKENS)
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def _made_up_lines(vocab_size: int) -> list[str]:
    """Extra training text for vocabularies past what CORPUS yields."""
    rng = random.Random(vocab_size)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3 * vocab_size)]
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(vocab_size // 2)]


def tiny_weights(cfg: dict, seed: int) -> dict:
    """HF-named float32 arrays for `cfg`, drawn so that logits are peaked (module docstring)."""
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    qwen2, qwen3 = cfg["model_type"] == "qwen2", cfg["model_type"] == "qwen3"
    attn_bias, mlp_bias = bool(cfg.get("attention_bias")), bool(cfg.get("mlp_bias"))

    def normal(std, *shape):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def norm_weight(dim, scale=1.0):
        return (scale * (1.0 + 0.2 * rng.standard_normal(dim))).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(0.1, vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(hidden)
        w[p + "post_attention_layernorm.weight"] = norm_weight(hidden)
        # Wide q/k give sharp attention: positions (rope) and context visibly matter.
        w[p + "self_attn.q_proj.weight"] = normal(0.3, heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(0.3, kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(0.1, kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = normal(0.1, hidden, heads * head_dim)
        if qwen2 or attn_bias:
            for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                w[p + f"self_attn.{name}_proj.bias"] = normal(0.1, rows * head_dim)
        if attn_bias:
            w[p + "self_attn.o_proj.bias"] = normal(0.1, hidden)
        if qwen3:
            w[p + "self_attn.q_norm.weight"] = norm_weight(head_dim, 3.0)
            w[p + "self_attn.k_norm.weight"] = norm_weight(head_dim, 3.0)
        w[p + "mlp.gate_proj.weight"] = normal(0.1, inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(0.1, inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(0.1, hidden, inter)
        if mlp_bias:
            for name, dim in (("gate", inter), ("up", inter), ("down", hidden)):
                w[p + f"mlp.{name}_proj.bias"] = normal(0.1, dim)
    # Logit scale: unit-RMS hidden state times std-0.1 rows gives std ~0.8; x8 spreads the
    # best tokens several nats apart.
    w["model.norm.weight"] = norm_weight(hidden, 8.0)
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = normal(0.1, vocab, hidden)
    return w


def transformers_weights(cfg: dict, seed: int) -> dict:
    """Weights for any family, named and shaped by transformers' own model of `cfg` (built on the
    meta device, so nothing is allocated), drawn by the same rules as tiny_weights."""
    # lazy: torch and transformers only for the non-native families (module docstring)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **fields))
    rng = np.random.default_rng(seed)
    plus_one = cfg["model_type"] in _NORM_PLUS_ONE
    w = {}
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if len(shape) == 1 and "norm" in name:
            # Final norm x8 for peaked logits (module docstring); q/k norms x3 for sharp attention.
            scale = 8.0 if name == "model.norm.weight" else 3.0 if ("q_norm" in name or "k_norm" in name) else 1.0
            w[name] = (scale * (1.0 + 0.2 * rng.standard_normal(shape)) - plus_one).astype(np.float32)
            continue
        if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
            std = 0.3
        elif name == "model.embed_tokens.weight" and plus_one:
            # Gemma multiplies embeddings by sqrt(hidden): undo it, or the input token's own
            # embedding dominates the residual stream and greedy text repeats it.
            std = 0.1 / cfg["hidden_size"] ** 0.5
        elif name.endswith("mlp.gate.weight"):
            std = 1.0   # decisive routing: no near-ties between experts
        else:
            std = 0.1
        w[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return w


def make_tiny_model(path: str, family: str = "llama", seed: int = 0, vocab_size: int | None = None,
                    **config_overrides) -> str:
    """Write a tiny random checkpoint of `family` into `path` (created) and return `path`.

    `vocab_size` trains the tokenizer to that many tokens, so that the model's and the
    tokenizer's vocabularies agree (default: build_tokenizer's)."""
    if family not in FAMILIES:
        raise ValueError(f"family: must be one of {', '.join(FAMILIES)} (got {family!r})")
    os.makedirs(path, exist_ok=True)
    add_bos = family in BOS_FAMILIES
    tok = build_tokenizer(add_bos, byte_level=family in BYTE_LEVEL_FAMILIES, vocab_size=vocab_size)
    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = family_config(family, tok.get_vocab_size(), special_ids)
    cfg.update(config_overrides)
    _write_json(os.path.join(path, "config.json"), cfg)
    weights = tiny_weights(cfg, seed) if family in NATIVE_FAMILIES else transformers_weights(cfg, seed)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    tok.save(os.path.join(path, "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "add_bos_token": add_bos, "add_eos_token": False,
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": [IM_START, IM_END],
    }
    _write_json(os.path.join(path, "tokenizer_config.json"), tok_config)
    _write_json(os.path.join(path, "special_tokens_map.json"),
                {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
                 "additional_special_tokens": [IM_START, IM_END]})
    # Chat replies end with <|im_end|>, plain text with </s>: both stop generation.
    _write_json(os.path.join(path, "generation_config.json"), {
        "bos_token_id": special_ids[BOS], "eos_token_id": [special_ids[EOS], special_ids[IM_END]],
        "pad_token_id": special_ids[PAD], "do_sample": False})
    return path


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_tiny_lora(path: str, base: str, seed: int = 0, rank: int = 8, alpha: float = 16.0,
                   targets: tuple[str, ...] = LORA_TARGETS, use_rslora: bool = False) -> str:
    """Write a random PEFT LoRA adapter for the checkpoint in `base` into `path` (created):
    adapter_config.json and adapter_model.safetensors under PEFT's names. A and B are both drawn
    non-zero (PEFT starts B at zero, which would change nothing) and large enough that the
    adapter visibly changes greedy outputs while logits stay peaked."""
    with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    rng = np.random.default_rng(1000 + seed)
    w = {}
    for i in range(cfg["num_hidden_layers"]):
        for t in targets:
            fan_in, fan_out = shapes[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{t}"
            w[f"{key}.lora_A.weight"] = (0.1 * rng.standard_normal((rank, fan_in))).astype(np.float32)
            w[f"{key}.lora_B.weight"] = (0.1 * rng.standard_normal((fan_out, rank))).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(w, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(path, "adapter_config.json"), {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": use_rslora, "modules_to_save": None})
    return path


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pagoda.gpu_worker.testing.tiny_model",
                                description="Write a tiny random Hugging Face checkpoint.")
    p.add_argument("path", help="output directory (created)")
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(make_tiny_model(args.path, family=args.family, seed=args.seed))


if __name__ == "__main__":
    main()
