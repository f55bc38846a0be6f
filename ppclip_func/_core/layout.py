"""Layout analysis: how many ranks of the world mesh hold each gradient element.

Every rank contributes ``weight * sum(|x|^p)`` for each local shard ``x`` it
holds, and the one all-reduce sums those contributions over the ranks of the
world mesh. For the sum to count each element of the logical model gradient
exactly once, a leaf's weight is ``1 / copies``, where ``copies`` is the number
of ranks holding any given element of that leaf:

* a ``Shard`` (or ``_StridedShard``) mesh dim of the leaf splits elements over
  its coordinates: each element lives on one of them (factor 1);
* a ``Replicate`` mesh dim of the leaf copies every element (factor = dim size);
* ranks of the world outside the leaf's own mesh hold other pipeline stages
  (different parameters, factor 1) or replicas (factor = how many). Where the
  stages are is said by the pipeline dims of the world mesh (``pp_dim``, or a
  dim named ``"pp"``) or by the pipeline mesh itself (``pp_mesh``, as
  torchtitan passes it): DeviceMesh keeps the layout of every mesh unflattened
  from its root, which gives every rank's stage without a collective. Without
  either, the other ranks are replicas only when the leaf's mesh is whole dims
  of the world mesh; any other leaf mesh smaller than the world is ambiguous
  (torchtitan's 1-D root mesh with PP) and raises instead of guessing. A plain
  tensor leaf has no mesh of its own, so it is replicated over its stage.

All of this is static Python on mesh shapes and placements: no collective, no
tensor value read. Max and min norms do not need weights (a replica repeats
the same value and ``max``/``min`` are idempotent).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from .._base import torch_compat
from .._base.caches import follow_process_group, per_group

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
        rank_coord: With no pipeline information, every rank's coordinate in
            ``mesh`` (and ``shape`` its shape), to tell a leaf mesh made of
            whole dims of the world (the other ranks are replicas) from one
            that is not (ambiguous); ``None`` when the stages are known or
            the world is the leaves' own largest mesh (``mesh=None``).
        shape: The world mesh's shape, with ``rank_coord``.
        size: Its number of ranks, with ``rank_coord`` (dynamo guards on a dict's ``len``; this it reads).
    """

    mesh: DeviceMesh | None
    stage_size: int
    rank_stage: dict[int, tuple[int, ...]]
    group_name: str | None
    rank_coord: dict[int, tuple[int, ...]] | None = None
    shape: tuple[int, ...] = ()
    size: int = 0


# Layout facts cached across calls (per process group: _base.caches).
_WORLDS: dict[tuple, World] = per_group({})
# Keyed by mesh value: sub-meshes of different stages compare equal (same root
# rank map and layout) but hold different ranks; a process is one rank of one
# group, so it only ever sees its own.
_MESH_RANKS: dict[DeviceMesh, list[int]] = per_group({})
# ``copies`` per (world, leaf mesh, placements): it depends on the layout, not
# on the step, and working it out walks the leaf mesh's ranks. Worlds are held
# by ``_WORLDS``, so their ids stay theirs until the caches are dropped together.
_COPIES: dict[tuple[int, DeviceMesh, tuple[Placement, ...]], int] = per_group({})


def device_of(device_type: str) -> torch.device:
    """The device of ``device_type`` this rank uses (its current one; the CPU has one)."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, getattr(torch, device_type).current_device())


# Where the pipeline stages are: the indices of the world mesh's pipeline dims, or the pipeline mesh.
Stages = tuple[int, ...] | DeviceMesh


def pipeline_stages(mesh: DeviceMesh | None, pp_dim: str | Sequence[str] | None, pp_mesh: DeviceMesh | None) -> Stages:
    """Returns what says where the pipeline stages are: ``pp_mesh``, or the pipeline dims of ``mesh``.

    Raises:
        TypeError: ``pp_mesh`` is not a DeviceMesh.
        ValueError: Both ``pp_dim`` and ``pp_mesh`` are given, ``pp_dim`` names
            a dim the mesh does not have, or this rank is not in ``pp_mesh``.
    """
    if pp_mesh is None:
        return pipeline_dims(mesh, pp_dim)
    if not isinstance(pp_mesh, DeviceMesh):
        raise TypeError(f"pp_mesh must be a DeviceMesh or None, got {type(pp_mesh).__name__}")
    if pp_dim is not None:
        raise ValueError(f"pass pp_dim or pp_mesh, not both (got pp_dim={pp_dim!r} and pp_mesh={pp_mesh})")
    if pp_mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not part of pp_mesh {pp_mesh}")
    return pp_mesh


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


def resolve_world(mesh: DeviceMesh | None, stages: Stages, leaf_meshes: Sequence[DeviceMesh]) -> World:
    """Returns the world a clip reduces over.

    With ``mesh=None`` the world is the root of the pipeline mesh when there
    is one (every stage); else the largest mesh among the DTensor leaves
    (every other leaf mesh must lie inside it), so DTensors are reduced over
    their own ranks as ``full_tensor()`` would; with no DTensor leaves there is
    nothing to reduce.

    Host work does not grow with the number of ranks after the first call for
    a given world: the world and the per-layout copy counts are cached.

    Raises:
        ValueError: This rank is not in ``mesh``, (with ``mesh=None``) the
            leaf meshes do not nest in one of them, ``pp_mesh`` does not
            place every rank of the world in a stage, or a multi-dim world
            smaller than the process group has no process group of its own
            (see :func:`_group_name`).
    """
    if torch.compiler.is_compiling():
        # Traced once; the caches are Python dicts keyed by meshes, which dynamo would guard on.
        if mesh is None and isinstance(stages, DeviceMesh):
            return _make_world(None, stages, True)  # the root found there, at trace time (see _make_world)
        if mesh is None:
            if not leaf_meshes:
                return World(mesh=None, stage_size=1, rank_stage={}, group_name=None)
            return _make_world(_largest_nesting(leaf_meshes), stages, False)
        return _make_world(mesh, stages, True)
    follow_process_group()
    if mesh is None and isinstance(stages, DeviceMesh):
        mesh = torch_compat.root_mesh(stages)
    if mesh is None:
        if not leaf_meshes:
            return _NO_WORLD
        unique = tuple(dict.fromkeys(leaf_meshes))  # typically 1-3 meshes for 1000s of leaves
        key: tuple = (None, unique, stages)
        if key not in _WORLDS:
            _WORLDS[key] = _make_world(_largest_nesting(unique), stages, False)
        return _WORLDS[key]
    key = (mesh, stages)
    if key not in _WORLDS:
        _WORLDS[key] = _make_world(mesh, stages, True)
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
def _make_world(mesh: DeviceMesh | None, stages: Stages, strict: bool) -> World:
    # mesh=None: the root of the pipeline mesh ``stages``. Found here, eagerly at trace time: dynamo in
    # torch 2.11 cannot trace DeviceMesh._get_root_mesh(), and in 2.13 cannot return a mesh from this kind of call.
    if mesh is None:
        mesh = torch_compat.root_mesh(stages)
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not part of the mesh {mesh}")
    group = _group_name(mesh)
    if isinstance(stages, DeviceMesh):
        return world_from_stage_table(mesh, mesh.mesh.flatten().tolist(), stage_table(stages), group)
    return world_from_table(mesh, mesh.mesh.tolist(), tuple(mesh.shape), stages, group, strict=strict)


def world_from_table(
    mesh: DeviceMesh | None,
    table: list,
    shape: tuple[int, ...],
    pp_dims: tuple[int, ...],
    group_name: str | None,
    *,
    strict: bool = False,
) -> World:
    """Builds a :class:`World` from the mesh's nested list of global ranks.

    With ``strict`` and no pipeline dims, the world keeps every rank's
    coordinate, so that a leaf on part of it is checked (:func:`replica_count`).
    """
    rank_stage: dict[int, tuple[int, ...]] = {}
    rank_coord: dict[int, tuple[int, ...]] = {}
    for coord in _coordinates(shape):
        rank: Any = table  # the nested list, then a rank
        for c in coord:
            rank = rank[c]
        rank_stage[rank] = tuple(coord[d] for d in pp_dims)
        rank_coord[rank] = coord
    stage_size = math.prod(shape) // math.prod(shape[d] for d in pp_dims)
    keep = strict and not pp_dims
    if not keep:
        return World(mesh, stage_size, rank_stage, group_name)
    return World(mesh, stage_size, rank_stage, group_name, rank_coord, shape, math.prod(shape))


def world_from_stage_table(
    mesh: DeviceMesh | None, ranks: Sequence[int], stage_of: dict[int, tuple[int, ...]], group_name: str | None
) -> World:
    """Builds a :class:`World` over ``ranks`` whose pipeline stages are given rank by rank.

    Raises:
        ValueError: A rank of the world is in no stage, or the stages hold
            different numbers of the world's ranks (not SPMD).
    """
    missing = [r for r in ranks if r not in stage_of]
    if missing:
        raise ValueError(f"ranks {missing[:8]} of the world mesh {mesh} are in no stage of pp_mesh")
    rank_stage = {r: stage_of[r] for r in ranks}
    sizes = collections.Counter(rank_stage.values())
    if len(set(sizes.values())) != 1:
        raise ValueError(
            f"the pipeline stages of pp_mesh hold different numbers of the ranks of {mesh} ({dict(sizes)}); "
            "pass the world mesh that spans every stage"
        )
    return World(mesh, len(ranks) // len(sizes), rank_stage, group_name)


def stage_table(pp_mesh: DeviceMesh) -> dict[int, tuple[int, ...]]:
    """Returns every rank's pipeline stage (its coordinate in its copy of ``pp_mesh``), with no collective.

    A DeviceMesh made by unflattening or slicing keeps its layout in the
    root mesh's ranks; the layout's copies tile the root, one per
    combination of the other dims, and a rank's place in its copy is its
    stage.

    Raises:
        UnsupportedTorchError: This torch's DeviceMesh keeps no layout of its root.
        ValueError: The copies of ``pp_mesh`` do not tile the root (a rank in two stages).
    """
    copies = torch_compat.layout_copies(pp_mesh)
    shape = tuple(pp_mesh.shape)
    stage_of: dict[int, tuple[int, ...]] = {}
    for copy in copies:
        for rank, coord in zip(copy, _coordinates(shape)):
            if stage_of.setdefault(rank, coord) != coord:
                raise ValueError(f"rank {rank} is in two stages of pp_mesh {pp_mesh}")
    return stage_of


def _whole_dims(world: World, rank_coord: dict[int, tuple[int, ...]], ranks: Sequence[int]) -> bool:
    """Whether ``ranks`` are every rank along some dims of the world mesh (``rank_coord``: its
    ``rank_coord``), at one coordinate of the others."""
    coords = [rank_coord[r] for r in ranks]
    varying = [d for d in range(len(world.shape)) if len({c[d] for c in coords}) > 1]
    # The ranks agree on every other dim, so they are distinct points of the varying dims' grid:
    # all of it exactly when there are as many of them as it has points.
    return len(set(ranks)) == math.prod([world.shape[d] for d in varying])


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
    # A mesh with a group of its own gets its collective even with one rank (one GPU): the same step, with
    # the same one collective, as on many (a CUDA graph captures it there too). A one-rank part of a
    # larger multi-dim mesh has no group, and nothing to reduce.
    if mesh.ndim == 1:
        return mesh.get_group().group_name
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD.group_name  # type: ignore[union-attr]  # a mesh exists: so does the default group
    if mesh.size() == 1:
        return None
    ranks = sorted(_mesh_ranks(mesh))
    for flat in torch_compat.flattened_meshes(torch_compat.root_mesh(mesh)):
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
    follow_process_group()
    if mesh not in _MESH_RANKS:
        _MESH_RANKS[mesh] = mesh.mesh.flatten().tolist()
    return _MESH_RANKS[mesh]


@torch.compiler.assume_constant_result
def mesh_shape(mesh: DeviceMesh) -> tuple[int, ...]:
    """``tuple(mesh.shape)``; under torch.compile read at trace time (dynamo in torch < 2.13 cannot trace it)."""
    return tuple(mesh.shape)


def count_copies(world: World, leaf: torch.Tensor) -> int:
    """Returns how many ranks of the world hold each element of ``leaf``.

    Raises:
        ValueError: As :func:`replica_count`.
    """
    if not isinstance(leaf, DTensor):
        return world.stage_size
    mesh, placements = leaf.device_mesh, tuple(leaf.placements)
    if torch.compiler.is_compiling():
        return replica_count(world, _mesh_ranks(mesh), mesh_shape(mesh), placements)
    key = (id(world), mesh, placements)
    n = _COPIES.get(key)
    if n is None:
        n = _COPIES[key] = replica_count(world, _mesh_ranks(mesh), mesh_shape(mesh), placements)
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
    if world.rank_coord is not None and len(ranks) < world.size and not _whole_dims(world, world.rank_coord, ranks):
        raise ValueError(
            f"lives on a mesh of {len(ranks)} of the {world.size} ranks of the world mesh {world.mesh}, "
            "and nothing says whether the other ranks hold replicas of it or other pipeline stages. With "
            "pipeline parallelism pass the pipeline mesh, pp_mesh=... (torchtitan: "
            "parallel_dims.get_optional_mesh('pp')), or a world mesh with a 'pp' dim (pp_dim=...); without it, "
            "pass a world mesh whose dims include the leaf's (torchtitan: "
            "parallel_dims.get_activated_mesh(['pp', 'batch', 'cp', 'tp']))"
        )
    replicas = math.prod([n for n, p in zip(shape, placements) if p.is_replicate()])  # dynamo: no genexpr
    holders = world.stage_size * len({world.rank_stage[r] for r in ranks})
    if holders % len(ranks):
        raise ValueError(
            f"lives on a mesh of {len(ranks)} ranks, which does not tile the "
            f"{holders} ranks of its pipeline stage(s); the layout is not SPMD over the world mesh"
        )
    return holders // len(ranks) * replicas
