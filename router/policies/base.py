"""What every routing policy is: a class that ranks a model's live workers for one request, best
first, with no I/O (router/scoring.py holds the cost they share), behind the Policy protocol."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from pagoda.router.scoring import BALANCE, Choice, WorkerState


@dataclass(frozen=True)
class Query:
    """One request as a policy ranks it."""
    model: str
    prompt_len: int
    overlap: dict[str, int]            # worker id -> leading blocks cached on its device (absent = none)
    output_tokens: float               # O: expected output, capped at the request's max_tokens
    now: float                         # wall clock, the one credits and reports are stamped with
    prefix: bytes | None = None        # prefix_key(): the deepest block any worker holds (hot prefixes)
    adapter: str = ""                  # a LoRA adapter: the workers given are those serving it
    tiered: dict[str, int] | None = None   # leading blocks over device and host (None: no host blocks)

    @property
    def cap(self) -> int:
        """The engine always recomputes the last prompt token, so at most prompt_len - 1 hit."""
        return max(self.prompt_len - 1, 0)


@dataclass(frozen=True)
class Settings:
    """What the router's flags set; each policy reads what applies to it."""
    rng: random.Random               # ties break at random
    balance: float = BALANCE         # how far past the mean load a cache hit may keep a worker
    spread: bool = True              # SPREAD (prefix_aware only); off for bench comparisons
    fetch: bool = True               # fetch hints (prefix_aware only): --kv-fetch-hints

    def __post_init__(self) -> None:
        if not self.balance >= 1.0:
            raise ValueError(f"balance: must be at least 1.0 (got {self.balance})")


class Policy(Protocol):
    name: str                  # as --policy and the chart's router.policy spell it
    spread: bool               # whether it prices a hot prefix's copies (SPREAD)

    def rank(self, q: Query, workers: list[WorkerState], limit: int | None) -> list[Choice]:
        """`workers` (at least one) best first, the best `limit` of them when given."""
        ...
