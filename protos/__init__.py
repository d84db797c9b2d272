"""pagoda's contracts: the gRPC API (pagoda.v1), the block-hash chain and the Redis key schema.

Imported by router, gpu_worker and clients alike, so it depends on nothing heavier than
grpcio and protobuf.
"""
