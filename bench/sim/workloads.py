"""Synthetic request streams for the routing simulator.

Six shapes of prefix sharing, each a list of first requests (Poisson arrival times, but for
hot_prompt):
- shared_prompts: many system prompts, each request one of them plus a unique user turn;
- multi_turn: chat sessions whose every turn resends the whole conversation so far
  (turn k+1 is released a think time after turn k finishes, so it is closed-loop);
- zipf: a large pool of prefixes drawn with Zipf popularity, a few very hot;
- no_sharing: every prompt unique, where routing can only balance load;
- hot_prompt: one system prompt for every request, closed-loop: `concurrency` chat clients,
  each sending its next turn the moment the last one finishes (judged by throughput: the
  question is whether the one prompt's holder is left to do all the work);
- many_tenants: as llm-d's shared-prefix benchmark: many tenants, each with its own long system
  prompt, equally popular, their prompts together 3/4 of the fleet's KV caches: they all stay
  cached only if each worker keeps to its own share of tenants (at 4 workers, a worker that sees
  every tenant, as under round robin, has room for a third of them).
Token ids are random; only their equality matters, since blocks are named by hash.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

WORKLOADS = ("shared_prompts", "multi_turn", "zipf", "no_sharing", "hot_prompt", "many_tenants")
VOCAB = 32000
_IDS = range(1, VOCAB)


@dataclass(eq=False)
class SimRequest:
    rid: str
    arrival: float
    prompt: list[int]
    output: list[int]                       # decided up front so that follow-up turns can resend it
    follow_up: Optional["SimRequest"] = None
    think: float = 0.0                      # delay between this turn's predecessor finishing and its arrival
    # Filled in by the simulation.
    hashes: list[bytes] = field(default_factory=list)
    worker: int = -1
    best_hit: int = 0                       # most cached prompt tokens any worker held at decision time
    hit: int = 0                            # cached prompt tokens found at admission
    computed: int = 0
    generated: int = 0
    owned: list[bytes] = field(default_factory=list)
    anon: int = 0                           # blocks held that carry no hash (yet)
    t_first: float = -1.0
    t_finish: float = -1.0
    fetch: Optional[tuple[int, int]] = None   # the router's fetch hint: (source worker, leading blocks)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(_IDS, k=n)


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def make_workload(name: str, num_workers: int, num_requests: int, seed: int,
                  rate_fn, concurrency: int = 64, cache_tokens: int = 32768,
                  turns: tuple[int, int] = (1, 4)) -> list[SimRequest]:
    """First requests in arrival order. `rate_fn(mean_prompt, mean_output)` gives the
    cluster's request rate for requests of that mean size (the caller's load target);
    hot_prompt ignores it and runs `concurrency` clients instead, with conversations of `turns`
    (least, most) turns; many_tenants sizes its tenants by `cache_tokens`, one worker's KV cache."""
    rng = random.Random(seed)
    if name == "hot_prompt":
        return _hot(rng, num_requests, concurrency, turns=turns)
    if name == "many_tenants":
        return _tenants(rng, num_workers, num_requests, rate_fn, cache_tokens)
    if name == "shared_prompts":
        return _shared(rng, num_workers, num_requests, rate_fn)
    if name == "multi_turn":
        return _multi_turn(rng, num_workers, num_requests, rate_fn)
    if name == "zipf":
        return _zipf(rng, num_workers, num_requests, rate_fn)
    if name == "no_sharing":
        return _unique(rng, num_requests, rate_fn)
    raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)} (got {name!r})")


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _with_prefixes(rng, prefixes, weights, n, rate_fn, suffix=(32, 256), out=(32, 256)):
    picks = rng.choices(range(len(prefixes)), weights=weights, k=n)
    mean_p = sum(len(prefixes[i]) for i in picks) / n + sum(suffix) / 2
    times = _arrivals(rng, n, rate_fn(mean_p, sum(out) / 2))
    return [SimRequest(f"r{i}", times[i], prefixes[p] + _tokens(rng, rng.randint(*suffix)),
                       _tokens(rng, rng.randint(*out))) for i, p in enumerate(picks)]


def _shared(rng, num_workers, n, rate_fn):
    # Many prompts (8 per worker), equally popular: the question is whether they spread.
    prefixes = [_tokens(rng, rng.randint(1024, 2048)) for _ in range(8 * num_workers)]
    return _with_prefixes(rng, prefixes, None, n, rate_fn)


def _zipf(rng, num_workers, n, rate_fn):
    prefixes = [_tokens(rng, rng.randint(512, 2048)) for _ in range(32 * num_workers)]
    return _with_prefixes(rng, prefixes, _zipf_weights(len(prefixes), 1.1), n, rate_fn)


def _unique(rng, n, rate_fn):
    times = _arrivals(rng, n, rate_fn(1280, 144))
    return [SimRequest(f"r{i}", t, _tokens(rng, rng.randint(512, 2048)), _tokens(rng, rng.randint(32, 256)))
            for i, t in enumerate(times)]


def _hot(rng, n, concurrency, system=1536, turns=(1, 4), user=(32, 256), out=(32, 256), ramp_s=1.0):
    """`concurrency` closed-loop chat clients over one system prompt: each client holds
    conversations of `turns` turns (1-4), one after another, every turn resending the conversation so far
    and released the moment the one before it finishes (think time 0). The clients join one by
    one over `ramp_s`, as a load generator ramps up (all at once, every first request would find
    the prompt uncached everywhere, whatever the policy: a prefill shares only computed blocks)."""
    prompt = _tokens(rng, system)
    chains: list[list[SimRequest]] = [[] for _ in range(concurrency)]
    made = 0
    while made < n:
        c = min(range(concurrency), key=lambda i: len(chains[i]))     # the client with the fewest
        history = list(prompt)
        for _ in range(min(rng.randint(*turns), n - made)):
            history += _tokens(rng, rng.randint(*user))
            req = SimRequest(f"c{c}r{len(chains[c])}", 0.0, list(history), _tokens(rng, rng.randint(*out)))
            history += req.output
            chains[c].append(req)
            made += 1
    firsts = []
    for c, chain in enumerate(chains):
        if not chain:
            continue
        chain[0].arrival = ramp_s * c / concurrency
        for a, b in zip(chain, chain[1:]):
            a.follow_up = b
        firsts.append(chain[0])
    return firsts


def _tenants(rng, num_workers, n, rate_fn, cache_tokens, prefix=4096, suffix=(64, 256), out=(32, 128)):
    tenants = max(2, round(0.75 * num_workers * cache_tokens / prefix))
    prefixes = [_tokens(rng, prefix) for _ in range(tenants)]
    return _with_prefixes(rng, prefixes, None, n, rate_fn, suffix, out)


def _multi_turn(rng, num_workers, n, rate_fn, turns=(2, 8), think=4.0):
    # A few system prompts shared by all sessions, then per-session history.
    systems = [_tokens(rng, rng.randint(256, 1024)) for _ in range(4)]
    sessions, total = [], 0
    while total < n:
        k = min(rng.randint(*turns), n - total)
        sessions.append(k)
        total += k
    firsts, all_reqs = [], []
    for s, k in enumerate(sessions):
        history, prev = list(rng.choice(systems)), None
        for turn in range(k):
            history += _tokens(rng, rng.randint(32, 256))
            req = SimRequest(f"s{s}t{turn}", 0.0, list(history), _tokens(rng, rng.randint(64, 256)),
                             think=rng.expovariate(1.0 / think) if turn else 0.0)
            history += req.output
            all_reqs.append(req)
            if prev is None:
                firsts.append(req)
            else:
                prev.follow_up = req
            prev = req
    mean_p = sum(len(r.prompt) for r in all_reqs) / len(all_reqs)
    session_rate = rate_fn(mean_p, 160) * len(sessions) / len(all_reqs)
    for req, t in zip(firsts, _arrivals(rng, len(firsts), session_rate)):
        req.arrival = t
    return firsts
