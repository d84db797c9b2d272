"""The router's one public error: a request refused or not served, with the gRPC status to answer.

Every stage raises it (request preparation for bad input and unknown models, the proxy for
workers that failed); the fronts turn it into a gRPC status (router/grpc_front.py) or an
OpenAI error object (router/openai/request.py). Its message starts with the field it names, as
everywhere in pagoda (`max_tokens: ...`), so a front can point at the parameter.
"""
from __future__ import annotations

import grpc

# Codes that say the request itself is wrong: another worker would answer the same.
CLIENT_ERRORS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                           grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    @classmethod
    def invalid(cls, e: ValueError) -> RouterError:
        """Bad input (a ValueError whose message names the field)."""
        return cls(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def caller_field(message: str, field: str) -> str:
    """A worker names token_ids (all it was sent); the caller sent `field`."""
    return field + message[len("token_ids"):] if message.startswith("token_ids:") and field != "token_ids" \
        else message
