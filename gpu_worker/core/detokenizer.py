"""Incremental detokenization and stop strings for one output sequence.

Text grows through `tokenizers`' DecodeStream over the worker's one tokenizer
(pagoda.runtime.tokenization.PromptTokenizer): one native call per token, which decodes a small window
of recent tokens so that a byte-level tokenizer's leading spaces and multi-token characters come
out right, and yields nothing while the window ends in a broken UTF-8 character. Where the
tokenizer config asks transformers to clean up spaces after decoding, the raw text is cut where
no clean-up rewrite can reach across; the part before the cut is cleaned once, the tail after it
at every token and held back while streaming (more tokens may still rewrite it); stop strings
are looked for in the settled text only. While streaming, a tail that could still become a stop
string is held back as well.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from tokenizers.decoders import DecodeStream

from pagoda.runtime.tokenization import PromptTokenizer, clean_up_cut, clean_up_tokenization

# Prompt tokens used as the first window, so the first output token decodes in context.
_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer: PromptTokenizer, prompt_token_ids: list[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend
        self.clean_up = tokenizer.clean_up_tokenization_spaces
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.stream = DecodeStream(ids=list(self.tokens), skip_special_tokens=skip_special_tokens)
        self.read_offset = len(self.tokens)     # tokens up to here are in the text
        self.prefix_offset = 0                  # the window flush() decodes starts here
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.raw = ""                           # before clean-up (only kept when there is one)
        self.raw_cut = 0                        # raw[:raw_cut] is cleaned for good: text[:stable]
        self.stable = 0
        self.text = ""
        self.emitted = 0                    # characters of self.text already streamed
        self.stop_reason: Optional[str] = None
        # No stop strings and no clean-up: nothing rewrites or holds back text, so a piece is
        # streamed as it comes (most requests take only this path, once per token).
        self.plain = not self.stop and not self.clean_up

    def add_token(self, token_id: int, check_stop: bool = True) -> Optional[str]:
        """Append one token; returns the stop string if the new text completes one (the
        text is then truncated there)."""
        self.tokens.append(token_id)
        piece = self.stream.step(self.backend, token_id)
        if not piece:
            return None     # an unfinished character, or nothing visible yet
        if self.plain:
            self.text += piece
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return None
        start = self._extend(piece)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._check_stop(start) if check_stop else None

    def _extend(self, piece: str) -> int:
        """Add raw text; returns where self.text may have changed from."""
        if not self.clean_up:
            self.text += piece
            return len(self.text) - len(piece)
        changed_from = self.stable
        self.raw += piece
        cut = clean_up_cut(self.raw, self.raw_cut)
        stable = self.text[:self.stable] + clean_up_tokenization(self.raw[self.raw_cut:cut])
        self.raw_cut, self.stable = cut, len(stable)
        self.text = stable + clean_up_tokenization(self.raw[cut:])
        return changed_from

    def flush(self) -> None:
        """At the end, keep whatever the window still holds, even a broken character; the
        text is then final (and a stop string in a tail that was still unsettled cuts it)."""
        if self.stop_reason is None and self.read_offset < len(self.tokens):
            before = self.backend.decode(self.tokens[self.prefix_offset:self.read_offset],
                                         skip_special_tokens=self.skip_special)
            after = self.backend.decode(self.tokens[self.prefix_offset:], skip_special_tokens=self.skip_special)
            self._extend(after[len(before):])
            self.read_offset = len(self.tokens)
        if self.clean_up and self.stop_reason is None:
            settled_before, self.stable, self.raw_cut = self.stable, len(self.text), len(self.raw)
            self._check_stop(settled_before)

    def _check_stop(self, new_from: int) -> Optional[str]:
        best = None     # (end, start, stop string): the earliest completed one wins
        # Only in text that clean-up can no longer rewrite.
        settled = self.stable if self.clean_up else len(self.text)
        for s in self.stop:
            i = self.text.find(s, max(0, new_from - len(s) + 1), settled)
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
        if self.plain:
            delta, self.emitted = self.text[self.emitted:], len(self.text)
            return delta
        upto = len(self.text) if finished or self.stop_reason else len(self.text) - self._held_back()
        delta = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return delta

    def _held_back(self) -> int:
        # Clean-up may still rewrite the tail after the cut (" ," -> ","), and a stop string may
        # start before that tail as well as in it.
        unsettled = len(self.text) - self.stable if self.clean_up else 0
        hold = unsettled
        for end in (len(self.text), len(self.text) - unsettled) if unsettled else (len(self.text),):
            beyond = len(self.text) - end
            for s in self.stop:
                for k in range(min(len(s) - 1, end), max(0, hold - beyond), -1):
                    if self.text.endswith(s[:k], 0, end):
                        hold = beyond + k
                        break
        return hold
