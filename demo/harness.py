"""Run a function on N real gloo ranks, with a hard timeout and per-rank error reports.

The one multi-process harness of the demo, the tests and the benchmarks.
:func:`run_ranks` starts the ranks once: each sets up the process group and
runs ``fn``, which does all of its work, because starting processes is the
slow part on 2 cores. If any rank raises, its traceback is reported; if the
ranks do not all finish within ``timeout`` seconds, every remaining process
is killed and the call fails naming the ranks that hung. Gloo's own timeout
is set below ours, so a rank stuck in a collective whose peer died errors
out instead of hanging. Every process is joined or killed before it returns.

:func:`run_cases` runs many test cases in one start of the ranks, each
reported on its own; ranks are forked from a fork server that has imported
torch once, which makes a start of 8 or 16 ranks take seconds, not minutes.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RanksFailed", "run_cases", "run_ranks"]


class RanksFailed(RuntimeError):
    """A rank raised, died, or did not finish in time; the message has each failed rank's traceback."""


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


# Imported once by the fork server, so that forked ranks start in a fraction of a second
# instead of each importing torch (tens of seconds for 8 ranks on 2 busy cores).
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float,
    start_method: str = "spawn",
    pg_timeout: float | None = None,
    preload: Sequence[str] = (),
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks and returns each rank's result.

    ``fn`` must be a module-level function (it is pickled into spawned processes).

    Args:
        fn: The function each rank runs.
        world_size: Number of ranks.
        args: Extra arguments for ``fn`` (picklable).
        timeout: Hard limit for the whole run, in seconds.
        start_method: ``"spawn"``, or ``"forkserver"``: ranks are forked from a
            server that has imported torch, ``fn``'s module and ``preload``
            once (when the server starts, at the first such call); the server
            is a fresh process, so no thread of the test process is forked.
        pg_timeout: Gloo's timeout for one collective (default: 3/4 of
            ``timeout``, at least 30 s).
        preload: More modules for the fork server to import.

    Raises:
        RanksFailed: A rank raised (its traceback is included), died without
            a report, or the ranks did not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload([*_PRELOAD, fn.__module__, *preload])
    queue = ctx.Queue()
    port = _free_port()
    if pg_timeout is None:
        pg_timeout = max(30.0, timeout * 0.75)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, pg_timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    exited = False
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                if exited:
                    break  # every rank had exited before this wait: one that never reported crashed or was killed
                exited = not any(p.is_alive() for p in procs)
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
        queue.close()
        queue.join_thread()
    hung = [r for r in range(world_size) if r not in results and r not in errors]
    if errors or hung:
        lines = [f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
        if hung:
            lines.append(f"ranks {hung} died without a report, or did not finish within {timeout:.0f} s")
        raise RanksFailed("\n".join(lines))
    return [results[r] for r in range(world_size)]


def run_cases(
    cases: Sequence[Callable[[int, int], None]],
    world_size: int,
    *,
    timeout: float,
    case_timeout: float = 60.0,
    start_method: str = "forkserver",
) -> dict[str, dict[int, str]]:
    """Runs several test cases, one after another, in one start of ``world_size`` ranks.

    Each case is a module-level ``case(rank, world_size)`` that raises on
    failure. After each case every rank posts its outcome to the process
    group's store (not a collective, so a failed case cannot put the ranks
    out of step) and waits for all the others, so a failed case does not
    stop the next one. A rank stuck in a collective that a failed peer
    skipped gets gloo's timeout (``case_timeout``) and reports that; if the
    process group is broken afterwards, the remaining cases are reported as
    not run. A rank that does not report within ``2 * case_timeout`` stops
    the whole run.

    Returns:
        ``{case name: {rank: traceback}}`` with an empty dict for a case that
        passed on every rank.

    Raises:
        RanksFailed: As :func:`run_ranks`, when the run stopped early.
    """
    per_rank = run_ranks(
        _case_worker,
        world_size,
        list(cases),
        case_timeout,
        timeout=timeout,
        start_method=start_method,
        pg_timeout=case_timeout,
        preload=sorted({case.__module__ for case in cases}),
    )
    return per_rank[0]


def _case_worker(rank: int, world_size: int, cases: list, case_timeout: float) -> dict[str, dict[int, str]]:
    store = dist.distributed_c10d._get_default_store()
    outcomes: dict[str, dict[int, str]] = {}
    broken_by = None
    for case in cases:
        name = case.__name__
        if broken_by is not None:
            outcomes[name] = dict.fromkeys(range(world_size), f"not run: the process group broke in case {broken_by}")
            continue
        try:
            case(rank, world_size)
            status = ""
        except KeyboardInterrupt:
            raise
        except BaseException:  # pytest.fail/skip raise BaseExceptions; a skip here is a failure too
            status = traceback.format_exc()
        posted = _post(store, f"case/{name}", rank, world_size, status, case_timeout)
        outcomes[name] = {r: tb for r, tb in enumerate(posted) if tb}
        if outcomes[name]:
            # A rank that failed outside the others' collectives leaves gloo pairs closed by timeouts:
            # a later case would fail for no fault of its own, so check before going on.
            try:
                dist.all_reduce(torch.zeros(1))
                healthy = "ok"
            except Exception:
                healthy = ""
            if not all(_post(store, f"health/{name}", rank, world_size, healthy, case_timeout)):
                broken_by = name
    # Rank 0 hosts the store: it must outlive every other rank's last read,
    # including the reads of "done" itself (under load a rank may still be
    # reading when rank 0 has read everything and would exit).
    _post(store, "done", rank, world_size, "done", case_timeout)
    store.set(f"left/{rank}", "1")
    if rank == 0:
        store.wait([f"left/{r}" for r in range(world_size)], datetime.timedelta(seconds=2 * case_timeout))
    return outcomes


def _post(store: Any, key: str, rank: int, world_size: int, value: str, case_timeout: float) -> list[str]:
    """Posts this rank's ``value`` under ``key`` and returns every rank's, in rank order."""
    keys = [f"{key}/{r}" for r in range(world_size)]
    store.set(keys[rank], value)
    try:
        # Longer than gloo's timeout, so a peer stuck in a collective this rank skipped gets to report.
        store.wait(keys, datetime.timedelta(seconds=2 * case_timeout))
    except Exception:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(
            f"{key}: ranks {missing} did not report within {2 * case_timeout:.0f} s of this rank; "
            f"the cases after it were not run. This rank's outcome:\n{value or 'passed'}"
        ) from None
    return [store.get(k).decode() for k in keys]
