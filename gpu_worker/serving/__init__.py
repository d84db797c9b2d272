"""One worker process in production: flags, the async engine loop and what serving may ask of it
(engine_client.py), the gRPC server, the Redis publisher, metrics and the worker's measured step
rates."""
