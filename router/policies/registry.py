"""The registry: the name --policy and the chart's router.policy give -> its policy class."""
from __future__ import annotations

import random
from typing import Callable

from pagoda.router.policies.base import Policy, Settings
from pagoda.router.policies.least_loaded import LeastLoaded
from pagoda.router.policies.prefix_aware import PrefixAware
from pagoda.router.policies.round_robin import RoundRobin
from pagoda.router.scoring import BALANCE

REGISTRY: dict[str, Callable[[Settings], Policy]] = {
    PrefixAware.name: PrefixAware, LeastLoaded.name: LeastLoaded, RoundRobin.name: RoundRobin}
POLICIES = tuple(REGISTRY)       # prefix_aware first: the default


def make_policy(name: str, rng: random.Random, balance: float = BALANCE, spread: bool = True,
                fetch: bool = True) -> Policy:
    make = REGISTRY.get(name)
    if make is None:
        raise ValueError(f"policy: must be one of {', '.join(POLICIES)} (got {name!r})")
    return make(Settings(rng, balance, spread, fetch))
