"""Servers end with the process that started them (pagoda.runtime.serving.die_with_parent): a `pagoda up`
or a test run killed outright leaves no worker or router behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pagoda.runtime.lifetime import PARENT_PID_ENV

ROOT = Path(__file__).resolve().parents[1]
SERVER = "from pagoda.runtime.lifetime import die_with_parent; die_with_parent(); import time; time.sleep(30)"
# A stand-in for `pagoda up` or a fixture: starts the "server" from a thread that ends at once (as
# fixtures do from pool threads), with its own pid in the environment, says the server's pid, then
# waits to be killed.
PARENT = f"""
import os, subprocess, sys, threading, time
env = {{**os.environ, {PARENT_PID_ENV!r}: str(os.getpid())}}
spawn = lambda: print(subprocess.Popen([sys.executable, "-c", {SERVER!r}], env=env, start_new_session=True).pid,
                      flush=True)
starter = threading.Thread(target=spawn)
starter.start()
starter.join()
time.sleep(30)
"""

def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_a_server_ends_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)                         # past die_with_parent's first look in the child
        assert not _gone(child, 0.2), "the server ended while its parent lived (or the thread that started it ended)"
        parent.kill()
        parent.wait()
        assert _gone(child, 5.0), "the server outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_a_server_whose_parent_is_already_gone_ends_at_once():
    env = {**_env(), PARENT_PID_ENV: "1"}      # not its parent: the one that asked has gone
    done = subprocess.run([sys.executable, "-c", SERVER], env=env, timeout=20)
    assert done.returncode == -signal.SIGTERM


def test_without_the_variable_nothing_changes():
    env = {k: v for k, v in _env().items() if k != PARENT_PID_ENV}
    code = "from pagoda.runtime.lifetime import die_with_parent; die_with_parent(); print('alive')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=20)
    assert done.returncode == 0 and done.stdout.strip() == "alive"
