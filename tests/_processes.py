"""Run a command that starts many processes, with a hard timeout, and leave none of them behind.

The demo's ranks are forked from a fork server, ``torchrun`` starts each
worker in a session of its own, and a rank that outlives a killed parent is
re-parented to init, so neither the process group nor the parent links find
every process a command started. Each run instead
puts a unique marker in the environment, which every descendant inherits, and
after the command ends (or is killed at the timeout) every process still
carrying the marker is killed. Linux only: it reads ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import pytest

# A test of a command these helpers run: Linux only. A module of such tests, each a whole command of the
# repository (a demo, a bench study), is marked `command`: `make test-commands` runs them, not `make test`.
needs_proc = pytest.mark.skipif(sys.platform != "linux", reason="tests/_processes.py reads /proc")
WHOLE_COMMANDS = [pytest.mark.command, needs_proc]

MARKER = "PPCLIP_TEST_RUN"
REPO = pathlib.Path(__file__).resolve().parent.parent


def processes_with_marker(token: str) -> list[int]:
    """PIDs of live processes whose environment carries ``MARKER=token``."""
    needle = f"{MARKER}={token}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if needle in env and _alive(int(entry)):
            pids.append(int(entry))
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited already
    except OSError:
        return False


def _kill_all(token: str) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids = processes_with_marker(token)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while processes_with_marker(token) and time.monotonic() < deadline:
            time.sleep(0.2)


def run_bounded(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str, list[int]]:
    """Runs ``cmd`` in the repository root, stdout and stderr together, killing all it started by ``timeout``.

    Returns:
        ``(returncode, output, leftovers)``: ``returncode`` is ``None`` if the
        command timed out; ``leftovers`` lists processes that survived even
        the kill (expected empty).
    """
    token = uuid.uuid4().hex
    full_env = {**os.environ, **(env or {}), MARKER: token}
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_all(token)
        proc.kill()
        out, _ = proc.communicate()
        code = None
    finally:
        _kill_all(token)
    return code, out, processes_with_marker(token)


def python() -> str:
    """The interpreter running the tests (its virtualenv has torch)."""
    return sys.executable
