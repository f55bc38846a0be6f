"""A clip call's setup: the options every public form shares, as one frozen value, and their checks.

Each public form takes the same layout options (``pp_dim``, ``pp_mesh``,
``groups``, ``tied``, ``partial``, ``overflow_safe``, and the per-parameter
index where it has one) and the same clip options (``max_norm``, ``eps``,
``nonfinite``). They become one :class:`NormOptions`, whose fields are
static Python and hashable where they can be, so that every rank can check
that its peers passed the same (:func:`static_options`, read by ``_core.agreement``),
and so that a compiled step is keyed on them. The checks here read the
options alone, never a tensor value, and trace under ``torch.compile``
(symbolic numbers included): what needs the mesh or the leaves is checked
where those are known (``_core.measure``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from .agreement import marked
from .annotations import GroupSpec, TiedSpec, check_groups, check_tied
from .layout import mesh_shape
from .norms import NormKind
from .param_norms import ParamIndex
from .scale import NONFINITE_POLICIES

__all__: list[str] = []

PpDim = str | Sequence[str] | None
GroupNorms = dict[str, torch.Tensor]
PARTIAL_POLICIES = ("error", "reduce")


@dataclasses.dataclass(frozen=True)
class NormOptions:
    """How a norm is measured; every field is static Python."""

    pp_dim: PpDim = None
    groups: GroupSpec | None = None
    tied: TiedSpec | None = None
    partial: str = "error"
    overflow_safe: bool = False
    params: ParamIndex | None = None
    pp_mesh: DeviceMesh | None = None
    # The caller's other static options, ``(name, value)``, that every rank must pass alike
    # (thresholds, ``exclude``, the adaptive rule's static fields): checked with these (``_core.agreement``). A
    # repeated call compares them as given; hashed or compared on a miss, each is ``_core.agreement.marked``.
    also_agree: tuple[tuple[str, Any], ...] = ()
    # How many entries of other statistics ride the collective after the norms', summed over the ranks
    # (a step's loss, its token count, its non-finite flags: ``_clip.step``); only with a sum-type norm.
    sums: int = 0


# A NormOptions' fields as a tuple (operator.attrgetter: one C call, where dataclasses.astuple deep-copies).
OPTION_FIELDS = operator.attrgetter(*(field.name for field in dataclasses.fields(NormOptions)))


class Checked(NamedTuple):
    """What a form's own checks found: the norm, and the group labels and excluded ones where it has groups."""

    kind: NormKind
    labels: Sequence[str] = ()
    excluded: frozenset[str] = frozenset()
    thresholds: Any = None  # the per-group clip's thresholds by label


def check_clip_args(max_norm: float | torch.Tensor, eps: float, nonfinite: str) -> None:
    """Raises ``TypeError``/``ValueError`` for a malformed ``max_norm``, ``eps`` or ``nonfinite``."""
    if isinstance(max_norm, torch.Tensor):
        if max_norm.dim() != 0:
            raise ValueError(f"max_norm must be a number or a 0-dim tensor, got shape {tuple(max_norm.shape)}")
    elif isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm must be a number or a 0-dim tensor, got {type(max_norm).__name__}")
    elif not max_norm >= 0:  # NaN too; math.isnan fails on the symbolic float torch.compile may pass
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    # `not x >= 0` is false for NaN too: math.isnan fails on the symbolic float torch.compile passes with dynamic=True.
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")


def check_norm_options(opts: NormOptions) -> list[str]:
    """Raises ``TypeError``/``ValueError`` for a malformed option of ``opts``; returns the group labels.

    Only what the options say alone: whether ``pp_dim`` names a dim of the
    mesh, or ``tied`` a leaf, is known with the mesh and the leaves.
    """
    if opts.partial not in PARTIAL_POLICIES:
        raise ValueError(f"partial must be one of {PARTIAL_POLICIES}, got {opts.partial!r}")
    if not isinstance(opts.overflow_safe, bool):
        raise TypeError(f"overflow_safe must be a bool, got {opts.overflow_safe!r}")
    if opts.params is not None and not isinstance(opts.params, ParamIndex):
        raise TypeError(f"param_norms must be a ParamIndex from param_norm_index(), got {type(opts.params).__name__}")
    pp_dim = opts.pp_dim
    if pp_dim is not None and not (
        isinstance(pp_dim, str) or (isinstance(pp_dim, Sequence) and all(isinstance(d, str) for d in pp_dim))
    ):
        raise TypeError(f"pp_dim must be a mesh dim name, a sequence of them, or None, got {pp_dim!r}")
    if opts.pp_mesh is not None and not isinstance(opts.pp_mesh, DeviceMesh):
        raise TypeError(f"pp_mesh must be a DeviceMesh or None, got {type(opts.pp_mesh).__name__}")
    labels = check_groups(opts.groups)
    check_tied(opts.tied)
    return labels


def static_options(p: Any, opts: NormOptions, state: Any) -> dict[str, Any]:
    """What every rank must pass alike, by option (checked once per configuration by ``_core.agreement``).

    ``tied`` is checked apart: each stage declares the tied leaves it holds.
    """
    return {
        "the number of group labels": len(opts.groups) if isinstance(opts.groups, Mapping) else None,
        "groups": opts.groups,
        "norm_type": p,
        "partial": opts.partial,
        "overflow_safe": opts.overflow_safe,
        "param_norms": opts.params.names if isinstance(opts.params, ParamIndex) else opts.params,
        "pp_dim": opts.pp_dim,
        "pp_mesh": (opts.pp_mesh.mesh_dim_names, mesh_shape(opts.pp_mesh))
        if isinstance(opts.pp_mesh, DeviceMesh)
        else opts.pp_mesh,
        "the adaptive state's type": type(state).__name__ if state is not None else None,
        "the step's statistics": opts.sums,
        **{name: marked(value) for name, value in opts.also_agree},
    }


def n_entries(opts: NormOptions) -> int:
    """Length of the statistics vector's first half: groups, the leaves in none, parameters."""
    params = len(opts.params.names) if isinstance(opts.params, ParamIndex) else 0
    try:
        return len(check_groups(opts.groups)) + 1 + params
    except (TypeError, ValueError):
        return 1 + params  # every rank raises the same error before any collective


def norm_p(norm_type: Any) -> Any:
    """``norm_type`` as :func:`~ppclip_func._core.norms.norm_kind` reads it (a float), or as given when it is not a number."""
    is_number = isinstance(norm_type, (int, float)) and not isinstance(norm_type, bool)
    return float(norm_type) if is_number else norm_type
