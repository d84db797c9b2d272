"""When a sequence ends on a token: the one stop and length rule (vLLM's check_stop), which every
path calls.

A sequence that has just taken `token` ends
- by STOP_TOKEN when the token is one of its stop ids (stop_token_ids, then the EOS ids unless
  ignore_eos: stop_token_ids()) and its output holds at least min_tokens tokens, this one included;
- by LENGTH when its output holds max_tokens tokens, or the whole sequence max_model_len.
Both may hold at once. A stop string needs the text, so the engine looks for it when the token's
text is added (finish_on_token): a stop token ends the sequence before its text is added, a stop
string (looked for once min_tokens are out) before length.

Callers: the runner checks a step's sampled tokens all at once (check_stop_batch, numpy over
rows, the same rule); the engine turns the runner's flags and the stop strings into a finish
(finish_on_token); beam search checks each candidate (check_stop); the scheduler asks whether a
token still in flight ends its request by length (reaches_length).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pagoda.gpu_worker.core.detokenizer import Detokenizer
from pagoda.gpu_worker.core.request import Request, RequestStatus

# Bits of a token's finish flags (ModelRunnerOutput.finish_flags).
STOP_TOKEN = 1
LENGTH = 2


def stop_token_ids(stop_ids: Sequence[int], ignore_eos: bool, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens that end a sequence: its own stop ids, then the EOS ids unless ignore_eos;
    each once, in that order."""
    return list(dict.fromkeys([*stop_ids, *([] if ignore_eos else eos_token_ids)]))


def reaches_length(num_tokens: int, num_output_tokens: int, max_tokens: int, max_model_len: Optional[int]) -> bool:
    """The LENGTH rule alone (max_model_len None: no limit)."""
    return num_output_tokens >= max_tokens or (max_model_len is not None and num_tokens >= max_model_len)


def check_stop(token: int, num_tokens: int, num_output_tokens: int, stop_ids: Sequence[int], min_tokens: int,
               max_tokens: int, max_model_len: int) -> int:
    """Finish flags (STOP_TOKEN | LENGTH, 0: it goes on) of a sequence that has just taken
    `token`; num_tokens and num_output_tokens count it; stop_ids: stop_token_ids()."""
    flags = STOP_TOKEN if num_output_tokens >= min_tokens and token in stop_ids else 0
    if reaches_length(num_tokens, num_output_tokens, max_tokens, max_model_len):
        flags |= LENGTH
    return flags


def check_stop_batch(tokens: np.ndarray, num_tokens: np.ndarray, num_output_tokens: np.ndarray,
                     stop_ids: np.ndarray, min_tokens: np.ndarray, max_tokens: np.ndarray,
                     max_model_len: int) -> np.ndarray:
    """check_stop for N tokens at once, int64 flags [N]: tokens, num_tokens, num_output_tokens,
    min_tokens and max_tokens [N] (or broadcast to it), stop_ids [N or 1, S] padded with -1."""
    hit = (stop_ids == tokens[:, None]).any(axis=1) & (num_output_tokens >= min_tokens)
    long = (num_output_tokens >= max_tokens) | (num_tokens >= max_model_len)
    return hit * STOP_TOKEN | long * LENGTH


def finish_on_token(req: Request, token: int, flags: int, num_output_tokens: int,
                    detok: Detokenizer) -> Optional[RequestStatus]:
    """How `req` ends on `token`, its num_output_tokens-th output token, given the token's finish
    flags: a stop token first (its text is not added; stop_reason is the id when the request
    named it, None for EOS), else a stop string the token's text completes, else length. None: it
    goes on. Adds the token's text to detok unless a stop token ends the request."""
    if flags & STOP_TOKEN:
        req.stop_reason = token if token in req.params.stop_token_ids else None
        return RequestStatus.FINISHED_STOPPED
    if detok.add_token(token, check_stop=num_output_tokens >= req.params.min_tokens) is not None:
        req.stop_reason = detok.stop_reason
        return RequestStatus.FINISHED_STOPPED
    if flags & LENGTH:
        return RequestStatus.FINISHED_LENGTH
    return None
