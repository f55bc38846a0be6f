"""Per-parameter norms: where each parameter's statistic goes in the one collective.

Pipeline stages hold different parameters, so the slots of the statistics
vector that carry per-parameter norms must be agreed on by every rank before
any step: :func:`param_norm_index` gathers every rank's parameter names once
(``all_gather_object`` over the world's process group, a host-side setup
call, never inside a step) and lays out one slot per name of the whole
model, in the same order on every rank. Each step then adds ``N`` entries to
the vector the clip already all-reduces: still one collective.

A name held by several stages (a tied embedding and output head) is one
parameter and one slot; its stages' contributions add up there as they do in
the total, so declare it in ``tied`` to count it once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._base import torch_compat
from .layout import pipeline_stages, resolve_world
from .tree import flatten_grads

__all__: list[str] = []


@dataclasses.dataclass(frozen=True, eq=False)
class ParamIndex:
    """Where each parameter's norm lives in the statistics vector; the same on every rank.

    Built by :func:`param_norm_index`; pass it to a clip as ``param_norms=``.

    Attributes:
        names: Every parameter of the whole model (all pipeline stages), in
            slot order: stage by stage in rank order, each rank's names in its
            tree's order, a name seen before skipped.
        local_slots: For this rank's tree, the slot of each leaf, by its
            position in the flattened tree (``None`` leaves included), so a
            step needs no name lookups.
    """

    names: tuple[str, ...]
    local_slots: tuple[int, ...]

    def named(self, norms: torch.Tensor) -> dict[str, torch.Tensor]:
        """Returns ``{name: norm}`` from a per-parameter norm vector in this index's order."""
        if norms.dim() != 1 or norms.numel() != len(self.names):
            raise ValueError(f"expected a vector of {len(self.names)} norms, got shape {tuple(norms.shape)}")
        return dict(zip(self.names, norms.unbind()))

    def slots(self, flat_positions: list[int], n_flat: int) -> list[int]:
        """Returns the slot of each tensor leaf of a step's tree, given its flat positions.

        Raises:
            ValueError: The tree does not have the structure the index was
                built from (a different number of leaves).
        """
        if n_flat != len(self.local_slots):
            raise ValueError(
                f"param_norms was built from a tree of {len(self.local_slots)} leaves on this rank, but this "
                f"call's tree has {n_flat}; build it from the same tree (e.g. dict(model.named_parameters())) "
                "that each step passes"
            )
        return [self.local_slots[i] for i in flat_positions]


def param_norm_index(
    params: Any,
    mesh: DeviceMesh | None,
    *,
    pp_dim: str | tuple[str, ...] | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> ParamIndex:
    """Lays out one slot per parameter of the whole model, for per-parameter norms in the one collective.

    Call it once, before training (and outside ``torch.compile``), on every
    rank of ``mesh``, with the tree each step will pass: typically
    ``dict(model.named_parameters())`` of this rank's pipeline stage. It is
    the only place that exchanges names (one ``all_gather_object`` over the
    ranks of ``mesh``); each step then issues exactly the one statistics
    collective it always does.

    Args:
        params: A pytree of tensors (parameters or gradients) keyed by name,
            as the clip will be given it; ``None`` leaves are allowed.
        mesh: The world mesh the clip reduces over, or ``None``.
        pp_dim: The pipeline dim name(s), as for the clip.
        pp_mesh: The pipeline mesh, as for the clip.

    Returns:
        A :class:`ParamIndex`, the same ``names`` on every rank.

    Raises:
        ValueError: Two leaves of this rank's tree have the same dotted name
            (positional names from ``model.parameters()`` would collide across
            stages: pass named parameters).

    Example:
        >>> import torch
        >>> from ppclip_func import param_norm_index
        >>> index = param_norm_index({"w": torch.zeros(2), "b": torch.zeros(1)}, None)
        >>> index.names
        ('w', 'b')
    """
    leaves = flatten_grads(params, "parameter")
    every = leaves.all_names()
    mine = [every[i] for i in leaves.index]
    seen: set[str] = set()
    for name in mine:
        if name in seen:
            raise ValueError(f"parameter name {name!r} appears twice in this rank's tree; pass named parameters")
        seen.add(name)
    leaf_meshes = [t.device_mesh for t in leaves.tensors if isinstance(t, DTensor)]
    world = resolve_world(mesh, pipeline_stages(mesh, pp_dim, pp_mesh), leaf_meshes)
    gathered: list[Any]  # every rank's names, as all_gather_object fills it
    if world.group_name is None:
        gathered = [mine]
    else:
        group = torch_compat.resolve_group(world.group_name)
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
    slot: dict[str, int] = {}
    for names in gathered:
        for name in names:
            slot.setdefault(name, len(slot))
    # Leaves that are None here still get a position, so that a later step whose grad is set finds it.
    local = tuple(slot.get(name, -1) for name in every)
    return ParamIndex(tuple(slot), local)


def leaf_slots(index: ParamIndex, flat_positions: list[int], n_flat: int, paths: Any) -> list[int]:
    """The slot of each of a step's tensor leaves; ``paths()`` names them for errors."""
    slots = index.slots(flat_positions, n_flat)
    if -1 in slots:
        bad = paths()[slots.index(-1)]
        raise ValueError(
            f"gradient leaf {bad} had no tensor when param_norms was built; build the index from the "
            "parameters (never None), not from one step's grads"
        )
    return slots
