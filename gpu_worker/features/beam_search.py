"""Beam search inside the engine: beams are sequences that share KV blocks, copy-on-write.

vLLM (V1) runs beam search as a driver outside its engine: every step each beam becomes a
fresh one-token request with logprobs=2*beam_width, and siblings meet again only through the
prefix cache. That shares full blocks at best, recomputes every beam's partial last block
each step, and re-reads whole prompts through the cache lookups (bench/beam.py: the same
blocks held, at half the beam tokens per second). pagoda does it the way the PagedAttention
paper describes instead, inside the engine:

- A beam is a `Request` of the scheduler. Its step computes the logits of its last token and
  comes back with the top 2 * beam_width raw log-probabilities (and the sampled token, as
  vLLM's logprobs dict holds it), but nothing is appended: the beam is *ready* and sits out
  (its KV stays) until every live beam of its group is ready.
- Then the group keeps the beam_width best continuations (vLLM's rules, below), and each
  becomes a child forked from its parent: the child's block table is the parent's, every
  block shared by reference count (`KVCacheManager.fork`). The parents end and drop their
  references; a parent that no child continues frees its blocks there.
- Copy-on-write: when a child first writes its partial last block and the block is still
  shared (ref count > 1), `allocate_slots` gives it a new block and records a copy, which the
  runner performs before the step's forward (`ModelRunner.copy_blocks`). The last sibling to
  write finds the block its own and writes in place; full blocks are never copied.

Scoring is vLLM's: candidates are every (beam, token) in the beams' top lists, scored by
cumulative log-probability; a candidate that the stop rule (core/stop.py) ends by its token (EOS
unless ignore_eos) is complete, the others are ranked and the best beam_width run on, those
the rule ends by length (max_tokens, max_model_len) complete too. When no beam is left the
complete beams are ranked by cum_logprob / len ** length_penalty, len counting the prompt and
not a final EOS (`beam_score`), and the best come back.

A ready beam that the scheduler must preempt (blocks or sequence slots run out) leaves the
scheduler with its candidates kept; its children then start as waiting requests and
recompute their prefix (full blocks come back from the prefix cache).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pagoda.gpu_worker.core.outputs import TokenLogprobs
from pagoda.gpu_worker.core.stop import STOP_TOKEN


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: what LLM.beam_search takes."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0


@dataclass
class BeamSearchSequence:
    """One finished beam. tokens includes the prompt, as vLLM's does."""
    tokens: list[int]
    output_token_ids: list[int]
    cum_logprob: float
    score: float
    text: str = ""
    finish_reason: str = "length"           # "stop": it ended in EOS


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""
    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)


def beam_score(num_tokens: int, ends_in_eos: bool, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: cum_logprob / len ** length_penalty, where len counts the
    prompt and every output token but a final EOS."""
    n = num_tokens - (1 if ends_in_eos else 0)
    return cum_logprob / (max(n, 1) ** length_penalty)


@dataclass
class Candidate:
    parent: int                  # index of the beam it continues
    token: int
    cum_logprob: float


def candidates(beam_lps: Sequence[tuple[float, int, TokenLogprobs]]) -> list[Candidate]:
    """Every continuation the beams' steps offer: per beam (its cum_logprob, its sampled token,
    its logprobs), the top tokens then the sampled one when it is not among them."""
    out = []
    for i, (cum, sampled, lps) in enumerate(beam_lps):
        seen = set()
        for lp in lps.top:
            out.append(Candidate(i, lp.token_id, cum + lp.logprob))
            seen.add(lp.token_id)
        if sampled not in seen:
            out.append(Candidate(i, sampled, cum + lps.sampled.logprob))
    return out


def select(cands: list[Candidate], flags: Sequence[int], width: int
           ) -> tuple[list[tuple[Candidate, int]], list[Candidate]]:
    """(running: the best `width` candidates no stop token ends, best first, with their flags;
    complete: every one a stop token ends). flags[i]: cands[i]'s finish flags (core/stop.py)."""
    done = [c for c, f in zip(cands, flags) if f & STOP_TOKEN]
    run = [(c, f) for c, f in zip(cands, flags) if not f & STOP_TOKEN]
    # Beams of one group have equal lengths, so ranking by score is ranking by cum_logprob;
    # sorted() is stable, so ties keep candidate order.
    run.sort(key=lambda cf: cf[0].cum_logprob, reverse=True)
    return run[:width], done


def rank(seqs: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
    return sorted(seqs, key=lambda s: s.score, reverse=True)


@dataclass
class BeamGroup:
    """One caller request's search: its live beams (engine Requests) with their cumulative
    log-probabilities, and the beams already complete."""
    request_id: str
    prompt_token_ids: list[int]
    width: int
    n: int
    max_tokens: int
    stop_ids: list[int]              # the tokens that end a beam: EOS, unless ignore_eos
    length_penalty: float
    beams: list = field(default_factory=list)          # live pagoda.gpu_worker.core.request.Request
    cum: dict[str, float] = field(default_factory=dict)    # req_id -> cum_logprob
    completed: list[BeamSearchSequence] = field(default_factory=list)
    steps: int = 0
    forks: int = 0                    # serial for child ids
    num_cached_tokens: int = 0
    # Test and bench hook: the most blocks any two beams of the group shared at once.
    max_shared_blocks: int = 0

    def finish_beam(self, tokens: list[int], cum: float, eos_ids: Sequence[int], stopped: bool) -> None:
        """A complete beam; stopped: a stop token ended it (else length did)."""
        out = tokens[len(self.prompt_token_ids):]
        # As vLLM: a final EOS is not counted in the length even under ignore_eos.
        eos = bool(out) and out[-1] in eos_ids
        self.completed.append(BeamSearchSequence(
            list(tokens), out, cum, beam_score(len(tokens), eos, cum, self.length_penalty),
            finish_reason="stop" if stopped else "length"))

    def best(self) -> list[BeamSearchSequence]:
        return rank(self.completed)[:self.n]
