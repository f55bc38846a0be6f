"""The multi-case harness (``run_cases``) reports failing ranks and never leaves ranks hanging.

The layout tests run many cases in one start of the ranks; this pins what
happens when one of them fails: on every rank, on one rank after all the
collectives, or on one rank before a collective its peer waits in.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from demo.harness import run_cases


def passes(rank: int, world_size: int) -> None:
    t = torch.full((1,), float(rank))
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size))


def fails_everywhere(rank: int, world_size: int) -> None:
    raise AssertionError(f"rank {rank}: symmetric failure")


def fails_on_rank_1_after_collectives(rank: int, world_size: int) -> None:
    passes(rank, world_size)
    assert rank != 1, "rank 1: local check failed"


def rank_1_skips_a_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up before the collective")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here until gloo's timeout


def passes_again(rank: int, world_size: int) -> None:
    passes(rank, world_size)


def test_failures_are_reported_by_rank_and_later_cases_still_run():
    cases = [passes, fails_everywhere, fails_on_rank_1_after_collectives, passes_again]
    out = run_cases(cases, 2, timeout=120, case_timeout=10)
    assert out["passes"] == {} and out["passes_again"] == {}
    assert sorted(out["fails_everywhere"]) == [0, 1]
    assert "rank 0: symmetric failure" in out["fails_everywhere"][0]
    assert list(out["fails_on_rank_1_after_collectives"]) == [1]
    assert "rank 1: local check failed" in out["fails_on_rank_1_after_collectives"][1]


def test_a_rank_that_skips_a_collective_does_not_hang_its_peer():
    start = time.monotonic()
    out = run_cases([passes, rank_1_skips_a_collective, passes_again], 2, timeout=120, case_timeout=5)
    assert time.monotonic() - start < 60
    failed = out["rank_1_skips_a_collective"]
    assert "rank 1 gives up before the collective" in failed[1]
    assert "Timed out" in failed[0] or "timeout" in failed[0].lower(), failed[0]
    # The timeout closed gloo's connections: the next case is reported as not run, not as its own failure.
    assert out["passes_again"] == dict.fromkeys(
        [0, 1], "not run: the process group broke in case rank_1_skips_a_collective"
    )
