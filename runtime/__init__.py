"""What router, worker and clients processes share that is not a contract: server start-up and
lifetime, TLS and API keys, the Prometheus endpoint, the prompt tokenizer and heap tuning.

Depends on protos and the standard library (grpc where a module says so); never on torch.
"""
