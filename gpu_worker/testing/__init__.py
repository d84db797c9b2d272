"""Fixtures for tests, benchmarks and `pagoda up`'s default model: tiny random checkpoints and
quantized copies of them. Not imported by any production module."""
