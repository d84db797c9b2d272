"""Checks on a worker's response stream before the router relays it to a client.

A worker is not trusted to follow the protocol. What is checked, and why each matters:
- each response belongs to one of the n sequences (a front indexes its choices by it);
- none comes after its sequence finished (a client would take the stream for complete, or
  count a sequence twice);
- token ids lie inside the vocabulary (clients decode ids themselves; an id past the
  vocabulary crashes a tokenizer);
- a finished response has a known finish reason and non-negative usage (billing reads it), an
  unfinished one none;
- no sequence gets more tokens than the request's max_tokens, counted as relayed and as the
  final usage says (a worker that ignores it would stream, and bill, until the client's deadline);
- the stream ends with every sequence finished (else it was cut short, not complete).

The proxy relays a worker's bytes as they came (router/proxy.py), so the checks read a decoded
copy: upb decodes a delta of a few dozen bytes in a fraction of a microsecond, and what the
checks then read of an unfinished delta is its index, its finished flag and the range of its
token ids (min and max in C, no Python loop per token). A violation raises BadStream and trips the
worker's breaker at once (a protocol breach is no transient failure): before the first response
the router fails over to another worker, after it the client's stream ends with UNAVAILABLE
naming the worker.
"""
from __future__ import annotations

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb

_FINISH_REASONS = {pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ABORT}
_decode = pb.GenerateResponse.FromString


class BadStream(Exception):
    """A worker's stream broke the protocol (the message says how)."""


class StreamChecker:
    def __init__(self, n: int, vocab_size: int, max_tokens: int | None = None):
        self.n, self.vocab_size, self.max_tokens = n, vocab_size, max_tokens
        self.finished: set[int] = set()
        self.sent = [0] * n               # tokens relayed per sequence

    def reset(self) -> None:
        """For the next attempt (another worker) of the same request."""
        self.finished.clear()
        self.sent = [0] * self.n

    def check_raw(self, raw: bytes) -> pb.GenerateResponse:
        """Decode and check one response as the worker sent it; -> the decoded copy."""
        try:
            resp = _decode(raw)
        except Exception as e:      # protobuf's DecodeError, whichever implementation
            raise BadStream(f"a response that does not decode ({e})") from None
        self.check(resp)
        return resp

    def check(self, resp: pb.GenerateResponse) -> None:
        i = resp.index
        if not 0 <= i < self.n:
            raise BadStream(f"index {i} outside [0, {self.n})")
        if i in self.finished:
            raise BadStream(f"a response for sequence {i} after it finished")
        ids = resp.token_ids
        if ids and self.vocab_size and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise BadStream(f"a token id outside the vocabulary [0, {self.vocab_size})")
        self.sent[i] += len(ids)
        if self.max_tokens is not None and self.sent[i] > self.max_tokens:
            raise BadStream(f"sequence {i} past max_tokens={self.max_tokens} ({self.sent[i]} tokens)")
        if not resp.finished:
            if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                raise BadStream("a finish reason on an unfinished sequence")
            return
        if resp.finish_reason not in _FINISH_REASONS:
            raise BadStream(f"unknown finish reason {resp.finish_reason}")
        u = resp.usage
        if min(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens) < 0:
            raise BadStream("negative usage")
        if self.max_tokens is not None and u.completion_tokens > self.max_tokens:
            raise BadStream(f"usage of {u.completion_tokens} completion tokens past max_tokens={self.max_tokens}")
        self.finished.add(i)

    def check_complete(self) -> None:
        if len(self.finished) < self.n:
            raise BadStream(f"the stream ended with {self.n - len(self.finished)} of {self.n} "
                            "sequences unfinished")
