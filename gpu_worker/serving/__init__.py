"""One worker process in production: flags, the async engine loop, the gRPC server, the Redis
publisher, metrics and the worker's measured step rates."""
