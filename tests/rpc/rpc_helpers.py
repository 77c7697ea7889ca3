"""Real `tvmfuse rpc` services for the tests: subprocesses in sessions of their own (so that a test can kill one with
everything it forked, as a machine going down would), each ready once it prints its --json line."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tvmfuse.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def ready(proc: subprocess.Popen, timeout: float = 60) -> dict:
    """The service's --json line: printed once it listens (a server: once the tracker lists it)."""
    box: dict = {}
    reader = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box.get("line"):
        stop(proc)
        pytest.fail(f"the service did not start: {proc.stderr.read()[-2000:]}")
    return json.loads(box["line"])


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
