"""The CPU kernels built for other instruction sets compute what the native build computes.

tests/csrc/kernel_check.c runs every kernel of kernels/csrc (the GEMV and GEMM in fp32, bf16 and
fp16, the small fused ops, paged attention with and without a window and softcap, the 16-bit
conversions) on fixed inputs and writes the outputs. It is built here for this CPU
(-march=native: AVX2, or AVX-512 where there is one), for x86-64 with no extension, and for
aarch64 with NEON (Neoverse N1, Graviton2) and with 256-bit SVE (Neoverse V1, Graviton3), the
aarch64 ones run under qemu-user. Every build must agree with the native one:

- bit for bit when no build may fuse a multiply and an add (-ffp-contract=off): the kernels sum
  in the same order on every ISA, so anything else is a bug in a vector path. Two documented
  exceptions: F16C keeps a NaN's payload where the portable fp16 conversion gives 0x7E00 (both
  NaN), and AVX512-BF16's vdpbf16ps sums bf16 pairs before adding them (gemv_cpu.c);
- within a stated tolerance as shipped (-O3, contraction on), for the NEON build: which of
  a*b - c*d the compiler fuses differs between GCC's x86 and aarch64 back ends (rotary, the
  fp32 GEMV), one or two fp32 roundings apart. (The x86-64 portable build as shipped is held
  against torch in tests/test_cpu_gemm.py.)

Skipped with the reason where the cross compiler or qemu-user is missing; .ci/run installs them
(Debian: gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user).
"""
from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pagoda.gpu_worker.core.config import cpu_flags
from pagoda.kernels import cpu_lib

CSRC = Path(cpu_lib.__file__).resolve().parent / "csrc"
DRIVER = Path(__file__).resolve().parent / "csrc" / "kernel_check.c"
CROSS = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
CC = cpu_lib.compiler() or "cc"      # the one that builds the kernels' library
# name -> (compiler, flags, how to run it)
BUILDS = {
    "x86-64 portable": (CC, ["-O3"], []),
    "aarch64 NEON (armv8.2-a+fp16)": (CROSS, ["-O3", "-march=armv8.2-a+fp16", "-static"], [QEMU]),
    "aarch64 SVE 256 (neoverse-v1)": (CROSS, ["-O3", "-mcpu=neoverse-v1", "-msve-vector-bits=256", "-static"],
                                      [QEMU, "-cpu", "max,sve256=on"]),
}
NATIVE = (CC, ["-O3", "-march=native"], [])
RTOL, ATOL = 1e-5, 1e-6     # as shipped: a few fp32 roundings on values of order 1


def run_build(tmp: Path, name: str, build: tuple[str, list[str], list[str]], contract: bool) -> dict[str, bytes]:
    cc, flags, runner = build
    for tool in (cc, *runner[:1]):
        if shutil.which(tool) is None:
            pytest.skip(f"{name}: {tool} is not installed (Debian: gcc-aarch64-linux-gnu, "
                        "libc6-dev-arm64-cross, qemu-user)")
    exe = tmp / ("-".join(name.split()[:2]).strip("()") + ("-fma" if contract else "-nofma"))
    extra = [] if contract else ["-ffp-contract=off"]
    # one compiler per source file at once, then the link: the -O3 builds are most of this test's time
    objects, procs = [], []
    for src in [DRIVER, *sorted(CSRC.glob("*.c"))]:
        objects.append(str(tmp / f"{exe.name}-{src.stem}.o"))
        procs.append(subprocess.Popen([cc, *flags, *extra, "-pthread", "-Wno-psabi", f"-I{CSRC}", "-c", "-o",
                                       objects[-1], str(src)], stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    subprocess.run([cc, *flags, "-pthread", "-o", str(exe), *objects, "-lm"], check=True, capture_output=True,
                   timeout=300)
    out = tmp / (exe.name + ".bin")
    subprocess.run([*runner, str(exe), str(out)], check=True, capture_output=True, timeout=300)
    return read_records(out.read_bytes())


def x86() -> bool:
    import platform
    return platform.machine() in ("x86_64", "AMD64")


def read_records(data: bytes) -> dict[str, bytes]:
    """kernel_check.c's output: [u32 name length][name][u64 byte count][bytes] ..."""
    out, i = {}, 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        name = data[i + 4:i + 4 + n].decode()
        (size,) = struct.unpack_from("<Q", data, i + 4 + n)
        i += 12 + n
        out[name] = data[i:i + size]
        i += size
    return out


def as_float(name: str, raw: bytes) -> np.ndarray:
    """A record's values as fp32 (bf16 and fp16 widened exactly)."""
    if "f32" in name.split() or name.startswith("to_f32"):
        return np.frombuffer(raw, np.float32)
    h = np.frombuffer(raw, np.uint16)
    if "bf16" in name.split():
        return (h.astype(np.uint32) << 16).view(np.float32)
    return h.view(np.float16).astype(np.float32)


def nan_payload_only(name: str, a: bytes, b: bytes) -> bool:
    """The records differ only where both are NaN (F16C's payload against the portable 0x7E00)."""
    x, y = as_float(name, a), as_float(name, b)
    differ = x.view(np.uint32) != y.view(np.uint32)
    return bool(np.all(np.isnan(x[differ]) & np.isnan(y[differ])))


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> dict[bool, dict[str, bytes]]:
    if not x86():
        pytest.skip("the reference build is x86-64's")
    tmp = tmp_path_factory.mktemp("isa")
    return {contract: run_build(tmp, "native", NATIVE, contract) for contract in (False, True)}


def test_the_driver_covers_every_kernel(native):
    names = [rec.split() for rec in native[False]]
    for kernel in ("gemv", "gemm", "add_rms_norm", "silu_mul", "rotary", "paged_attention", "from_f32", "to_f32"):
        for kind in ("f32", "bf16", "f16") if kernel not in ("from_f32", "to_f32") else ("bf16", "f16"):
            assert any(words[0] == kernel and kind in words for words in names), (kernel, kind)
    # outputs are real numbers, not an untouched buffer
    for name, raw in native[False].items():
        values = as_float(name, raw)
        finite = values[np.isfinite(values)]
        assert finite.size > 0.99 * values.size and np.abs(finite).max() > 0, name


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_same_bits_without_fused_multiply_add(name, native, tmp_path):
    got = run_build(tmp_path, name, BUILDS[name], contract=False)
    want = native[False]
    assert sorted(got) == sorted(want)
    f16c, dpbf16 = "f16c" in cpu_flags(), "avx512_bf16" in cpu_flags()
    for rec in want:
        if got[rec] == want[rec]:
            continue
        if f16c and rec.split()[0] in ("from_f32", "to_f32") and "f16" in rec.split() \
                and nan_payload_only(rec, got[rec], want[rec]):
            continue
        if dpbf16 and rec.startswith("gemv bf16"):
            np.testing.assert_allclose(as_float(rec, got[rec]), as_float(rec, want[rec]), rtol=1e-2, atol=1e-2,
                                       err_msg=rec)
            continue
        x, y = as_float(rec, got[rec]), as_float(rec, want[rec])
        raise AssertionError(f"{name}: {rec} differs from the native build in {int((x != y).sum())} of {x.size} "
                             f"values (largest difference {float(np.nanmax(np.abs(x - y)))})")


# As shipped, the build that -march=native gives on an Arm server (GCC lowers the kernels'
# 32-byte vectors to NEON pairs there; SVE at a fixed width is only the check above).
@pytest.mark.parametrize("name", ["aarch64 NEON (armv8.2-a+fp16)"])
def test_close_as_shipped(name, native, tmp_path):
    got = run_build(tmp_path, name, BUILDS[name], contract=True)
    want = native[True]
    assert sorted(got) == sorted(want)
    tol = {"bf16": 1e-2, "f16": 2e-3, "f32": RTOL}   # one rounding of the kind
    for rec in want:
        x, y = as_float(rec, got[rec]), as_float(rec, want[rec])
        kind = next(k for k in ("f32", "bf16", "f16") if k in rec.split())
        np.testing.assert_allclose(x, y, rtol=tol[kind], atol=max(ATOL, tol[kind]), equal_nan=True,
                                   err_msg=f"{name}: {rec}")
