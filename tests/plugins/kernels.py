"""Kernel-test setup: run Triton kernels under the CPU interpreter when no GPU is present.

TRITON_INTERPRET is read when @triton.jit decorates a function, so it must be set before any
kernels.triton_* module is imported; a pytest plugin module is imported before test collection.
The CUDA probe asks the driver directly (ctypes, no torch import) so that loading this plugin
does not pull torch into test processes of areas that must stay torch-free.
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


if cuda_device_count() == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")
