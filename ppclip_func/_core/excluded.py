"""Groups kept out of a clip: which leaves and parameters count, and their total from the one collective.

Static on names (a leaf's group is the first whose pattern matches it, as for
``groups=``), except :func:`included_total`, which decodes the entries of the
groups that count from the clip's all-reduced statistics vector: no second
collective.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import Any

import torch

from .._base.caches import per_process
from .._base.devices import constant
from .annotations import GroupSpec, check_groups, group_indices
from .measure import Measured
from .norms import NormKind
from .tree import Leaves

__all__: list[str] = []


def check_exclude(groups: GroupSpec | None, exclude: Any) -> tuple[list[str], frozenset[str]]:
    """Returns ``(group labels, excluded labels)``; raises naming a label that is not one of ``groups``."""
    labels = check_groups(groups)
    if not isinstance(exclude, Collection) or isinstance(exclude, str):
        raise TypeError(f"exclude must be a collection of group labels, got {exclude!r}")
    unknown = [label for label in exclude if label not in labels]
    if unknown:
        raise ValueError(f"exclude names {unknown[0]!r}, which is not a label of groups ({labels})")
    return labels, frozenset(exclude)


def group_members(names: list[str], groups: GroupSpec | None) -> dict[int, list[int]]:
    """``{group index: positions of its leaves}`` (``len(groups)`` for leaves in no group); static, cached."""
    indices = group_indices(names, groups)
    # Traced once under torch.compile, where the cache would only draw dynamo's warning.
    return _members.__wrapped__(indices) if torch.compiler.is_compiling() else _members(indices)


@per_process
@functools.lru_cache(maxsize=16)
def _members(indices: tuple[int, ...]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for i, g in enumerate(indices):
        members.setdefault(g, []).append(i)
    return members


def included_leaves(
    leaves: Leaves, groups: GroupSpec | None, labels: Sequence[str], excluded: frozenset[str]
) -> list[int]:
    """The positions of the leaves outside the excluded groups (static: names only)."""
    if not excluded:
        return list(range(len(leaves.tensors)))
    members = group_members(leaves.names(), groups)
    kept = [idx for g, idx in members.items() if (labels[g] if g < len(labels) else None) not in excluded]
    return sorted(i for idx in kept for i in idx)


def included_params(
    names: tuple[str, ...], groups: GroupSpec | None, labels: Sequence[str], excluded: frozenset[str]
) -> list[bool] | None:
    """A bool per parameter name: outside the excluded groups (static), or ``None`` when nothing is excluded."""
    if not excluded:
        return None
    counted = [label not in excluded for label in labels] + [True]  # the last index: leaves in no group
    return [counted[g] for g in group_indices(list(names), groups)]


def included_total(measured: Measured, kind: NormKind, labels: Sequence[str], excluded: frozenset[str]) -> torch.Tensor:
    """The norm of every leaf outside the excluded groups, from the reduced statistics (no collective).

    The entries of the groups that count (and of the leaves in no group) are
    decoded together as the total of the whole vector is: a group with no
    leaf anywhere adds nothing, a NaN anywhere among them makes it NaN.
    """
    if not excluded:
        return measured.total
    reduced, n = measured.reduced, measured.entries
    keep = [i for i, label in enumerate(labels) if label not in excluded] + [len(labels)]
    idx = constant(keep + [n + i for i in keep], torch.int64, reduced.device)
    _, total = kind.decode(reduced[idx], per_group=False, n_total=len(keep))
    return total.to(measured.total.dtype)


def without_excluded(
    measured: Measured, kind: NormKind, groups: GroupSpec | None, labels: Sequence[str], excluded: frozenset[str]
) -> tuple[Measured, list[int]]:
    """``measured`` with the total over the included groups, and the positions of the leaves to scale."""
    if not excluded:
        return measured, list(range(len(measured.leaves.tensors)))
    total = included_total(measured, kind, labels, excluded)
    return dataclasses.replace(measured, total=total), included_leaves(measured.leaves, groups, labels, excluded)
