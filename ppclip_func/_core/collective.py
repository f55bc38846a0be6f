"""The one collective: all local statistics of a clip cross ranks in a single all-reduce.

Every rank of the world mesh calls :func:`all_reduce_statistics` exactly once
per clip, with a float64 vector of the same length on every rank (its length
depends only on the number of groups and the norm type, never on what this
rank holds), so a rank whose pipeline stage has no gradient still joins and
no rank waits on a collective another rank skipped.

It is ``torch.distributed._functional_collectives.all_reduce`` over the
process group that spans the world mesh:

* in eager mode it launches the collective and returns an
  ``AsyncCollectiveTensor``, which ``_core.measure`` waits for at once: nothing in
  the clip can run before the result is needed, and every op on the wrapper
  would go through its Python ``__torch_dispatch__``;
* under ``torch.compile`` it traces to one ``_c10d_functional.all_reduce`` and
  one ``_c10d_functional.wait_tensor`` node, with no graph break, and the
  group appears in the graph only by name (the world group's name is the same
  on every rank, so every rank traces the same graph).

The reduced vector is identical, bit for bit, on every rank: all-reduce
delivers one result to all participants, and everything computed from it
afterwards is the same arithmetic on the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils import _pytree as pytree

from .layout import World, device_of, pipeline_stages, resolve_world
from .norms import NormKind

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__: list[str] = []


def all_reduce_statistics(stats: torch.Tensor, kind: NormKind, world: World) -> torch.Tensor:
    """Combines every rank's statistics with ``kind.op`` over ``world``; the result is on ``stats``' device.

    With no group (nothing distributed) the statistics are returned as they
    are and no collective is issued. The collective runs on the device the
    world mesh's backend needs (:func:`collective_device`), which can differ
    from the gradients' (FSDP2 CPU offload keeps grads on the host while the
    mesh, and NCCL, are on the GPU).
    """
    if world.group_name is None:
        return stats
    device = collective_device(world.mesh, stats.device)
    reduced = funcol.all_reduce(stats.to(device), kind.op, cast("GroupName", world.group_name))
    return reduced.to(stats.device)


def collective_device(mesh: DeviceMesh | None, device: torch.device) -> torch.device:
    """Returns where a collective over ``mesh`` must run for data that lives on ``device``.

    On ``device`` itself when its type is the mesh's device type (or there is
    no mesh); else on the mesh's device type (its current device, as
    DeviceMesh and DTensor use it).
    """
    if mesh is None or mesh.device_type == device.type:
        return device
    return mesh_device(mesh)


def mesh_device(mesh: DeviceMesh | None) -> torch.device:
    """Returns the device this rank uses for ``mesh``: CPU for no mesh or a CPU mesh."""
    return device_of("cpu" if mesh is None else mesh.device_type)


def world_of(mesh: Any, leaf_meshes: list[DeviceMesh], pp_dim: Any, pp_mesh: Any) -> World | None:
    """The world a clip reduces over, from its arguments (and, with ``mesh=None``, its DTensor leaves'
    meshes); ``None`` if there is none (then the clip raises why, on every rank of that world alike).

    Pipeline arguments that do not resolve on this rank (a ``pp_dim`` its
    mesh lacks) still give the world's group, with no stages: the ranks-agree
    check then names the option, instead of this rank skipping the check.
    """
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        return None
    try:
        stages = pipeline_stages(mesh, pp_dim, pp_mesh)
    except Exception:
        stages = ()
    try:
        return resolve_world(mesh, stages, leaf_meshes)
    except Exception:
        return None


def leaf_meshes(mesh: Any, given: Any) -> list[DeviceMesh]:
    """The DTensor leaves' meshes of ``given``, which name the world where ``mesh`` is ``None``."""
    if mesh is not None:
        return []
    return [x.device_mesh for x in pytree.tree_leaves(given) if isinstance(x, DTensor)]


def reduce_partial(leaf: DTensor) -> DTensor:
    """Returns ``leaf`` with each ``Partial`` mesh dim reduced to ``Replicate``.

    This is the one documented exception to the single collective: a
    ``Partial`` DTensor's local values are addends, not elements, so its norm
    needs the reduced values. It costs one all-reduce of the leaf per
    ``Partial`` dim (DTensor's own ``redistribute``), issued before the
    statistics collective, and only when the caller asks for it with
    ``partial="reduce"``.

    Raises:
        ValueError: A ``Partial`` reduce op other than ``sum`` or ``avg``
            (a ``max``/``min`` partial has no norm-preserving reduction here);
            the message reads on after the leaf's name.
    """
    placements = tuple(leaf.placements)
    for p in placements:
        if p.is_partial() and cast(Partial, p).reduce_op not in ("sum", "avg"):
            raise ValueError(
                f"has placement {p}; only Partial('sum') and Partial('avg') grads can be reduced for a norm"
            )
    return leaf.redistribute(leaf.device_mesh, [Replicate() if p.is_partial() else p for p in placements])
