"""Request limits: named bounds on every request field that multiplies work or memory.

Router and worker both call `check_request` before doing anything for a request (before
tokenising, before the engine), so one hostile request (n = 2^31-1, a 50 MB prompt, a
million logit biases) is refused in microseconds with INVALID_ARGUMENT naming the field and
the flag that sets its bound. The worker adds what only it knows (the prompt's token count
against max_model_len) in `check_fits`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Limits:
    max_n: int = 16                       # sequences per request
    max_prompt_bytes: int = 1 << 20       # UTF-8 bytes of text, or of all messages together
    max_messages: int = 1024
    max_prompt_tokens: int = 131_072      # token_ids given directly
    max_logit_bias: int = 1024            # entries of sampling.logit_bias
    max_stop: int = 16                    # stop strings, and stop_token_ids
    max_id_bytes: int = 256               # request_id, model, adapter, cache_salt

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "Limits":
        return cls(**{f.name: getattr(a, f.name) for f in fields(cls) if getattr(a, f.name, None) is not None})


def add_flags(p: argparse.ArgumentParser) -> None:
    """--max-n, --max-prompt-bytes, ... on a server's parser (defaults as in Limits)."""
    g = p.add_argument_group("request limits (a request beyond one gets INVALID_ARGUMENT naming the field)")
    for f in fields(Limits):
        g.add_argument("--" + f.name.replace("_", "-"), type=_positive, default=f.default, metavar="N",
                       help=_HELP[f.name])


_HELP = {"max_n": "sequences per request (n)", "max_prompt_bytes": "UTF-8 bytes of a prompt, or of all "
         "messages together", "max_messages": "chat messages per request", "max_prompt_tokens": "token ids given "
         "directly", "max_logit_bias": "entries of logit_bias", "max_stop": "stop strings, and stop_token_ids",
         "max_id_bytes": "bytes of request_id, model, adapter and cache_salt"}


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
    return n


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_request(req, lim: Limits) -> None:
    """ValueError naming the first field of a GenerateRequest or TokenizeRequest beyond a limit.
    Reads only sizes: no tokenising, no allocation proportional to the request."""
    for name in ("request_id", "model", "adapter", "cache_salt"):
        value = getattr(req, name, "")
        if len(value) > lim.max_id_bytes:
            raise ValueError(f"{name}: at most {lim.max_id_bytes} characters (got {len(value)}; "
                             f"{_flag('max_id_bytes')})")
    if req.HasField("text") and len(req.text) * 4 > lim.max_prompt_bytes:
        # Characters first (free), bytes only when the cheap bound cannot decide.
        size = len(req.text.encode("utf-8", "surrogatepass"))
        if size > lim.max_prompt_bytes:
            raise ValueError(f"text: the prompt is {size} bytes, more than {lim.max_prompt_bytes} "
                             f"({_flag('max_prompt_bytes')})")
    if len(req.messages) > lim.max_messages:
        raise ValueError(f"messages: at most {lim.max_messages} messages (got {len(req.messages)}; "
                         f"{_flag('max_messages')})")
    if req.messages:
        size = sum(len(m.role.encode("utf-8", "surrogatepass")) + len(m.content.encode("utf-8", "surrogatepass"))
                   for m in req.messages)
        if size > lim.max_prompt_bytes:
            raise ValueError(f"messages: they hold {size} bytes, more than {lim.max_prompt_bytes} "
                             f"({_flag('max_prompt_bytes')})")
    ids = getattr(req, "token_ids", ())
    if len(ids) > lim.max_prompt_tokens:
        raise ValueError(f"token_ids: the prompt has {len(ids)} tokens, more than {lim.max_prompt_tokens} "
                         f"({_flag('max_prompt_tokens')})")
    if not hasattr(req, "sampling"):
        return
    sp = req.sampling
    if sp.HasField("n") and sp.n > lim.max_n:
        raise ValueError(f"n: at most {lim.max_n} sequences per request (got {sp.n}; {_flag('max_n')})")
    if sp.HasField("best_of") and sp.best_of > lim.max_n:
        raise ValueError(f"best_of: at most {lim.max_n} sequences per request (got {sp.best_of}; {_flag('max_n')})")
    if len(sp.logit_bias) > lim.max_logit_bias:
        raise ValueError(f"logit_bias: at most {lim.max_logit_bias} entries (got {len(sp.logit_bias)}; "
                         f"{_flag('max_logit_bias')})")
    for name in ("stop", "stop_token_ids"):
        if len(getattr(sp, name)) > lim.max_stop:
            raise ValueError(f"{name}: at most {lim.max_stop} (got {len(getattr(sp, name))}; {_flag('max_stop')})")


def check_fits(field: str, num_prompt_tokens: int, sp, max_model_len: int) -> None:
    """A prompt longer than the model takes names the field the caller sent (text, messages or
    token_ids); an explicit max_tokens that cannot fit with the prompt names max_tokens (as vLLM
    does) instead of being cut short silently."""
    if num_prompt_tokens > max_model_len:
        raise ValueError(f"{field}: the prompt has {num_prompt_tokens} tokens, more than "
                         f"max_model_len={max_model_len}")
    if sp.HasField("max_tokens") and num_prompt_tokens + sp.max_tokens > max_model_len:
        raise ValueError(f"max_tokens: the prompt ({num_prompt_tokens} tokens) plus max_tokens ({sp.max_tokens}) "
                         f"is more than max_model_len={max_model_len}; ask for at most "
                         f"{max(max_model_len - num_prompt_tokens, 0)}")
