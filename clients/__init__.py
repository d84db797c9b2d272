"""pagoda's Python client library and the `pagoda` CLI; depends on protos and grpcio only."""
from pagoda.clients.client import AsyncPagodaClient, Choice, Chunk, Completion, PagodaClient, Usage, build_request

__all__ = ["PagodaClient", "AsyncPagodaClient", "Chunk", "Choice", "Completion", "Usage", "build_request"]
