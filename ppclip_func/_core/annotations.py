"""Per-leaf annotations chosen by name: norm groups and tied copies.

Patterns match a leaf's dotted name (:meth:`Leaves.names`: for
``dict(model.named_parameters())``, the parameter name). A string pattern
matches when its dot-separated parts appear, in order and whole, among the
name's parts: ``"layers.0"`` matches ``layers.0.attn.wq.weight`` but not
``layers.01.w``; ``"w"`` matches ``blocks.w`` but not ``wq``. A callable
pattern is given the name and says yes or no.

Everything here is static Python on names, so it costs nothing per step once
traced under ``torch.compile``; eagerly, the matching is cached.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch

from .._base.caches import per_process

__all__: list[str] = []

Pattern = str | Callable[[str], bool]
GroupSpec = Mapping[str, Pattern]
TiedSpec = Mapping[str, int]


def matches(pattern: Pattern, name: str) -> bool:
    """Returns whether ``pattern`` selects the leaf called ``name``."""
    if callable(pattern):
        return bool(pattern(name))
    want, parts = pattern.split("."), name.split(".")
    k = len(want)
    return any(parts[i : i + k] == want for i in range(len(parts) - k + 1))


def check_groups(groups: GroupSpec | None) -> list[str]:
    """Returns the group labels, in order.

    Raises:
        TypeError: ``groups`` is not a mapping of labels to a name pattern
            or a predicate on the name.
        ValueError: A string pattern is empty or has an empty part.
    """
    if groups is None:
        return []
    if not isinstance(groups, Mapping):
        raise TypeError(f"groups must map labels to a name pattern or a predicate, got {type(groups).__name__}")
    for label, pattern in groups.items():
        if not isinstance(pattern, str) and not callable(pattern):
            raise TypeError(f"groups[{label!r}] must be a name pattern or a callable(name) -> bool, got {pattern!r}")
        _check_pattern(pattern, f"groups[{label!r}]")
    return list(groups)


def group_index(name: str, groups: GroupSpec | None) -> int:
    """Returns the index of the first group whose pattern matches ``name``, or ``len(groups)`` for none."""
    if not groups:
        return 0
    for i, pattern in enumerate(groups.values()):
        if matches(pattern, name):
            return i
    return len(groups)


def group_indices(names: list[str], groups: GroupSpec | None) -> tuple[int, ...]:
    """Returns :func:`group_index` of every name; static, cached.

    Matching every name against every pattern can cost more than the clip
    itself on many small leaves; a training loop passes the same names and
    patterns every step.
    """
    if not groups:
        return (0,) * len(names)
    key = (tuple(names), tuple(groups.items()))
    if torch.compiler.is_compiling():
        return _indices.__wrapped__(*key)  # traced once; the cache would only draw dynamo's warning
    try:
        return _indices(*key)
    except TypeError:  # a predicate that cannot be hashed: matched every call
        return _indices.__wrapped__(*key)


@per_process
@functools.lru_cache(maxsize=16)
def _indices(names: tuple[str, ...], groups: tuple[tuple[str, Pattern], ...]) -> tuple[int, ...]:
    spec = dict(groups)
    return tuple(group_index(name, spec) for name in names)


def check_tied(tied: TiedSpec | None) -> None:
    """Raises ``TypeError``/``ValueError`` unless ``tied`` maps name patterns to ints >= 1."""
    if tied is None:
        return
    if not isinstance(tied, Mapping):
        raise TypeError(f"tied must map parameter names to stage counts, got {type(tied).__name__}")
    for pattern, n in tied.items():
        if not isinstance(pattern, str):
            raise TypeError(f"tied keys must be parameter names, got {pattern!r}")
        _check_pattern(pattern, f"tied[{pattern!r}]")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"tied[{pattern!r}] must be the number of stages holding the leaf (an int >= 1), got {n!r}"
            )


def tied_stages(names: list[str], tied: TiedSpec | None) -> list[int]:
    """Returns how many pipeline stages hold each leaf's (identical) gradient: 1 where not tied.

    Raises:
        ValueError: A ``tied`` name matches none of this rank's leaves. A
            stage declares the tied parameters it holds; a name that matches
            nothing (a typo, or positional names from ``model.parameters()``)
            would count the tied gradient once per stage, silently.
    """
    if not tied:
        return [1] * len(names)
    counts = [1] * len(names)
    for pattern, n in tied.items():
        hits = [i for i, name in enumerate(names) if matches(pattern, name)]
        if not hits:
            shown = ", ".join(repr(x) for x in names[:3]) + (", ..." if len(names) > 3 else "")
            raise ValueError(
                f"tied[{pattern!r}] matches none of this rank's gradient leaves ({shown or 'none'}). "
                "Pass dict(model.named_parameters()) so leaves carry parameter names, and on each pipeline "
                "stage declare only the tied parameters that stage holds"
            )
        for i in hits:
            counts[i] = n
    return counts


def _check_pattern(pattern: Pattern, where: str) -> None:
    if isinstance(pattern, str) and (not pattern or "" in pattern.split(".")):
        raise ValueError(f"{where} = {pattern!r} is not a dotted name (e.g. 'layers.0' or 'tok_embeddings.weight')")
