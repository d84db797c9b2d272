"""Tensor parallelism plumbing: the process group, the rank processes, one broadcast per step.

Rank 0 is the process the user starts: it keeps the scheduler, KV manager, server and publisher,
starts ranks 1..N-1 (which run only the model) and drives them with one pickled command per
call over a CPU (gloo) group: a typed object (RunModel with the step's tensors, AllocateKVCache,
...) that calls the same ModelRunner method on each rank's own shard. The model's collectives
(all-reduce, logits gather: models/parallel.py) go over the default group, NCCL on CUDA and gloo
on CPU, with a timeout so that no collective waits forever. Commands travel on their own gloo
group with no practical timeout, because ranks idle there as long as the server has no work.

Failure: a watchdog thread per rank on rank 0 waits for that rank's process to end; a rank that
exits marks the group failed (RankFailure), runs the failure callbacks (AsyncLLM ends its streams)
and kills the others, so that a collective in progress errors out instead of hanging. Each rank
holds the read end of a pipe only rank 0 writes to, and exits when it reads EOF (rank 0 gone).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Callable, Protocol, Union

import torch
import torch.distributed as dist

from pagoda.gpu_worker.models.attention import AttentionMetadata

log = logging.getLogger(__name__)

# A collective inside a step that waits longer than this means a rank is stuck: fail, not hang.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("PAGODA_TP_TIMEOUT_S", "120"))
# Ranks must have started Python and torch and joined by then.
JOIN_TIMEOUT_S = 60.0
_IDLE_TIMEOUT = timedelta(days=365)

# This process's command group (pickled objects; gloo on every device). The model's layers do
# not read any global: they take their rank and size when built (pagoda.gpu_worker.models.parallel), so
# an unsharded model may live beside a group in the same process.
_cpu_group: Any = None


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the worker cannot go on."""


def local_device(device: str, rank: int, size: int) -> torch.device:
    """A rank's device: cuda:<rank> on CUDA (one GPU per rank), else the device as named."""
    if device == "cuda" and size > 1:
        return torch.device("cuda", rank)
    return torch.device(device)


def init_group(rank: int, size: int, port: int, device: str) -> None:
    """Join the N-rank group over loopback TCP (rank 0 hosts the store)."""
    global _cpu_group
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    # Gloo even beside NCCL: commands are small CPU objects, and this group needs its own timeout.
    _cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)


def min_over_ranks(n: int, size: int) -> int:
    """The smallest n any rank holds (KV blocks: the pool must fit on every rank)."""
    if size == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group)
    return int(t.item())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return type(obj)(**{k: _to_device(getattr(obj, k), device) for k in obj.__dataclass_fields__})
    return obj


def _to_cpu(obj):
    return _to_device(obj, torch.device("cpu"))


# ---- commands: what rank 0 has every other rank do -------------------------------------------

class RankRunner(Protocol):
    """What a rank's runner does on command (ModelRunner)."""
    device: torch.device

    def run_model(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                  logits_indices: torch.Tensor) -> torch.Tensor: ...

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def agreed_num_blocks(self) -> int: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...


@dataclass(frozen=True)
class RunModel:
    """One step's forward on every rank's shard."""
    ids: torch.Tensor
    pos: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor

    def apply(self, runner: RankRunner) -> None:
        runner.run_model(self.ids, self.pos, self.meta, self.logits_indices)


@dataclass(frozen=True)
class AllocateKVCache:
    num_blocks: int

    def apply(self, runner: RankRunner) -> None:
        runner.allocate_kv_cache(self.num_blocks)


@dataclass(frozen=True)
class AgreeNumBlocks:
    """Every rank offers its pool size; all take the smallest (a collective)."""

    def apply(self, runner: RankRunner) -> None:
        runner.agreed_num_blocks()


@dataclass(frozen=True)
class CopyBlocks:
    copies: list[tuple[int, int]]

    def apply(self, runner: RankRunner) -> None:
        runner.copy_blocks(self.copies)


@dataclass(frozen=True)
class Stop:
    """The rank exits."""


Command = Union[RunModel, AllocateKVCache, AgreeNumBlocks, CopyBlocks, Stop]


class TensorParallel:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them commands, notices their death."""

    def __init__(self, config, hf_config, runner_cls: Callable[..., RankRunner]):
        """runner_cls(config, rank=, hf_config=): each rank's runner, built in the rank process
        (ModelRunner, handed in: the runner module imports this one)."""
        self.size = config.tensor_parallel_size
        self.failed: RankFailure | None = None
        self.bytes_sent = 0            # pickled command bytes, for the communication figures
        self._callbacks: list[Callable[[RankFailure], None]] = []
        self._closing = False
        port = free_port()
        # Ranks fork from multiprocessing's forkserver, a clean single-threaded process that has
        # imported torch and the runner once (per rank-0 process): a rank starts in a fraction
        # of a second instead of importing torch again; no CUDA or threads are forked. The HF
        # config goes as a plain dict, so that ranks never import transformers either.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([runner_cls.__module__])
        # Rank 0 alone holds the write end: ranks read EOF as soon as it is gone.
        alive_r, self._alive = ctx.Pipe(duplex=False)
        self.procs = [ctx.Process(target=rank_main, name=f"pagoda-tp-rank{r}", daemon=True,
                                  args=(runner_cls, config, hf_config.to_dict(), r, self.size, port, alive_r,
                                        torch.get_num_threads()))
                      for r in range(1, self.size)]
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.kill()
            raise
        finally:
            alive_r.close()
        for r, p in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(r, p), name=f"pagoda-tp-watch{r}", daemon=True).start()
        self.config, self.port = config, port

    def join_group(self) -> None:
        """Form the group with the ranks (they join as soon as they have started)."""
        try:
            init_group(0, self.size, self.port, self.config.resolved_device())
        except BaseException:
            self.kill()
            raise
        log.info("tensor parallel: %d ranks (pids %s)", self.size, [p.pid for p in self.procs])

    def kill(self) -> None:
        self._closing = True
        for p in self.procs:
            if p.pid is not None:
                p.kill()

    def on_failure(self, callback: Callable[[RankFailure], None]) -> None:
        self._callbacks.append(callback)

    def send(self, command: Command) -> None:
        """Have every other rank apply the command to its runner; rank 0 then makes the same call."""
        if self.failed is not None:
            raise self.failed
        payload = pickle.dumps(_to_cpu(command), protocol=pickle.HIGHEST_PROTOCOL)
        self.bytes_sent += len(payload)
        try:
            dist.broadcast_object_list([payload], src=0, group=_cpu_group)
        except Exception as e:
            raise self.fail(f"broadcast to the ranks failed: {e}") from e

    def fail(self, reason: str) -> RankFailure:
        """Mark the group dead (once), tell the callbacks, stop the surviving ranks."""
        if self.failed is None:
            self.failed = RankFailure(f"tensor parallel: {reason}")
            log.error("%s", self.failed)
            for p in self.procs:
                p.kill()
            for callback in self._callbacks:
                callback(self.failed)
        return self.failed

    def _watch(self, rank: int, proc) -> None:
        proc.join()
        if not self._closing:
            self.fail(f"rank {rank} exited (code {proc.exitcode})")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the ranks (a Stop command, then kill what is left)."""
        if self._closing:
            return
        self._closing = True
        if self.failed is None:
            try:
                self.send(Stop())
            except RankFailure:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()
        self._alive.close()
        if dist.is_initialized():     # frees the group, so that this process can start another
            dist.destroy_process_group()


def _watch_parent(alive) -> None:
    try:
        alive.recv()
    except EOFError:
        pass
    os._exit(1)     # rank 0 is gone: nobody will send another command


def rank_main(runner_cls: Callable[..., RankRunner], config, hf_config: dict, rank: int, size: int, port: int,
              alive, threads: int) -> None:
    """Body of ranks 1..N-1: load this rank's shard, then run rank 0's commands until Stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(alive,), daemon=True).start()
    torch.set_num_threads(threads)
    init_group(rank, size, port, config.resolved_device())
    try:
        runner = runner_cls(config, rank=rank, hf_config=SimpleNamespace(**hf_config))
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=_cpu_group)
            command: Command = pickle.loads(box[0])
            if isinstance(command, Stop):
                break
            _to_device(command, runner.device).apply(runner)
    except Exception:
        log.exception("rank %d failed", rank)
        os._exit(1)
    os._exit(0)
