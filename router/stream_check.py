"""Checks on a worker's response stream before the router relays it to a client.

A worker is not trusted to follow the protocol: each response must belong to one of the n
sequences, carry token ids inside the vocabulary and non-negative usage, finish with a known
reason, and come before its sequence finished; the stream must end with every sequence
finished. A violation raises BadStream: before the first response the router fails over to
another worker, after it the client's stream ends with UNAVAILABLE naming the worker.
"""
from __future__ import annotations

from protos.pagoda.v1 import pagoda_pb2 as pb

_FINISH_REASONS = {pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ABORT}


class BadStream(Exception):
    """A worker's stream broke the protocol (the message says how)."""


class StreamChecker:
    def __init__(self, n: int, vocab_size: int):
        self.n, self.vocab_size = n, vocab_size
        self.finished: set[int] = set()

    def reset(self) -> None:
        """For the next attempt (another worker) of the same request."""
        self.finished.clear()

    def check(self, resp: pb.GenerateResponse) -> None:
        if not 0 <= resp.index < self.n:
            raise BadStream(f"index {resp.index} outside [0, {self.n})")
        if resp.index in self.finished:
            raise BadStream(f"a response for sequence {resp.index} after it finished")
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in resp.token_ids):
            raise BadStream(f"a token id outside the vocabulary [0, {self.vocab_size})")
        if not resp.finished:
            if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                raise BadStream("a finish reason on an unfinished sequence")
            return
        if resp.finish_reason not in _FINISH_REASONS:
            raise BadStream(f"unknown finish reason {resp.finish_reason}")
        u = resp.usage
        if min(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens) < 0:
            raise BadStream("negative usage")
        self.finished.add(resp.index)

    def check_complete(self) -> None:
        if len(self.finished) < self.n:
            raise BadStream(f"the stream ended with {self.n - len(self.finished)} of {self.n} "
                            "sequences unfinished")
