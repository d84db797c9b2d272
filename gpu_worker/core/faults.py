"""Who a step's error belongs to: one request's (RequestFault), or the engine's.

The rule (DESIGN.md, "Fault isolation"): every per-request stage of a step (the sampler's
transforms and grammar masks, beam scoring, stop and detokenization, output building) runs so
that an error it raises is attributed to the request(s) whose parameters or data it came
from. Those requests end alone, their blocks freed, with a RequestFault naming the stage and
the cause; the step goes on for everyone else. Anything not attributed that way (the model's
forward, a block copy, the scheduler) is a fault of the engine itself: every request fails
and the engine is dead (serving reports NOT_SERVING), as vLLM's EngineDeadError.
"""
from __future__ import annotations


class RequestFault(Exception):
    """One request's parameters or data made a stage of the step raise; it alone fails.

    request_id: the caller's id; stage: which per-request stage raised; cause: what it raised.
    The message names both, so that the caller (INVALID_ARGUMENT) sees what went wrong."""

    def __init__(self, request_id: str, stage: str, cause: BaseException):
        self.request_id, self.stage, self.cause = request_id, stage, cause
        super().__init__(f"{stage}: this request's parameters or data made the engine raise "
                         f"{type(cause).__name__}: {cause}; the request was ended, the others go on")


class EngineDeadError(RuntimeError):
    """The engine itself failed (not one request): it serves nothing more."""
