"""The CPU kernels' C library: every .c file under kernels/csrc built into one shared object.

The attention kernels (kernels/cpu_attention.py), the linears (kernels/cpu_gemv.py for a few
rows, kernels/cpu_gemm.py above) and a layer's small elementwise ops (kernels/cpu_ops.py) share
one library so that they share one thread pool (csrc/thread_pool.c): two pools would spin
against each other on the same cores. It is plain C
built here at first use with the system C compiler (about a second), cached by sources, flags,
compiler and CPU under PAGODA_KERNEL_CACHE (default ~/.cache/pagoda/kernels), and called
through ctypes, which releases the GIL.

PAGODA_CPU_SPIN_US (default 1000): how long a pool thread spins after a kernel before it
sleeps: after every kernel when the step's GEMMs run on the pool too (set_spin_always, the
default of pagoda.gpu_worker.models.parallel), else only after a small step's (a decode of at most
GEMV_MAX_M tokens), so that no spinner holds a core that torch's OpenMP GEMM threads want.
Waking a sleeping thread costs up to half a millisecond on a virtual machine, and a step's
kernels come tens to hundreds of microseconds apart (csrc/thread_pool.h). 0: never spin.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-pthread"]
DEFAULT_SPIN_US = 1000
# Constants the Python side relies on, checked against the built library's.
QTILE = 8        # query tokens per attention work item (paged_attention_cpu.c)
GEMV_MAX_M = 8   # most rows gemv_cpu takes (gemv_cpu.c)
GEMM_ATTENTION_ROWS = 48  # most query rows per work item of gemm_attention_cpu.c
GEMM_ATTENTION_KEY_CHUNK = 128  # keys per online-softmax step of gemm_attention_cpu.c (its tests' sizes)

i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
# The element types the kernels read and write where they take a `kind` (csrc/convert.h).
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
SIGNATURES = {
    "paged_attention_cpu": [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64,
                            ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, f32, f32,
                            i32, ptr, i64, i32, i32, i32],
    "gemm_attention_cpu": [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64,
                           i32, i32, i32, i32, f32, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                           ptr, i64, ptr, i64, i64, i32, i32],
    "gemm_attention_work_floats": [i32],
    "gemv_cpu": [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i32, i32, i32, i32],
    "gemm_cpu": [ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32, i32],
    "gemm_pack": [ptr, i64, i32, i32, ptr, i32],
    "gemm_packed_size": [i32, i32],
    "pool_set_spin_us": [i32],
    "pool_set_spin_always": [i32],
    "pool_asleep": [],
    "pool_wakeups": [],
    "add_rms_norm_f32": [ptr, i64, ptr, i64, ptr, f32, ptr, i64, ptr, i64, i32, i32, i32, i32],
    "rotary_neox_f32": [ptr, ptr, i64, i64, i32, ptr, i64, i64, i32, ptr, ptr, i64, i64, i32, i32, i32, i32],
    "write_kv_f32": [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64,
                     i32, i32, i32, i32, i32, i32],
    "silu_mul_f32": [ptr, i64, ptr, i64, i32, i32, i32, i32],
    "convert_to_f32": [ptr, ptr, i64, i32, i32],
    "convert_from_f32": [ptr, ptr, i64, i32, i32],
}
RESTYPES = {"pool_set_spin_us": None, "pool_set_spin_always": None, "gemm_pack": None,
            "gemm_packed_size": i64, "gemm_attention_work_floats": i64, "pool_wakeups": i64}
# Whether every job keeps the pool's threads spinning after it (set_spin_always).
_spin_always = False


def set_spin_always(on: bool) -> None:
    """Spin after every job, not only a small step's: right when the step's GEMMs run on this
    pool too (kernels/cpu_gemm.py), so that no kernel of a large step waits for a wake-up; wrong
    when they run on torch's OpenMP threads, which would then share their cores with spinners."""
    global _spin_always
    _spin_always = bool(on)
    if load_library.cache_info().currsize:
        lib = load_library()
        if lib is not None:
            lib.pool_set_spin_always(int(on))


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.[ch]"))


def cache_dir() -> Path:
    env = os.environ.get("PAGODA_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagoda" / "kernels"


def env_number(name: str, default: float, parse, low: float, high: float, what: str):
    """An environment variable read as a number within [low, high]; ValueError naming it otherwise."""
    raw = os.environ.get(name, str(default))
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(f"{name}: must be {what} (got {raw!r})")
    return value


def spin_us() -> int:
    return env_number("PAGODA_CPU_SPIN_US", DEFAULT_SPIN_US, int, 0, 1_000_000,
                      "an integer from 0 to 1000000 microseconds")


def kernel_threads() -> int:
    """Threads a kernel call splits over: torch's intra-op count (PAGODA_CPU_KERNEL_THREADS
    overrides, for experiments)."""
    env = os.environ.get("PAGODA_CPU_KERNEL_THREADS")
    return int(env) if env else torch.get_num_threads()


def _cpu_id() -> str:
    """What -march=native depends on: a cache shared between different CPUs must not mix builds."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_key(flags: list[str] = FLAGS) -> str:
    """What a build depends on (sources, flags, compiler, CPU), hashed: its file name, and part of
    the key of kernels/cpu_tune.py's cached timings."""
    return hashlib.sha256(b"\0".join([*(p.name.encode() + p.read_bytes() for p in sources()),
                                      " ".join(flags).encode(), str(compiler()).encode(),
                                      platform.machine().encode(), _cpu_id().encode()])).hexdigest()[:16]


def build(path: Path, flags: list[str] = FLAGS) -> None:
    """Compile every .c file of CSRC with `flags` into the shared object `path` (built beside it
    and renamed: workers starting together never load half a file)."""
    cc = compiler()
    if not cc:
        raise OSError("no C compiler (CC, cc, gcc) found")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, *(str(p) for p in sources() if p.suffix == ".c"), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the argument and result types of SIGNATURES and RESTYPES set."""
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = RESTYPES.get(name, ctypes.c_int)
    return lib


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The built library, compiling it on first use; None (and one warning) when that fails."""
    spin = spin_us()
    if not compiler():
        log.warning("CPU kernels: no C compiler (CC, cc, gcc) found; using the torch reference")
        return None
    path = cache_dir() / f"pagoda_cpu-{library_key()}.so"
    try:
        if not path.exists():
            build(path)
        lib = bind(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("CPU kernels: building %s with %s failed (%s %s); using the torch reference",
                    CSRC, compiler(), e, detail.decode(errors="replace")[-500:])
        return None
    for name, want in (("qtile", QTILE), ("gemv_max_m", GEMV_MAX_M),
                       ("gemm_attention_rows", GEMM_ATTENTION_ROWS),
                       ("gemm_attention_key_chunk", GEMM_ATTENTION_KEY_CHUNK)):
        if getattr(lib, name)() != want:
            raise RuntimeError(f"{CSRC}: {name}() is {getattr(lib, name)()}, {__name__} expects {want}")
    lib.pool_set_spin_us(spin)
    lib.pool_set_spin_always(int(_spin_always))
    return lib


def available() -> bool:
    return load_library() is not None
