"""One pytest test per case; the selected cases of a run start the ranks once (``demo.harness.run_cases``).

Starting processes is the slow part on 2 cores, so the ranks are started once
per run, not per case: a run is every selected case (collected, and not
deselected by ``-m``/``-k``/``--deselect``, nor marked skip) of one
:func:`real_rank_test` call, or, with ``share=True``, of every such call in
the session with the same world size, from any module. A run's timeouts are
its cases' largest ``case_timeout``: gloo's for each collective, and twice
that for every rank to report a case; its hard limit is 120 s plus 60 s per
case, after which every rank is killed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import pytest

from demo.harness import RanksFailed, run_cases

Case = Callable[[int, int], None]

# Which run a case belongs to: (group, world size); the group is "shared" or one call's own.
_RUN_ATTR = "_real_rank_run"
_TIMEOUT_ATTR = "_real_rank_case_timeout"
_RUNS: dict[tuple, dict[str, dict[int, str]] | str] = {}


def _selected(session: pytest.Session, key: tuple) -> list[Case]:
    """The cases of run ``key`` that this session will run, in collection order, each once."""
    cases: dict[str, Case] = {}
    for item in session.items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        if getattr(case, _RUN_ATTR, None) != key or item.get_closest_marker("skip") is not None:
            continue
        if cases.setdefault(case.__name__, case) is not case:
            raise RuntimeError(f"two cases of one {key[1]}-rank run are named {case.__name__}: rename one")
    return list(cases.values())


def case_failures(request: pytest.FixtureRequest, case: Case) -> str:
    """Why ``case`` failed, by rank ("" if it passed); the first case of its run to ask runs them all."""
    key = getattr(case, _RUN_ATTR)
    if key not in _RUNS:
        world_size = key[1]
        selected = _selected(request.session, key) or [case]
        case_timeout = max(getattr(c, _TIMEOUT_ATTR) for c in selected)
        try:
            _RUNS[key] = run_cases(selected, world_size, timeout=120 + 60 * len(selected), case_timeout=case_timeout)
        except (RanksFailed, AssertionError) as e:
            _RUNS[key] = f"the {world_size}-rank run stopped early:\n{e}"
    run = _RUNS[key]
    if isinstance(run, str):
        return run
    if case.__name__ not in run:
        return f"{case.__name__} was not in its {key[1]}-rank run"
    by_traceback: dict[str, list[int]] = {}
    for rank, tb in sorted(run[case.__name__].items()):
        by_traceback.setdefault(tb, []).append(rank)
    return "\n".join(f"--- ranks {ranks} ---\n{tb}" for tb, ranks in by_traceback.items())


def join_run(case: Case, world_size: int, case_timeout: float, *, share: bool, group: object = None) -> Case:
    """Marks ``case`` as one of the run its test belongs to (see the module docstring); returns it."""
    key = ("shared" if share else group, world_size)
    if getattr(case, _RUN_ATTR, key) != key:
        raise RuntimeError(f"{case.__name__} is in two runs: {getattr(case, _RUN_ATTR)} and {key}")
    setattr(case, _RUN_ATTR, key)
    setattr(case, _TIMEOUT_ATTR, case_timeout)
    return case


def real_rank_test(
    cases: Sequence[Case],
    world_size: int,
    *,
    case_timeout: float = 30.0,
    skip: Mapping[str, str] | None = None,
    slow: Collection[str] = (),
    share: bool = False,
) -> Callable[..., None]:
    """Returns a test function parametrized over ``cases``; the first one to run starts the ranks for its run.

    Use as ``test_on_real_ranks = real_rank_test(CASES, 4)`` at module level.
    Each case passes or fails on its own, with every failed rank's traceback.
    ``skip`` maps a case's name to why it cannot run here: the ranks never run
    it, and pytest reports it skipped with that reason. The cases named in
    ``slow`` are marked ``slow`` (left out of ``make test-quick``).
    ``share=True`` runs
    the cases in the same start of the ranks as every other shared case of
    this world size (for cases that leave no global
    state behind: no trainer, no environment variables).
    """
    skip = skip or {}
    group = object()  # this call's own run, unless shared
    params = []
    for c in cases:
        join_run(c, world_size, case_timeout, share=share, group=group)
        marks = [pytest.mark.skip(reason=skip[c.__name__])] if c.__name__ in skip else []
        marks += [pytest.mark.slow] if c.__name__ in slow else []
        params.append(pytest.param(c, id=c.__name__, marks=marks))

    @pytest.mark.parametrize("case", params)
    def test_on_real_ranks(case: Case, request: pytest.FixtureRequest) -> None:
        failures = case_failures(request, case)
        assert not failures, failures

    return test_on_real_ranks
