"""Per-leaf annotations chosen by pytree path: norm groups and tied copies.

Both are static Python on the leaf's path string (``torch.utils._pytree.keystr``,
e.g. ``['layers.0.attn.wq.weight']`` for a dict of named grads), so they cost
nothing per step and trace away under ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

__all__: list[str] = []

GroupSpec = Mapping[str, str | Callable[[str], bool]]
TiedSpec = Mapping[str, int]


def check_groups(groups: GroupSpec | None) -> list[str]:
    """Returns the group labels, in order.

    Raises:
        TypeError: ``groups`` is not a mapping of labels to a path substring
            or a predicate on the path.
    """
    if groups is None:
        return []
    if not isinstance(groups, Mapping):
        raise TypeError(f"groups must map labels to a path substring or a predicate, got {type(groups).__name__}")
    for label, pattern in groups.items():
        if not isinstance(pattern, str) and not callable(pattern):
            raise TypeError(f"groups[{label!r}] must be a path substring or a callable(path) -> bool, got {pattern!r}")
    return list(groups)


def group_index(path: str, groups: GroupSpec | None) -> int:
    """Returns the index of the first group whose pattern matches ``path``, or ``len(groups)`` for none."""
    if not groups:
        return 0
    for i, pattern in enumerate(groups.values()):
        if pattern(path) if callable(pattern) else pattern in path:
            return i
    return len(groups)


def check_tied(tied: TiedSpec | None) -> None:
    """Raises ``TypeError``/``ValueError`` unless ``tied`` maps path substrings to ints >= 1."""
    if tied is None:
        return
    if not isinstance(tied, Mapping):
        raise TypeError(f"tied must map path substrings to stage counts, got {type(tied).__name__}")
    for pattern, n in tied.items():
        if not isinstance(pattern, str):
            raise TypeError(f"tied keys must be path substrings, got {pattern!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"tied[{pattern!r}] must be the number of stages holding the leaf (an int >= 1), got {n!r}"
            )


def tied_stages(path: str, tied: TiedSpec | None) -> int:
    """Returns how many pipeline stages hold the (identical) gradient at ``path``; 1 if not tied."""
    if tied:
        for pattern, n in tied.items():
            if pattern in path:
                return n
    return 1
