"""Tokenization without transformers: the same ids and text as the Hugging Face tokenizer.

A router must compute block hashes over exactly the ids a worker will see, but it carries no
torch or transformers. PromptTokenizer rebuilds the tokenizer from the two JSON texts a worker
serves in GetModelInfo (tokenizer.json and tokenizer_config.json) with `tokenizers` and renders
chat templates with a sandboxed jinja2 environment configured as transformers configures its own.
A worker process holds exactly one, which also decodes its output and names its EOS token, as
transformers' fast tokenizer (TokenizersBackend) would for the same files.
"""
from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from typing import Any, Iterable, Mapping

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers leaves clean-up off for BPE models (it would eat spaces before punctuation)
# unless this flag forces it.
_FORCE_BPE_CLEAN_UP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a special token either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes, which would change the rendered prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    # Underscore names on a template namespace are a sandbox-escape vector.
    def __setitem__(self, name, value):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template: namespace attribute {name!r} is not allowed")
        super().__setitem__(name, value)


def _template_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace, dict=dict,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def tokenizer_digest(tokenizer_json: str, tokenizer_config_json: str) -> str:
    """What pins a tokenizer: workers advertise it in their leases, routers check it."""
    h = hashlib.sha256(tokenizer_json.encode())
    h.update(b"\0" + (tokenizer_config_json or "{}").encode())
    return h.hexdigest()[:32]


# transformers' clean_up_tokenization, replacement for replacement and in its order.
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def clean_up_tokenization(text: str) -> str:
    for before, after in _CLEAN_UP:
        text = text.replace(before, after)
    return text


# What a rewrite can span after its space: each of the above, and what the " ' " -> "'" rewrite
# joins for a later one (" n ' t" -> " n't" -> "n't", "  ' s" -> " 's" -> "'s").
_SPANS = (tuple(before[1:] for before, _ in _CLEAN_UP) + ("n ' t",)
          + tuple(" ' " + x for x in ("s", "m", "ve", "re")))
_LONGEST = max(map(len, _SPANS))


def clean_up_cut(text: str, lo: int = 0) -> int:
    """The largest cut in [lo, len(text)] that no clean-up rewrite can span, whatever text
    follows: clean_up_tokenization(text + more) == clean_up(text[:cut]) + clean_up(text[cut:] + more).
    Every rewrite starts at a space, so a cut is safe unless a space just before it begins one
    that reaches past it (or may, once more text comes)."""
    cut = len(text)
    while cut > lo and not _safe_cut(text, cut):
        cut -= 1
    return cut


def _safe_cut(text: str, cut: int) -> bool:
    for j in range(max(0, cut - _LONGEST - 1), cut):
        if text[j] == " ":
            after = text[j + 1:j + 1 + _LONGEST]
            for rest in _SPANS:
                if j + 1 + len(rest) > cut and (after.startswith(rest) or rest.startswith(after)):
                    return False
    return True


class PromptTokenizer:
    """Text and chat messages -> token ids, from tokenizer.json + tokenizer_config.json texts."""

    def __init__(self, tokenizer_json: str, tokenizer_config_json: str = "{}"):
        self.tokenizer_json = tokenizer_json
        self.tokenizer_config_json = tokenizer_config_json or "{}"
        self.config: dict = json.loads(self.tokenizer_config_json)
        self._tok = Tokenizer.from_str(tokenizer_json)
        self.special_tokens = {k: t for k in _NAMED_SPECIAL if (t := _token_text(self.config.get(k)))}
        self._add_missing_special_tokens()
        self._tok.encode_special_tokens = bool(self.config.get("split_special_tokens", False))
        self.chat_template = self._pick_template(self.config.get("chat_template"))
        self._compiled = _template_env().from_string(self.chat_template) if self.chat_template else None
        self.clean_up_tokenization_spaces = bool(self.config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE" or bool(self.config.get(_FORCE_BPE_CLEAN_UP, False)))

    @classmethod
    def from_dir(cls, path: str) -> "PromptTokenizer":
        """From a checkpoint directory; a separate chat_template.jinja (the newer layout) is
        folded into the config so the served config text is self-contained."""
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
            tok_json = f.read()
        cfg_path = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        map_path = os.path.join(path, "special_tokens_map.json")
        if "added_tokens_decoder" not in config and os.path.exists(map_path):
            # transformers' legacy layout: without added_tokens_decoder, this file's named tokens
            # override the config's.
            with open(map_path, encoding="utf-8") as f:
                config.update({k: v for k, v in json.load(f).items()
                               if k in _NAMED_SPECIAL or k in ("additional_special_tokens", "extra_special_tokens")})
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                config["chat_template"] = f.read()
        return cls(tok_json, json.dumps(config))

    @property
    def digest(self) -> str:
        return tokenizer_digest(self.tokenizer_json, self.tokenizer_config_json)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self._tok.token_to_id(eos)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers` object: its decode is decode() before clean_up_tokenization."""
        return self._tok

    def encode_text(self, text: str) -> list[int]:
        """As `hf_tokenizer.encode(text)`: tokenizer.json's post-processor adds any BOS/EOS.
        (transformers ignores add_bos_token/add_eos_token when tokenizer.json exists, so we do too.)"""
        if not isinstance(text, str):
            raise ValueError(f"text: must be a string (got {type(text).__name__})")
        return self._tok.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        if self._compiled is None:
            raise ValueError("messages: this model has no chat template; send text or token_ids")
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        if not chat:
            raise ValueError("messages: must hold at least one message")
        return self._compiled.render(messages=chat, tools=tools or None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def encode_chat(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """As `hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)`: the
        template writes any BOS itself, so no special tokens are added on top."""
        try:
            text = self.render_chat(messages, add_generation_prompt, tools)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"messages: chat template refused them: {e}") from None
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """As `hf_tokenizer.decode(ids, skip_special_tokens=...)`, clean-up of spaces included."""
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def _add_missing_special_tokens(self) -> None:
        # Mirror transformers: added_tokens_decoder entries absent from tokenizer.json, then named
        # and extra special tokens that are not added tokens there (a plain vocabulary entry too,
        # which keeps its id but becomes special), are added as special tokens, in that order.
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        wanted = []
        for _, spec in sorted((self.config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
            # token_to_id, not a copy of a 100k-entry vocabulary (a tenth of a second at start)
            if self._tok.token_to_id(spec["content"]) is None:
                wanted.append(AddedToken(spec["content"], special=spec.get("special", True),
                                         lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                                         normalized=spec.get("normalized", False),
                                         single_word=spec.get("single_word", False)))
        for text in [*self.special_tokens.values(), *self._extra_special_tokens()]:
            if text not in added and all(t.content != text for t in wanted):
                wanted.append(AddedToken(text, special=True))
        if wanted:
            self._tok.add_special_tokens(wanted)

    def _extra_special_tokens(self) -> list[str]:
        # additional_special_tokens is the older name transformers still reads.
        extra = self.config.get("extra_special_tokens") or self.config.get("additional_special_tokens")
        if not isinstance(extra, list):
            return []
        return [t for t in map(_token_text, extra) if t]

    @staticmethod
    def _pick_template(value: Any) -> str | None:
        # A list of named templates is allowed; "default" is the one apply_chat_template uses.
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            return named.get("default")
        return value if isinstance(value, str) else None


def prompt_field(request) -> str:
    """Which of text / messages / token_ids carries a GenerateRequest's (or TokenizeRequest's)
    prompt; ValueError naming the fields when none or several are given."""
    given = [name for name, present in (("text", request.HasField("text")),
                                        ("messages", bool(request.messages)),
                                        ("token_ids", bool(getattr(request, "token_ids", ()))))
             if present]
    if len(given) > 1:
        raise ValueError(f"{', '.join(given)}: give exactly one of text/messages/token_ids")
    if not given:
        raise ValueError("prompt: give one of text, messages or token_ids; the prompt is empty")
    return given[0]


def encode_prompt(tokenizer: PromptTokenizer | None, request) -> tuple[str, list[int]]:
    """(the field that carried the prompt, its token ids), as router and worker both read it.
    The tokenizer is needed only for text and messages."""
    field = prompt_field(request)
    if field == "token_ids":
        return field, list(request.token_ids)
    if tokenizer is None:
        raise ValueError(f"{field}: this server has no tokenizer; send token_ids")
    if field == "text":
        return field, tokenizer.encode_text(request.text)
    agp = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
    chat = [{"role": m.role, "content": m.content} for m in request.messages]
    return field, tokenizer.encode_chat(chat, add_generation_prompt=agp)
