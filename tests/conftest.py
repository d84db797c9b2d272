"""Shared pytest setup: fixtures live in tests/plugins/, one module per area."""
import os

# One torch thread per process: tests run several processes (workers, routers) on 2 cores,
# and oversubscribed torch threads are many times slower than one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's numbers (parity with transformers in fp32, tolerances, byte counts) are fp32's on
# every CPU: --dtype auto would serve bf16 on a CPU with native bf16 arithmetic (avx512_bf16,
# amx_bf16). Tests of bf16 ask for it by name; tests/test_cpu_dtype.py checks auto itself.
os.environ.setdefault("PAGODA_CPU_DTYPE", "float32")

pytest_plugins = [
    "tests.plugins.kernels",
    "tests.plugins.models",
    "tests.plugins.servers",
    "tests.plugins.redis",
    "tests.plugins.cluster",
    "tests.plugins.engine",
    "tests.plugins.certs",
]
# tests/plugins/helm.py holds helpers, no fixtures: the chart tests import it themselves, so a
# host without the chart tools (yaml, helm_python) still collects everything else.
