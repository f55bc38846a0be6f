"""Distributed pieces of the benchmarks: the torchtitan-style baseline, rank spawning, counting.

Ranks are started by the shared harness, :func:`demo.harness.run_ranks`;
:func:`spawn` adds what every benchmark rank sets up first.

The baseline is written here from public torch APIs, in the shape torchtitan's
``clip_grad_norm_`` has for pipeline parallelism: ``get_total_norm`` over the
DTensor grads of this stage, ``full_tensor()`` (one all-reduce per partially
reduced mesh dim), an all-reduce of the p-th power over the pipeline group,
then ``clip_grads_with_norm_``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._functorch.config
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from demo.harness import run_ranks

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
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float) -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` gloo ranks; returns each rank's result.

    Every process is joined or killed before this returns, also on error or
    after ``timeout`` seconds.

    Raises:
        demo.harness.RanksFailed: A rank raised (tracebacks included), died, or ranks did not finish in time.
    """
    return run_ranks(_bench_rank, world, fn, *args, timeout=timeout)


def _bench_rank(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    # The baseline's full_tensor() over two Partial mesh dims makes DTensor warn that it runs two
    # all-reduces, on every rank; that cost is what the study measures, so the warning is noise here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # AOTAutograd's disk cache cannot pickle a DeviceMesh (it warns and moves on) and keys DTensor inputs
    # by global shape, so ranks with uneven shards could share kernels that do not fit them.
    torch._functorch.config.enable_autograd_cache = False
    return fn(rank, world, *args)
