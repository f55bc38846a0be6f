"""One pytest test per case, all cases run in one start of the ranks (``demo.harness.run_cases``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import pytest

from demo.harness import RanksFailed, run_cases

Case = Callable[[int, int], None]


def real_rank_test(
    cases: Sequence[Case], world_size: int, *, case_timeout: float = 30.0, skip: Mapping[str, str] | None = None
) -> Callable[[Case], None]:
    """Returns a test function parametrized over ``cases``; the first one to run starts the ranks for all.

    Use as ``test_on_real_ranks = real_rank_test(CASES, 4)`` at module level.
    Each case passes or fails on its own, with every failed rank's traceback.
    ``skip`` maps a case's name to why it cannot run here: the ranks never run
    it, and pytest reports it skipped with that reason.
    """
    skip = skip or {}
    runnable = [c for c in cases if c.__name__ not in skip]

    @functools.cache
    def run() -> dict[str, dict[int, str]] | str:
        try:
            return run_cases(runnable, world_size, timeout=120 + 60 * len(runnable), case_timeout=case_timeout)
        except (RanksFailed, AssertionError) as e:
            return f"the {world_size}-rank run stopped early:\n{e}"

    params = [
        pytest.param(c, id=c.__name__, marks=[pytest.mark.skip(reason=skip[c.__name__])] if c.__name__ in skip else [])
        for c in cases
    ]

    @pytest.mark.parametrize("case", params)
    def test_on_real_ranks(case: Case) -> None:
        outcome = run()
        assert not isinstance(outcome, str), outcome
        failures = outcome[case.__name__]
        assert not failures, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))

    return test_on_real_ranks
