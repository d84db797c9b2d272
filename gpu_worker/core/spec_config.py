"""--speculative-config: vLLM's JSON for speculative decoding, parsed and checked.

Two proposers: n-gram prompt lookup ({"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}) and a draft model of the same tokenizer
({"model": path, "num_speculative_tokens": k}). Kept free of torch (the CLI's --help imports
it); a bad value is refused in one line naming its key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

MAX_SPECULATIVE_TOKENS = 16
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "draft_tensor_parallel_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                       # ngram | draft_model
    num_speculative_tokens: int       # drafts proposed per sequence and step (k)
    prompt_lookup_max: int = 0        # ngram: longest suffix looked up in the sequence
    prompt_lookup_min: int = 0        # ngram: shortest
    model: Optional[str] = None       # draft_model: checkpoint directory or hub id


def _positive_int(d: dict, key: str, upper: int | None = None) -> Optional[int]:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (upper is not None and v > upper):
        rng = f"in [1, {upper}]" if upper is not None else "at least 1"
        raise ValueError(f"speculative_config.{key}: must be an integer {rng} (got {v!r})")
    return v


def parse_speculative_config(value: Any) -> Optional[SpeculativeConfig]:
    """None, '', a JSON object text, a dict or a SpeculativeConfig -> SpeculativeConfig or None."""
    if value is None or value == "" or isinstance(value, SpeculativeConfig):
        return value or None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: must be a JSON object (got {type(value).__name__})")
    for key in value:
        if key not in _KEYS:
            raise ValueError(f"speculative_config.{key}: unknown key (known: {', '.join(_KEYS)})")
    model = value.get("model")
    method = value.get("method")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"speculative_config.model: must be a checkpoint path or hub id (got {model!r})")
    if method is None:
        # vLLM's shorthand: a model named "ngram" means the n-gram proposer; any other a draft.
        if model is None:
            raise ValueError("speculative_config.method: required (ngram), or give a draft model in "
                             "speculative_config.model")
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if method not in ("ngram", "draft_model"):
        raise ValueError(f"speculative_config.method: must be ngram or draft_model (got {method!r})")
    k = _positive_int(value, "num_speculative_tokens", MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise ValueError("speculative_config.num_speculative_tokens: required")
    tp = _positive_int(value, "draft_tensor_parallel_size")
    if tp not in (None, 1):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size: must be 1 (got {tp})")
    if method == "draft_model":
        if model is None or model in ("ngram", "[ngram]"):
            raise ValueError("speculative_config.model: method draft_model needs the draft checkpoint")
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if key in value:
                raise ValueError(f"speculative_config.{key}: only for method ngram")
        return SpeculativeConfig("draft_model", k, model=model)
    hi = _positive_int(value, "prompt_lookup_max", 1024)
    lo = _positive_int(value, "prompt_lookup_min", 1024)
    # As vLLM: one given sets the other; neither, both 5.
    if hi is None and lo is None:
        hi = lo = 5
    hi = hi if hi is not None else lo
    lo = lo if lo is not None else hi
    assert hi is not None and lo is not None
    if lo > hi:
        raise ValueError(f"speculative_config.prompt_lookup_min: must not exceed prompt_lookup_max "
                         f"({lo} > {hi})")
    return SpeculativeConfig("ngram", k, prompt_lookup_max=hi, prompt_lookup_min=lo)
