"""A threshold per group, and groups kept out of the clip, from the clip's one collective.

Trainers that mix optimizers keep some parameters out of the clip (Muon's
matrices, clipped by their own orthogonalization: Megatron-LM #5394,
DeepSpeed #8439, OLMo-core PR 812), and some clip a group (the embedding,
the experts) at a threshold of its own. Both need each group's norm, which
``groups=`` already carries in the one all-reduce: this module recombines
the reduced entries of the groups that count into the total, and scales each
group's leaves by the coefficient of its own threshold and the total's,
whichever is smaller. Group membership is static (names), so each group's
leaves are scaled with one ``_foreach_mul_`` per (device, dtype) and one 0-dim
coefficient, with no per-leaf list and no host read.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._core.agreement import agreed, label_set
from .._core.annotations import GroupSpec, TiedSpec, check_groups
from .._core.excluded import check_exclude, group_members, included_total
from .._core.measure import Measured
from .._core.norms import NormKind, norm_kind
from .._core.scale import clip_coefficient, finite_mask, scale
from .._core.setup import Checked, GroupNorms, NormOptions, PpDim, check_clip_args
from .path import output, run

__all__ = ["clip_grad_norm_by_group", "clip_grad_norm_by_group_"]

PyTree = TypeVar("PyTree")
Threshold = float | torch.Tensor


def check_group_args(
    groups: Any, max_norm: Any, group_max_norm: Any, exclude: Any, eps: float, nonfinite: str, norm_type: Any
) -> Checked:
    """Returns the norm kind, labels, excluded labels and ``group_max_norm`` as a dict, checked; raises naming
    the offending label (static checks)."""
    if groups is None:
        raise TypeError("groups is required: {label: pattern} says which leaves each threshold applies to")
    labels = check_groups(groups)
    if max_norm is not None:
        check_clip_args(max_norm, eps, nonfinite)
    else:
        check_clip_args(math.inf, eps, nonfinite)
    group_max_norm = dict(group_max_norm or {})
    _, excluded = check_exclude(groups, exclude)
    unknown = [label for label in group_max_norm if label not in labels]
    if unknown:
        raise ValueError(f"group_max_norm names {unknown[0]!r}, which is not a label of groups ({labels})")
    both = sorted(excluded & set(group_max_norm))
    if both:
        raise ValueError(f"group {both[0]!r} is both excluded (never scaled) and given a threshold in group_max_norm")
    for label, value in group_max_norm.items():
        try:
            check_clip_args(value, eps, nonfinite)
        except (TypeError, ValueError) as e:
            raise type(e)(f"group_max_norm[{label!r}]: {e}") from None
    return Checked(norm_kind(norm_type), labels, excluded, group_max_norm)


def _scale_groups(
    measured: Measured,
    kind: NormKind,
    groups: GroupSpec,
    labels: list[str],
    max_norm: Threshold | None,
    group_max_norm: dict[str, Threshold],
    excluded: frozenset[str],
    eps: float,
    nonfinite: str,
    *,
    inplace: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    total = included_total(measured, kind, labels, excluded)
    keep = finite_mask(total, kind.p, nonfinite)
    leaves = measured.leaves
    members = group_members(leaves.names(), groups)  # static: names only
    out = list(leaves.shards)
    for g, idx in members.items():
        label = labels[g] if g < len(labels) else None
        if label in excluded:
            continue  # measured and returned, never scaled
        own = (group_max_norm[label], measured.per_group[label]) if label in group_max_norm else None
        if max_norm is None and own is None:
            continue
        coefficient = functools.partial(_group_coefficient, max_norm, total, own, eps)
        for i, t in zip(idx, scale([leaves.shards[i] for i in idx], coefficient, inplace=inplace, keep=keep)):
            out[i] = t
    return total, out


def _group_coefficient(
    max_norm: Threshold | None,
    total: torch.Tensor,
    own: tuple[Threshold, torch.Tensor] | None,
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The smaller of the overall and the group's own clip coefficient, computed in ``dtype``."""
    overall = None if max_norm is None else clip_coefficient(max_norm, total, eps, dtype)
    if own is None:
        return overall  # type: ignore[return-value]  # not None: the caller skips a group with neither threshold
    group = clip_coefficient(own[0], own[1], eps, dtype)
    return group if overall is None else torch.minimum(overall, group)


@torch.no_grad()
def clip_grad_norm_by_group_(
    parameters: torch.Tensor | Iterable[torch.Tensor] | Any,
    mesh: DeviceMesh | None,
    groups: GroupSpec,
    max_norm: Threshold | None = None,
    norm_type: float = 2.0,
    *,
    group_max_norm: Mapping[str, Threshold] | None = None,
    exclude: Collection[str] = (),
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> tuple[torch.Tensor, GroupNorms]:
    """Clips ``p.grad`` in place with a threshold per group, some groups left out; one collective.

    Each group's norm comes from the clip's one all-reduce (as ``groups=``
    does for :func:`clip_grad_norm_`). The total is the norm of every leaf
    outside the ``exclude`` groups; a leaf of an included group is scaled by
    ``min(max_norm / total, group_max_norm[its label] / its group's norm, 1)``
    (each term only where given, ``eps`` added to each norm), so after the
    clip the total is at most ``max_norm`` and each such group at most its own
    threshold. Leaves of excluded groups are measured, returned, and never
    scaled; they are not in the total, nor in ``nonfinite``'s decision.

    Args:
        parameters: As :func:`clip_grad_norm_`; ``dict(model.named_parameters())``
            so that patterns see parameter names.
        mesh: The world mesh, or ``None`` (see :func:`global_grad_norm`).
        groups: ``{label: pattern}`` (see :func:`global_grad_norm`); a leaf
            joins the first group that matches; leaves in no group count in
            the total and are scaled by ``max_norm`` only.
        max_norm: The threshold of the total, or ``None`` for none.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf``.
        group_max_norm: ``{label: threshold}`` for groups clipped at their own
            norm (a number or a 0-dim tensor).
        exclude: Labels of groups kept out of the total and never scaled
            (e.g. the parameters another optimizer normalizes itself).
        pp_dim, pp_mesh, eps, tied, partial, nonfinite, overflow_safe: As
            :func:`clip_grad_norm_`.

    Returns:
        ``(total_norm, {label: group_norm})``: the total over the groups that
        count, before clipping, and every group's norm, excluded ones too.

    Raises:
        TypeError, ValueError, RuntimeError: As :func:`clip_grad_norm_`, and
            for a label of ``group_max_norm`` or ``exclude`` that is not one
            of ``groups`` (named), or a group both excluded and given a threshold.

    Example:
        >>> import torch
        >>> from ppclip_func import clip_grad_norm_by_group_
        >>> params = {n: torch.nn.Parameter(torch.zeros(2)) for n in ("embed", "mlp", "muon")}
        >>> for p, v in zip(params.values(), (3.0, 4.0, 100.0)):
        ...     p.grad = torch.tensor([v, 0.0])
        >>> groups = {"embed": "embed", "mlp": "mlp", "muon": "muon"}
        >>> total, norms = clip_grad_norm_by_group_(params, None, groups, max_norm=2.5,
        ...                                         group_max_norm={"embed": 1.0}, exclude={"muon"})
        >>> total, norms["muon"]  # the total leaves muon out
        (tensor(5., dtype=torch.float64), tensor(100., dtype=torch.float64))
        >>> [round(float(p.grad[0]), 4) for p in params.values()]  # embed by its own 1.0, mlp by 2.5 / 5
        [1.0, 2.0, 100.0]
    """
    options = (groups, max_norm, group_max_norm, exclude, eps, nonfinite)
    layout = (pp_dim, pp_mesh, tied, partial, overflow_safe)
    measured, total, _ = _by_group(
        "clip_grad_norm_by_group_", parameters, mesh, norm_type, options, layout, in_place=True
    )
    return total, measured.per_group


@torch.no_grad()
def clip_grad_norm_by_group(
    grads: PyTree,
    mesh: DeviceMesh | None,
    groups: GroupSpec,
    max_norm: Threshold | None = None,
    norm_type: float = 2.0,
    *,
    group_max_norm: Mapping[str, Threshold] | None = None,
    exclude: Collection[str] = (),
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> tuple[PyTree, torch.Tensor, GroupNorms]:
    """The pure form of :func:`clip_grad_norm_by_group_`: returns ``(clipped, total_norm, {label: norm})``.

    Leaves that are not scaled (excluded groups, or no threshold applies)
    are not copied: the input tensors (a DTensor's local shard, rewrapped);
    the others are new tensors.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients or ``None``.
        mesh, groups, max_norm, norm_type, group_max_norm, exclude, pp_dim,
            pp_mesh, eps, tied, partial, nonfinite, overflow_safe: As
            :func:`clip_grad_norm_by_group_`.

    Example:
        >>> import torch
        >>> from ppclip_func import clip_grad_norm_by_group
        >>> grads = {"attn": torch.tensor([3.0, 4.0]), "experts": torch.tensor([0.0, 10.0])}
        >>> clipped, total, norms = clip_grad_norm_by_group(
        ...     grads, None, {"experts": "experts"}, max_norm=100.0, group_max_norm={"experts": 2.0})
        >>> clipped["attn"], clipped["experts"], total
        (tensor([3., 4.]), tensor([0.0000, 2.0000]), tensor(11.1803, dtype=torch.float64))
    """
    options = (groups, max_norm, group_max_norm, exclude, eps, nonfinite)
    layout = (pp_dim, pp_mesh, tied, partial, overflow_safe)
    measured, total, scaled = _by_group(
        "clip_grad_norm_by_group", grads, mesh, norm_type, options, layout, in_place=False
    )
    return output(measured, scaled), total, measured.per_group


def _by_group(
    form: str,
    given: Any,
    mesh: DeviceMesh | None,
    norm_type: float,
    options: tuple[Any, ...],
    layout: tuple[Any, ...],
    *,
    in_place: bool,
) -> tuple[Measured, torch.Tensor, list[torch.Tensor]]:
    """Both forms' one path: ``options`` is ``(groups, max_norm, group_max_norm, exclude, eps, nonfinite)``,
    ``layout`` ``(pp_dim, pp_mesh, tied, partial, overflow_safe)``."""
    groups, max_norm, group_max_norm, exclude, eps, nonfinite = options
    pp_dim, pp_mesh, tied, partial, overflow_safe = layout
    agree = agreed(group_max_norm=group_max_norm, exclude=label_set(exclude), eps=eps, nonfinite=nonfinite)
    opts = NormOptions(pp_dim, groups, tied, partial, overflow_safe, pp_mesh=pp_mesh, also_agree=agree)

    def check() -> Checked:
        return check_group_args(groups, max_norm, group_max_norm, exclude, eps, nonfinite, norm_type)

    found, measured = run(form, given, mesh, norm_type, opts, check, in_place=in_place)
    total, scaled = _scale_groups(
        measured,
        found.kind,
        groups,
        list(found.labels),
        max_norm,
        found.thresholds,
        found.excluded,
        eps,
        nonfinite,
        inplace=in_place,
    )
    return measured, total, scaled
