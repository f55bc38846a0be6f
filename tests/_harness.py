"""Run a function on N real gloo ranks, with a hard timeout and per-rank error reports.

One spawn per call: a worker sets up the process group once and then runs all
of its cases, because starting processes is the slow part on 2 cores. If any
rank raises, its traceback is reported; if the ranks do not all finish within
``timeout`` seconds, every remaining process is killed and the test fails
naming the ranks that hung. Gloo's own timeout is set below ours, so a rank
stuck in a collective whose peer died errors out instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any, pg_timeout: float
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report everything, including KeyboardInterrupt from a kill
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks and returns each rank's result.

    ``fn`` must be a module-level function (it is pickled into spawned processes).

    Raises:
        AssertionError: A rank raised (its traceback is included) or the ranks
            did not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    pg_timeout = max(30.0, timeout * 0.75)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, pg_timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                if errors and all(
                    not p.is_alive() for r, p in enumerate(procs) if r not in results and r not in errors
                ):
                    break
                continue
            (results if status == "ok" else errors)[rank] = payload
            if errors:
                # One rank failed: give its peers a short grace to report, then stop.
                deadline = min(deadline, time.monotonic() + 20.0)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    hung = [r for r in range(world_size) if r not in results and r not in errors]
    if errors or hung:
        lines = [f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
        if hung:
            lines.append(f"ranks {hung} did not finish within {timeout:.0f} s and were killed")
        raise AssertionError("\n".join(lines))
    return [results[r] for r in range(world_size)]
