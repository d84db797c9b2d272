"""One process-wide tuning shared by router and worker: keep the long-lived heap out of the cyclic
garbage collector's walk."""
from __future__ import annotations

import atexit
import gc

_registered = False


def freeze_heap() -> None:
    """Move every object alive now (imports, the model and tokenizer of a worker, a router's index)
    out of the cyclic collector's sight. Short-lived objects (a worker step's deltas, a router's
    decisions) trigger frequent full collections, and each one walked the whole long-lived heap:
    about 1.3 ms per step at 256 sequences in a worker (bench/overhead.py), tens of milliseconds
    at a million index blocks in a router (bench/routing_scale.py). Unfrozen at exit, so that
    extension types are torn down in order."""
    global _registered
    gc.collect()
    gc.freeze()
    if not _registered:
        atexit.register(gc.unfreeze)
        _registered = True
