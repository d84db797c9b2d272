"""Fewer, larger stream messages: a stream's deltas merged before they are sent.

Every message a worker sends costs a gRPC write here and a read and a write at each relay (the
router), whatever it carries, so the cost per token falls with tokens per message. Two rules,
per sequence (index) of one request:

- Coalescing: deltas that queued up while the stream's previous message was being sent (its
  consumer is behind, or the event loop was busy) go out as one merged delta, not one each.
- Stream interval (vLLM's --stream-interval N): a sequence's tokens are held until N of them
  wait, except that its first output goes out at once (time to first token is untouched) and
  its last (finished) delta flushes whatever is held. N = 1 holds nothing.

A merged delta is exactly the concatenation of what it replaces: token ids, text and logprobs
concatenated in order; the prompt's scores from the first; finish, stop reason and the usage
counts from the last (they are running totals). Stop strings and the detokenizer's hold-back
happened before (engine): what was held back there is simply not in any delta yet.
"""
from __future__ import annotations

from pagoda.gpu_worker.core.outputs import StreamDelta


def merge(first: StreamDelta, later: StreamDelta) -> StreamDelta:
    """One delta saying what `first` then `later` (same request and index) said."""
    logprobs = None
    if first.logprobs is not None or later.logprobs is not None:
        logprobs = (first.logprobs or []) + (later.logprobs or [])
    return StreamDelta(
        first.request_id, first.index, first.token_ids + later.token_ids, first.text + later.text, logprobs,
        later.finished, later.finish_reason, later.stop_reason, later.num_prompt_tokens,
        later.num_cached_tokens, later.num_output_tokens,
        first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs)


class Coalescer:
    """One request's stream: push() what the engine sent since the last call (in order), get back
    what to send now, at most one delta per sequence."""

    def __init__(self, interval: int = 1):
        if interval < 1:
            raise ValueError(f"stream_interval: must be at least 1 (got {interval})")
        self.interval = interval
        self.held: dict[int, StreamDelta] = {}     # per index: what is not sent yet
        self.started: set[int] = set()             # indices that sent something already

    def push(self, deltas: list[StreamDelta]) -> list[StreamDelta]:
        held = self.held
        for d in deltas:
            prev = held.get(d.index)
            held[d.index] = d if prev is None else merge(prev, d)
        if self.interval == 1:
            out = list(held.values())
            held.clear()
            self.started.update(d.index for d in out)
            return out
        out = []
        for index, d in list(held.items()):
            if d.finished or index not in self.started or len(d.token_ids) >= self.interval:
                out.append(d)
                del held[index]
                self.started.add(index)
        return out
