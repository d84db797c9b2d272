"""Structured output: JSON schema, any JSON object, regex or a fixed choice, enforced token by token.

Grammars come from llguidance: it builds a matcher from a JSON schema, a regex or a Lark grammar in
about a millisecond with no per-vocabulary precomputation (the token mask is computed lazily, tens
of microseconds per step, on its own threads with the GIL released), and it needs neither torch nor
transformers (xgrammar requires both, plus its own FFI runtime, and compiles ahead over the whole
vocabulary). vLLM and SGLang offer both engines; llguidance is the lighter of the two.

Flow: the worker's request handler turns a StructuredOutput into a GuidedSpec and compiles it with
GrammarCompiler.compile in a thread, off the engine loop (cached per spec, so a repeated schema
costs nothing; an invalid one is a ValueError naming the request parameter). The CompiledGrammar
rides in SamplingParams.structured_output; each sequence gets its own GrammarState. Before every
sampling step `apply_grammar_masks` brings each constrained row's state up to the tokens it has
accepted since, fills one packed bitmask for those rows in a single parallel call, and sets every
disallowed logit to -inf. Unconstrained rows are not touched.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np
import torch

log = logging.getLogger(__name__)

# The request parameter an error about each kind of structured output names (OpenAI/vLLM names).
PARAM = {"json_schema": "response_format", "json_object": "response_format", "regex": "guided_regex",
         "choice": "guided_choice"}
# Compact JSON: with free whitespace a sampled model can pad forever; a schema's own "x-guidance"
# options still win over these defaults.
_JSON_DEFAULTS: Any = {"whitespace_flexible": False}
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class GuidedSpec:
    """What to enforce, hashable so that compiled grammars can be cached by it."""
    kind: str       # a key of PARAM
    value: str      # schema JSON text, regex, or a JSON list of choices ("" for json_object)

    @property
    def param(self) -> str:
        return PARAM[self.kind]


def spec_from_proto(so) -> GuidedSpec | None:
    """A pagoda.v1 StructuredOutput -> GuidedSpec, None when no field is set."""
    given = [f.name for f, _ in so.ListFields()]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"{PARAM[given[0]]}: give one kind of structured output (got {', '.join(given)})")
    kind = given[0]
    if kind == "choice":
        return GuidedSpec(kind, json.dumps(list(so.choice)))
    return GuidedSpec(kind, "" if kind == "json_object" else getattr(so, kind))


class GrammarState:
    """One sequence's position in its grammar."""
    __slots__ = ("consumed", "eos", "matcher")

    def __init__(self, matcher, eos: list[int]):
        self.matcher, self.consumed, self.eos = matcher, 0, eos

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Advance over the tokens accepted since the last step (one per step while decoding)."""
        new = output_token_ids[self.consumed:]
        if new and not self.matcher.is_error() and not self.matcher.consume_tokens(list(new)):
            log.warning("structured output: a sampled token left the grammar (%s); ending the sequence",
                        self.matcher.get_error())
        self.consumed = len(output_token_ids)


class CompiledGrammar:
    """A grammar checked and built once; new_state() gives each sequence its own copy."""

    def __init__(self, template, eos: list[int]):
        self._template, self._eos = template, eos

    def new_state(self) -> GrammarState:
        return GrammarState(self._template.deep_copy(), self._eos)


class GrammarCompiler:
    """Per worker: the llguidance tokenizer (built on first use) and an LRU cache of compiled grammars."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256):
        self._tokenizer_json, self.vocab_size, self.eos = tokenizer_json, vocab_size, list(eos_token_ids)
        self._tokenizer: llg.LLTokenizer | None = None
        self._cache: OrderedDict[GuidedSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """Thread-safe; ValueError naming spec.param when the schema, regex or choices are invalid."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            if self._tokenizer is None:
                try:
                    self._tokenizer = llg.LLTokenizer(plain_added_tokens(self._tokenizer_json),
                                                      n_vocab=self.vocab_size, eos_token=self.eos)
                except ValueError as e:     # the model's tokenizer, not the request, is at fault
                    raise ValueError(f"{spec.param}: structured output is unavailable for this model's "
                                     f"tokenizer ({_one_line(str(e))})") from None
        grammar, tokenizer = _grammar_text(spec), self._tokenizer
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        template = None if error else llg.LLMatcher(tokenizer, grammar, log_level=0)
        if template is not None and template.is_error():
            error = template.get_error()
        if error:
            raise ValueError(f"{spec.param}: invalid {spec.kind.replace('_', ' ')}: {_one_line(error)}")
        compiled = CompiledGrammar(template, self.eos)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


def plain_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer as llguidance should read it. llguidance takes every added token for a special
    one, whose bytes no grammar can match, so a model that writes an added token that is not
    special (Hermes' `<tool_call>`, which a grammar spells as text) would leave its grammar. Such
    tokens, when their text is printable ASCII (which every BPE vocabulary writes as itself), become
    ordinary entries of the BPE vocabulary in llguidance's copy; the model's tokenizer is unchanged."""
    try:
        tok = json.loads(tokenizer_json)
        vocab, added = tok["model"]["vocab"], tok.get("added_tokens") or []
    except (ValueError, KeyError, TypeError):
        return tokenizer_json              # LLTokenizer names what it cannot read
    if not isinstance(vocab, dict):        # a Unigram model lists its pieces: left as it is
        return tokenizer_json
    moved = [t for t in added if not t.get("special") and isinstance(t.get("content"), str) and t["content"]
             and all(33 <= ord(ch) <= 126 for ch in t["content"]) and vocab.get(t["content"], t["id"]) == t["id"]]
    if not moved:
        return tokenizer_json
    for t in moved:
        vocab[t["content"]] = t["id"]
    tok["added_tokens"] = [t for t in added if t not in moved]
    return json.dumps(tok)


def _grammar_text(spec: GuidedSpec) -> str:
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("guided_choice: give at least one non-empty string")
        return llg.grammar_from("choice", spec.value)
    try:
        schema = json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}
    except ValueError as e:
        raise ValueError(f"response_format: the schema is not valid JSON ({e})") from None
    if not isinstance(schema, dict):   # a request value, so ValueError like every other bad field
        raise ValueError("response_format: the schema must be a JSON object")  # noqa: TRY004
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)


def _one_line(error: str) -> str:
    text = " ".join(error.split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


_executor = None


def apply_grammar_masks(logits: torch.Tensor, states: Sequence[GrammarState | None],
                        outputs: Sequence[Sequence[int]]) -> None:
    """In place: -inf on every token row i's grammar forbids next; rows whose state is None are
    left alone. outputs[i] is row i's accepted output tokens so far."""
    constrained = [(i, s) for i, s in enumerate(states) if s is not None]
    if not constrained:
        return
    global _executor
    if _executor is None:
        _executor = llg.LLExecutor()
    vocab = logits.shape[1]
    packed = np.zeros((len(constrained), (vocab + 31) // 32), dtype=np.int32)
    for i, state in constrained:
        state.sync(outputs[i])
    llg_np.fill_next_token_bitmask_par(_executor, [(s.matcher, k) for k, (_, s) in enumerate(constrained)], packed)
    allowed = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    for k, (_, state) in enumerate(constrained):
        if state.matcher.is_error():            # out of the grammar: all it may do is end
            allowed[k] = False
            allowed[k, state.eos] = True
    index = torch.tensor([i for i, _ in constrained], device=logits.device)
    keep = torch.from_numpy(allowed).to(logits.device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))
