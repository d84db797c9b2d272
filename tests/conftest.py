"""Shared pytest setup: fixtures live in tests/plugins/, one module per area."""
import os

# Keep torch to the machine's size so parallel test processes do not thrash.
os.environ.setdefault("OMP_NUM_THREADS", "2")

pytest_plugins = [
    "tests.plugins.kernels",
    "tests.plugins.models",
    "tests.plugins.servers",
    "tests.plugins.redis",
    "tests.plugins.cluster",
    "tests.plugins.engine",
    "tests.plugins.helm",
]
