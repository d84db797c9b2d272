"""A server's lifetime tied to the process that started it (`pagoda up`, the test fixtures).
Standard library only: the test plugins import it on machines without grpc."""
from __future__ import annotations

import os
import signal
import threading
import time

PARENT_PID_ENV = "PAGODA_PARENT_PID"


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
