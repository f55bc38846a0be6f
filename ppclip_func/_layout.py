"""Layout analysis: how many ranks of the world mesh hold each gradient element.

Every rank contributes ``weight * sum(|x|^p)`` for each local shard ``x`` it
holds, and the one all-reduce sums those contributions over the ranks of the
world mesh. For the sum to count each element of the logical model gradient
exactly once, a leaf's weight is ``1 / copies``, where ``copies`` is the number
of ranks holding any given element of that leaf:

* a ``Shard`` (or ``_StridedShard``) mesh dim of the leaf splits elements over
  its coordinates: each element lives on one of them (factor 1);
* a ``Replicate`` mesh dim of the leaf copies every element (factor = dim size);
* a dim of the world mesh outside the leaf's own mesh is a pipeline dim
  (different parameters at each coordinate, factor 1) when named in
  ``pp_dim``, otherwise a replica dim (factor = dim size). A plain tensor leaf
  has no mesh of its own, so it is replicated over every non-pipeline dim.

All of this is static Python on mesh shapes and placements: no collective, no
tensor value read. Max and min norms do not need weights (a replica repeats
the same value and ``max``/``min`` are idempotent).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class World:
    """The ranks a clip reduces over, as seen from this rank.

    Attributes:
        mesh: The world mesh, or ``None`` when nothing is distributed.
        stage_size: Ranks per pipeline stage (world size over the pipeline dims).
        rank_stage: Global rank to its pipeline-stage coordinates, for every
            rank of ``mesh``.
        group_name: Name of the process group spanning ``mesh``, or ``None``
            when no collective is needed.
    """

    mesh: DeviceMesh | None
    stage_size: int
    rank_stage: dict[int, tuple[int, ...]]
    group_name: str | None


# Layout facts cached across calls. They belong to one process group: a group
# destroyed and re-created in the same process (a notebook, an in-process
# restart, elastic re-configuration, a test re-joining a fake world as another
# rank) gives equal-looking meshes whose group names and ranks may now mean
# something else, so the caches are dropped whenever the default group changes.
_CACHE_OWNER: list[object] = [None]  # the default process group the caches below were filled under
_WORLDS: dict[tuple, World] = {}
# Keyed by mesh value: sub-meshes of different stages compare equal (same root
# rank map and layout) but hold different ranks; a process is one rank of one
# group, so it only ever sees its own.
_MESH_RANKS: dict[DeviceMesh, list[int]] = {}
# ``copies`` per (world, leaf mesh, placements): it depends on the layout, not
# on the step, and working it out walks the leaf mesh's ranks (at 16K ranks and
# 1000 leaves that was 0.4 s a call). Worlds are held by ``_WORLDS``, so their
# ids stay theirs until the caches are dropped together.
_COPIES: dict[tuple[int, DeviceMesh, tuple[Placement, ...]], int] = {}


def _own_caches() -> None:
    """Drops every cached layout fact if the default process group is not the one they were computed under."""
    group = dist.group.WORLD if dist.is_initialized() else None
    if group is not _CACHE_OWNER[0]:
        _WORLDS.clear()
        _MESH_RANKS.clear()
        _COPIES.clear()
        _CACHE_OWNER[0] = group


def pipeline_dims(mesh: DeviceMesh | None, pp_dim: str | Sequence[str] | None) -> tuple[int, ...]:
    """Returns the indices of the pipeline dims of ``mesh``.

    Raises:
        ValueError: ``pp_dim`` names a dim the mesh does not have.
    """
    if mesh is None:
        if pp_dim is not None:
            raise ValueError(f"pp_dim={pp_dim!r} was given but mesh is None; pass the world mesh")
        return ()
    names = mesh.mesh_dim_names or ()
    if pp_dim is None:
        return (names.index("pp"),) if "pp" in names else ()
    wanted = (pp_dim,) if isinstance(pp_dim, str) else tuple(pp_dim)
    missing = [n for n in wanted if n not in names]
    if missing:
        raise ValueError(f"pp_dim names {missing} that the mesh does not have; its dims are {names}")
    return tuple(sorted(names.index(n) for n in wanted))


def resolve_world(mesh: DeviceMesh | None, pp_dims: tuple[int, ...], leaf_meshes: Sequence[DeviceMesh]) -> World:
    """Returns the world a clip reduces over.

    With ``mesh=None`` the world is the largest mesh among the DTensor leaves
    (every other leaf mesh must lie inside it), so DTensors are reduced over
    their own ranks as ``full_tensor()`` would; with no DTensor leaves there is
    nothing to reduce.

    Host work does not grow with the number of ranks after the first call for
    a given world: the world and the per-layout copy counts are cached.

    Raises:
        ValueError: This rank is not in ``mesh``, (with ``mesh=None``) the
            leaf meshes do not nest in one of them, or a multi-dim world
            smaller than the process group has no process group of its own
            (see :func:`_group_name`).
    """
    if torch.compiler.is_compiling():
        # Traced once; the caches are Python dicts keyed by meshes, which dynamo would guard on.
        if mesh is None:
            if not leaf_meshes:
                return World(mesh=None, stage_size=1, rank_stage={}, group_name=None)
            mesh = _largest_nesting(leaf_meshes)
        return _make_world(mesh, pp_dims)
    _own_caches()
    if mesh is None:
        if not leaf_meshes:
            return _NO_WORLD
        unique = tuple(dict.fromkeys(leaf_meshes))  # typically 1-3 meshes for 1000s of leaves
        key: tuple = (None, unique, pp_dims)
        if key not in _WORLDS:
            _WORLDS[key] = _make_world(_largest_nesting(unique), pp_dims)
        return _WORLDS[key]
    key = (mesh, pp_dims)
    if key not in _WORLDS:
        _WORLDS[key] = _make_world(mesh, pp_dims)
    return _WORLDS[key]


_NO_WORLD = World(mesh=None, stage_size=1, rank_stage={}, group_name=None)


def _largest_nesting(leaf_meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    mesh = max(leaf_meshes, key=lambda m: m.size())
    ranks = set(_mesh_ranks(mesh))
    for other in leaf_meshes:
        if not ranks.issuperset(_mesh_ranks(other)):
            raise ValueError(
                f"mesh=None but the DTensor leaves live on meshes that do not nest ({mesh} and {other}); "
                "pass the world mesh that spans all of them"
            )
    return mesh


# Under torch.compile, dynamo would trace the rank table (``mesh.mesh.tolist()``)
# as data-dependent reads of a tensor; these read static mesh facts only, so they
# run eagerly at trace time and their results enter the graph as constants.
@torch.compiler.assume_constant_result
def _make_world(mesh: DeviceMesh, pp_dims: tuple[int, ...]) -> World:
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not part of the mesh {mesh}")
    return world_from_table(mesh, mesh.mesh.tolist(), tuple(mesh.shape), pp_dims, _group_name(mesh))


def world_from_table(
    mesh: DeviceMesh | None, table: list, shape: tuple[int, ...], pp_dims: tuple[int, ...], group_name: str | None
) -> World:
    """Builds a :class:`World` from the mesh's nested list of global ranks."""
    rank_stage: dict[int, tuple[int, ...]] = {}
    for coord in _coordinates(shape):
        rank = table
        for c in coord:
            rank = rank[c]
        rank_stage[rank] = tuple(coord[d] for d in pp_dims)
    stage_size = math.prod(shape) // math.prod(shape[d] for d in pp_dims)
    return World(mesh=mesh, stage_size=stage_size, rank_stage=rank_stage, group_name=group_name)


def _coordinates(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    coords: list[tuple[int, ...]] = [()]
    for n in shape:
        coords = [(*c, i) for c in coords for i in range(n)]
    return coords


def _group_name(mesh: DeviceMesh) -> str | None:
    """Returns the name of a process group spanning exactly the ranks of ``mesh``; never creates one.

    Creating a group is itself a collective over the whole default group (with
    NCCL, and with torch's group numbering everywhere), so a group created at
    clip time would hang or mis-number ranks that never reach the clip (a
    frozen stage, a stage without DTensor grads). A 1-D mesh has its group, a
    mesh spanning the default group uses it, and a smaller multi-dim mesh must
    have been flattened beforehand, at a point every rank reaches.

    Raises:
        ValueError: ``mesh`` is multi-dim, smaller than the default group, and
            not flattened yet.
    """
    if mesh.size() == 1:
        return None
    if mesh.ndim == 1:
        return mesh.get_group().group_name
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD.group_name
    ranks = sorted(_mesh_ranks(mesh))
    for flat in mesh._get_root_mesh()._flatten_mapping.values():
        if sorted(_mesh_ranks(flat)) == ranks:
            return flat.get_group().group_name
    names = mesh.mesh_dim_names
    raise ValueError(
        f"the clip reduces over the mesh {names} of {mesh.size()} of the {dist.get_world_size()} ranks, which has "
        "no process group of its own, and creating one inside the clip could hang the ranks that do not call it. "
        f"Pass the world mesh that spans every rank (mesh=world_mesh), or create the group once, on every rank, "
        f"before training: world_mesh[{', '.join(map(repr, names or ()))}]._flatten()"
    )


@torch.compiler.assume_constant_result
def _mesh_ranks(mesh: DeviceMesh) -> list[int]:
    # Cached: reading ``mesh.mesh`` builds a tensor, per leaf and per step otherwise.
    # Under torch.compile this runs at trace time, outside resolve_world's check.
    _own_caches()
    if mesh not in _MESH_RANKS:
        _MESH_RANKS[mesh] = mesh.mesh.flatten().tolist()
    return _MESH_RANKS[mesh]


def count_copies(world: World, leaf: torch.Tensor) -> int:
    """Returns how many ranks of the world hold each element of ``leaf``.

    Raises:
        ValueError: As :func:`replica_count`.
    """
    if not isinstance(leaf, DTensor):
        return world.stage_size
    mesh, placements = leaf.device_mesh, tuple(leaf.placements)
    if torch.compiler.is_compiling():
        return replica_count(world, _mesh_ranks(mesh), tuple(mesh.shape), placements)
    key = (id(world), mesh, placements)
    n = _COPIES.get(key)
    if n is None:
        n = _COPIES[key] = replica_count(world, _mesh_ranks(mesh), tuple(mesh.shape), placements)
    return n


def replica_count(world: World, ranks: Sequence[int], shape: tuple[int, ...], placements: Sequence[Placement]) -> int:
    """Returns how many ranks hold each element of a DTensor on the mesh ``ranks`` of ``shape``.

    The leaf's own mesh holds ``prod(Replicate dim sizes)`` copies of each
    element. SPMD over the world means the pipeline stages its ranks belong
    to are tiled by copies of that mesh, each holding the same parameter, so
    the count is multiplied by ``holders / len(ranks)``.

    Raises:
        ValueError: The leaf's mesh has ranks outside the world mesh, the
            layout does not tile the world, or a placement is ``Partial``.
            The message reads on after the leaf's name ("gradient leaf
            ['w'] ..."), which the caller puts in front.
    """
    for p in placements:
        if p.is_partial():
            raise ValueError(
                f"has a Partial placement {p}: its local values are not its elements, so their norm is not "
                "the gradient's; pass partial='reduce' or redistribute it to Shard/Replicate first"
            )
    foreign = [r for r in ranks if r not in world.rank_stage]
    if foreign:
        raise ValueError(f"lives on a mesh whose ranks {foreign} are not in the world mesh {world.mesh}")
    replicas = math.prod([n for n, p in zip(shape, placements) if p.is_replicate()])  # dynamo: no genexpr
    holders = world.stage_size * len({world.rank_stage[r] for r in ranks})
    if holders % len(ranks):
        raise ValueError(
            f"lives on a mesh of {len(ranks)} ranks, which does not tile the "
            f"{holders} ranks of its pipeline stage(s); the layout is not SPMD over the world mesh"
        )
    return holders // len(ranks) * replicas
