"""Small random Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3) with a real BPE tokenizer.

Used by tests, `pagoda up` and `pagoda make-tiny-model`: a directory that transformers loads
offline exactly like a real checkpoint (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json with a ChatML chat template).

Random tiny models have nearly flat logits, so greedy decoding would flip on rounding noise
between implementations. Weights are drawn wider than usual and the final norm is scaled up so
that top-1 margins are large; norm weights and biases are randomised so that a loader that
skips them produces visibly different logits.

    python -m gpu_worker.tiny_model DIR [--family llama|mistral|qwen2|qwen3] [--seed N]
"""
from __future__ import annotations

import argparse
import json
import os

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Enough varied text for a few hundred merges; the byte alphabet covers everything else.
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
"""


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
    raise ValueError(f"family: must be one of {', '.join(FAMILIES)} (got {family!r})")


def build_tokenizer(add_bos: bool):
    """Byte-level BPE trained in-process: any UTF-8 text encodes, multi-byte characters span tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=640, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _init_weights(model, seed: int) -> None:
    """Make logits peaked and every parameter matter (see module docstring)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and name != "model.norm.weight":
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name == "model.norm.weight":
                # Logit scale: unit-RMS hidden state times std-0.1 rows gives std ~0.8;
                # x8 gives a spread of several nats between the best tokens.
                p.copy_(8.0 * (1.0 + 0.1 * torch.randn(p.shape, generator=g)))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_tiny_model(path: str, family: str = "llama", seed: int = 0, **config_overrides) -> str:
    """Write a tiny random checkpoint of `family` into `path` (created) and return `path`."""
    if family not in FAMILIES:
        raise ValueError(f"family: must be one of {', '.join(FAMILIES)} (got {family!r})")
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    add_bos = family in ("llama", "mistral")   # as the real ones: Qwen adds no BOS
    tok = build_tokenizer(add_bos)
    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg_dict = family_config(family, tok.get_vocab_size(), special_ids)
    cfg_dict.update(config_overrides)

    cfg_cls = transformers.AutoConfig.for_model(cfg_dict["model_type"]).__class__
    config = cfg_cls(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path, safe_serialization=True)

    tok.save(os.path.join(path, "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": add_bos, "add_eos_token": False,
        "model_max_length": cfg_dict["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": [IM_START, IM_END],
    }
    _write_json(os.path.join(path, "tokenizer_config.json"), tok_config)
    _write_json(os.path.join(path, "special_tokens_map.json"),
                {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                 "additional_special_tokens": [IM_START, IM_END]})
    # Chat replies end with <|im_end|>, plain text with </s>: both stop generation.
    _write_json(os.path.join(path, "generation_config.json"), {
        "bos_token_id": special_ids[BOS], "eos_token_id": [special_ids[EOS], special_ids[IM_END]],
        "pad_token_id": special_ids[PAD], "do_sample": False})
    return path


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gpu_worker.tiny_model",
                                description="Write a tiny random Hugging Face checkpoint.")
    p.add_argument("path", help="output directory (created)")
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(make_tiny_model(args.path, family=args.family, seed=args.seed))


if __name__ == "__main__":
    main()
