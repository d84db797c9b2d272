"""Fixtures for tiny random checkpoints: built once per test session, one directory per family/seed."""
import pytest


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """tiny_model_factory(family="llama", seed=0, **overrides) -> checkpoint dir, cached per session."""
    from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
    cache: dict = {}

    def make(family: str = "llama", seed: int = 0, **overrides) -> str:
        key = (family, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{family}-{seed}")
            cache[key] = make_tiny_model(str(path), family=family, seed=seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory):
    """A tiny Llama checkpoint directory."""
    return tiny_model_factory("llama")
