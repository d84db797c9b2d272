"""A server's lifetime tied to the process that started it (`pagoda up`, the test fixtures).
Standard library only: the test plugins import it on machines without grpc."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable

PARENT_PID_ENV = "PAGODA_PARENT_PID"
_PR_SET_PDEATHSIG = 1     # linux/prctl.h


def die_with_parent(poll_s: float = 0.5) -> None:
    """Where the process that started this server set PAGODA_PARENT_PID to its own pid (`pagoda
    up`, the test fixtures), send this process SIGTERM (its usual graceful stop) once that parent is
    gone, even killed outright, so that a killed `pagoda up` or test run leaves no server behind. A
    daemon thread watches getppid() (an orphan is handed to another parent); Linux's
    PR_SET_PDEATHSIG would follow the parent's *thread* that started the server, and fixtures start
    servers from pool threads that end long before the test does. Without the variable, nothing."""
    parent = os.environ.get(PARENT_PID_ENV, "")
    if not parent.isdigit():
        return
    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def end_with_spawner() -> Callable[[], None] | None:
    """A preexec_fn for a child that cannot watch its parent itself (redis-server): Linux sends
    the child SIGTERM when the thread that spawned it ends, so a spawner killed outright still
    takes it along. Only for spawns from a thread that lives as long as the process (the main
    thread of `pagoda up`); None where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    spawner = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != spawner:         # the spawner died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
