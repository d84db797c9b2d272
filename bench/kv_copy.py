"""The copies of a KV fetch (gpu_worker/serving/kv_transfer.py), timed without a network: N blocks
exported from a paged KV pool to host bytes with their digests (what the source does per engine
command and message) and imported into another pool (what the receiver does: bytes back to a
tensor, to the device, into the blocks), on one device. Llama-3-8B-shaped blocks in bf16 (32
layers, 8 KV heads of 128, block 16: 2 MiB a block). The code timed is kv_transfer's own
export_blocks/import_blocks/block_digest; tests/test_kv_transfer_copy.py checks it (CPU twin and
CUDA). What the copies cost per MiB against what a fetch took (bench/kv_transfer.py) says how much
of a fetch is copying and how much is the network and the engine's turns.

    python bench/kv_copy.py --device cuda --out kv_copy.md     # bench/gpu_check.sh
    python bench/kv_copy.py --dry-run                          # CPU, small blocks: the script runs
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import command_line, machine, markdown_table, now  # noqa: E402
from pagoda.gpu_worker.serving.kv_transfer import block_digest, export_blocks, import_blocks  # noqa: E402

LLAMA_8B = dict(layers=32, heads=8, dim=128, block=16)
SMALL = dict(layers=4, heads=2, dim=64, block=16)


def pool(device: str, num_blocks: int, layers: int, heads: int, dim: int, block: int) -> list[torch.Tensor]:
    """The runner's stores: per layer K then V, [blocks, heads, block, dim] views."""
    return [torch.randn(num_blocks, block, heads, dim, device=device, dtype=torch.bfloat16).permute(0, 2, 1, 3)
            for _ in range(2 * layers)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(device: str, n: int, reps: int, shape: dict) -> list:
    src, dst = pool(device, 2 * n, **shape), pool(device, 2 * n, **shape)
    ids = list(range(0, 2 * n, 2))                  # every other block: a gather, as a real chain's
    into = tuple(range(1, 2 * n, 2))
    best = [float("inf")] * 4
    for _ in range(reps + 1):                       # the first round warms up
        sync(device)
        t0 = time.perf_counter()
        data = export_blocks(src, ids)
        t1 = time.perf_counter()
        kvs = [data[i].numpy().tobytes() for i in range(n)]
        digests = [block_digest(bytes(16), kv) for kv in kvs]
        t2 = time.perf_counter()
        back = torch.frombuffer(bytearray(b"".join(kvs)), dtype=torch.uint8).reshape(n, -1)
        t3 = time.perf_counter()
        import_blocks(dst, into, back)
        sync(device)
        t4 = time.perf_counter()
        best = [min(b, t) for b, t in zip(best, (t1 - t0, t2 - t1, t3 - t2, t4 - t3))]
    assert len(digests) == n
    for s, d in zip(src, dst):
        assert torch.equal(d[list(into)], s[ids])
    mib = data.numel() / 2 ** 20
    return [n, f"{mib:.2f}", *(1000 * b for b in best), 1000 * sum(best) / mib, mib / 1024 / sum(best)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", default="16,64,256", help="blocks a transfer")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="CPU, small blocks, 1 rep")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    a = ap.parse_args()
    device, shape = ("cpu", SMALL) if a.dry_run else (a.device, LLAMA_8B)
    counts = [4, 16] if a.dry_run else [int(x) for x in a.blocks.split(",")]
    rows = [run(device, n, 1 if a.dry_run else a.reps, shape) for n in counts]
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    text = "\n".join([f"{now()}; {machine()}; device {name}; blocks {shape}, bf16",
                      f"command: {command_line()}",
                      markdown_table(["blocks", "MiB", "export ms", "bytes + digests ms", "bytes back ms", "import ms",
                                      "ms per MiB (all)", "GiB/s (all)"], rows)])
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
