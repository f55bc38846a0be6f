"""Distributed pieces of the benchmarks: the torchtitan-style baseline, rank spawning, counting.

The baseline is written here from public torch APIs, in the shape torchtitan's
``clip_grad_norm_`` has for pipeline parallelism: ``get_total_norm`` over the
DTensor grads of this stage, ``full_tensor()`` (one all-reduce per partially
reduced mesh dim), an all-reduce of the p-th power over the pipeline group,
then ``clip_grads_with_norm_``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._functorch.config
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

__all__ = ["count_collectives", "single_rank_group", "spawn", "torchtitan_clip", "torchtitan_norm"]


@torch.no_grad()
def torchtitan_norm(
    parameters: list[torch.Tensor], norm_type: float = 2.0, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global norm as torchtitan computes it for pipeline parallelism."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type, False, True)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()  # one all-reduce per Partial mesh dim
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total_norm **= norm_type
            dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=pp_group)
            total_norm **= 1.0 / norm_type
    return total_norm


@torch.no_grad()
def torchtitan_clip(
    parameters: list[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The per-stage torch clip, completed over the pipeline as torchtitan does it."""
    total_norm = torchtitan_norm(parameters, norm_type, pp_group)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, True)
    return total_norm


def count_collectives(fn: Callable[[], Any]) -> int:
    """Runs ``fn`` once and returns how many collectives reached the communication backend.

    Counted from the profiler's backend events (``gloo:all_reduce``, ...: one
    per collective on the wire, however it was issued: c10d, functional, or
    from a compiled graph). A dispatch mode such as ``CommDebugMode`` would
    stop ``torch.compile`` from running its graph, so it cannot count there.
    """
    with _stderr_silenced(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.split(":")[0] in _BACKENDS and "barrier" not in e.name)


_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Points file descriptor 2 at /dev/null: the profiler's C++ side prints a line per start and stop."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """A one-rank gloo process group, so that DTensors exist in a single process."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, results: Any, pg_timeout: float):
    os.environ["OMP_NUM_THREADS"] = "1"
    # The baseline's full_tensor() over two Partial mesh dims makes DTensor warn that it runs two
    # all-reduces, on every rank; that cost is what the study measures, so the warning is noise here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # AOTAutograd's disk cache cannot pickle a DeviceMesh (it warns and moves on) and keys DTensor inputs
    # by global shape, so ranks with uneven shards could share kernels that do not fit them.
    torch._functorch.config.enable_autograd_cache = False
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float) -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` gloo ranks; returns each rank's result.

    Every process is joined or killed before this returns, also on error or
    after ``timeout`` seconds.

    Raises:
        RuntimeError: A rank raised (tracebacks included) or ranks did not finish in time.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, results, max(30.0, 0.75 * timeout)), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    ok: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(ok) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs):
                    break  # every rank has exited; those that never reported count as missing
                continue
            (ok if status == "ok" else errors)[rank] = payload
            if errors:
                deadline = min(deadline, time.monotonic() + 20.0)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        results.join_thread()
    missing = [r for r in range(world) if r not in ok and r not in errors]
    if errors or missing:
        lines = [f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            lines.append(f"ranks {missing} died without a report, or did not finish within {timeout:.0f} s")
        raise RuntimeError("\n".join(lines))
    return [ok[r] for r in range(world)]
