"""Incremental detokenization and stop strings for one output sequence.

Text grows by decoding a small window of recent tokens twice (with and without the new
ones) and taking the difference, so a byte-level tokenizer's leading spaces and multi-token
characters come out right without re-decoding the whole output each step. A window that
ends in a broken UTF-8 character waits for the next token. With a Rust (`tokenizers`)
backend that needs no clean-up, the same windowing runs inside `tokenizers`' own
DecodeStream: one native call per token instead of two decodes through transformers.
While streaming, a tail that could still become a stop string is held back.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

# Prompt tokens used as the first window, so the first output token decodes in context.
_CONTEXT_TOKENS = 5


def rust_backend(tokenizer):
    """The Rust tokenizer behind a transformers one, when decoding through it gives the same
    text (transformers' clean-up of spaces is not in it); else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class Detokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.backend = rust_backend(tokenizer)
        self._decode_fn = self.backend.decode if self.backend is not None else tokenizer.decode
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.stream = None
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream
            self.stream = DecodeStream(ids=list(self.tokens), skip_special_tokens=skip_special_tokens)
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.text = ""
        self.emitted = 0                    # characters of self.text already streamed
        self.stop_reason: Optional[str] = None

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int, check_stop: bool = True) -> Optional[str]:
        """Append one token; returns the stop string if the new text completes one (the
        text is then truncated there)."""
        self.tokens.append(token_id)
        if self.stream is not None:
            piece = self.stream.step(self.backend, token_id)
            if not piece:
                return None
            start = len(self.text)
            self.text += piece
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return self._check_stop(start) if check_stop else None
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return None     # an unfinished character, or nothing visible yet
        start = len(self.text)
        self.text += after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._check_stop(start) if check_stop else None

    def flush(self) -> None:
        """At the end, keep whatever the window still holds, even a broken character."""
        if self.stop_reason is None and self.read_offset < len(self.tokens):
            before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            after = self._decode(self.tokens[self.prefix_offset:])
            self.text += after[len(before):]
            self.read_offset = len(self.tokens)

    def _check_stop(self, new_from: int) -> Optional[str]:
        best = None     # (end, start, stop string): the earliest completed one wins
        for s in self.stop:
            i = self.text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return None
        end, start, s = best
        self.text = self.text[:end if self.include_stop else start]
        self.stop_reason = s
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed; while running, minus a tail that may start a stop string."""
        upto = len(self.text) if finished or self.stop_reason else len(self.text) - self._held_back()
        delta = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return delta

    def _held_back(self) -> int:
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold
