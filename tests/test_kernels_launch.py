"""One process runs both builds of a kernel, as a GPU host's suite does: compiled for CUDA
tensors, interpreted twins for CPU tensors (kernels/launch.py); and the test plugins load on an
image that has only torch, triton and pytest.

This CPU host imports the kernels exactly as a GPU host does (TRITON_INTERPRET unset), so the
CPU twins here take the same route the GPU host's CPU twins take.
"""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from pagoda.kernels import launch, triton_attention, triton_cache, triton_norm
from pagoda.kernels.reference import add_rms_norm_ref, rotary_ref

KERNELS = [triton_attention._paged_attn_kernel, triton_attention._merge_splits_kernel,
           triton_cache._write_kv_kernel, triton_norm._add_rms_norm_kernel, triton_norm._rotary_kernel]
compiled_build = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                    reason="TRITON_INTERPRET=1 set by the caller: every kernel is interpreted")


@compiled_build
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_cuda_tensors_get_the_compiled_kernel_cpu_tensors_a_twin(kernel):
    assert isinstance(kernel, JITFunction)
    cuda_tensor = SimpleNamespace(is_cuda=True)  # only .is_cuda is consulted
    assert launch.for_tensor(kernel, cuda_tensor) is kernel
    twin = launch.for_tensor(kernel, torch.empty(0))
    assert isinstance(twin, InterpretedFunction) and twin is launch.for_tensor(kernel, torch.empty(0))


@compiled_build
def test_twin_restores_the_compiled_helpers_after_a_launch():
    import triton.language as tl
    x = torch.randn(3, 32)
    out, _ = triton_norm.add_rms_norm_triton(x, None, torch.ones(32), 1e-6)
    torch.testing.assert_close(out, add_rms_norm_ref(x, None, torch.ones(32), 1e-6)[0])
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos, sin = torch.rand(4, 4).repeat(1, 2), torch.rand(4, 4).repeat(1, 2)  # equal halves
    want = rotary_ref(torch.tensor([1, 3]), q, k, cos, sin)
    triton_norm.rotary_triton(torch.tensor([1, 3]), q, k, cos, sin)
    torch.testing.assert_close((q, k), want)
    # A GPU launch after a CPU twin compiles against the real helpers again.
    assert isinstance(tl.sum, JITFunction) and isinstance(triton_norm._rotate_heads, JITFunction)


def test_plugins_load_without_optional_packages():
    """A GPU image may lack grpc, redis, yaml: loading the plugins must not import them."""
    code = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        blocked = name.split(".")[0] in ("grpc", "grpc_health", "redis", "yaml", "helm_python", "torch")
        if blocked or name.startswith("pagoda.clients"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
from tests import conftest
import importlib
for name in conftest.pytest_plugins:
    importlib.import_module(name)
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
