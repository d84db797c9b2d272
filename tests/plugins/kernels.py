"""Kernel-test setup: which host the suite runs on, asked without importing torch.

The CPU twins need no set-up: kernels/launch.py runs every launch on CPU tensors through Triton's
interpreter and CUDA tensors through the compiled kernel, so the same process runs both on a GPU
host. TRITON_INTERPRET is left alone (it would make the GPU tests interpret too). The CUDA probe
asks the driver directly (ctypes) so that areas which must stay torch-free can use it.
"""
import ctypes
import os


def cuda_device_count() -> int:
    """Devices the CUDA driver reports; 0 when there is no driver or it fails to initialise."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def pytest_report_header(config):
    return f"CUDA devices: {cuda_device_count()} (gpu-marked tests run only with one)"


def pytest_collection_modifyitems(config, items):
    # A gpu test that forgot its own skipif is still skipped on a CPU host, not failed.
    if cuda_device_count():
        return
    import pytest
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
