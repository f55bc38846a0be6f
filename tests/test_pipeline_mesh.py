"""Where the pipeline stages are: ``pp_mesh`` on any world mesh, and no silent guess without it.

The meshes are built the way torchtitan 0.3.0's ``ParallelDims.build_mesh``
builds them, with torch's own API: a 1-D ``("world",)`` root mesh, unflattened
into ``("pp", "dp_replicate", "dp_shard", "tp")``; parameters live on the
stage's mesh (``dp_replicate, dp_shard, tp``), and the user holds the root.
Every rank of the world is simulated in turn on a fake process group (no
processes, no data moved): what each rank weighs its leaves by is checked
against the layout, rank by rank. The same meshes with real ranks and
torchtitan's own model code: ``tests/test_torchtitan.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ppclip_func import clip_grad_norm, global_grad_norm
from ppclip_func._core.layout import count_copies, pipeline_stages, resolve_world
from tests._fake_pg import fake_world

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def _titan_meshes(shape: tuple[int, ...]) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """Returns (the 1-D root mesh, the pipeline mesh, this rank's stage mesh), as torchtitan builds them."""
    root = init_device_mesh("cpu", (math.prod(shape),), mesh_dim_names=("world",))
    full = root._unflatten(0, shape, DIMS)
    return root, full["pp"], full["dp_replicate", "dp_shard", "tp"]


def _expected_stage(rank: int, shape: tuple[int, ...]) -> int:
    """The pipeline coordinate of ``rank`` in a row-major mesh of ``shape`` whose first dim is pp."""
    return rank // math.prod(shape[1:])


@pytest.mark.parametrize("shape", [(2, 1, 2, 2), (2, 2, 2, 1), (4, 2, 1, 1), (2, 1, 4, 1)])
def test_pp_mesh_gives_every_rank_its_stage_on_the_1d_root_mesh(shape):
    world_size = math.prod(shape)
    for rank in range(world_size):
        with fake_world(world_size, rank):
            root, pp_mesh, _ = _titan_meshes(shape)
            for mesh in (root, None):
                world = resolve_world(mesh, pipeline_stages(mesh, None, pp_mesh), [])
                assert world.mesh is root
                assert world.stage_size == world_size // shape[0]
                assert world.rank_stage == {r: (_expected_stage(r, shape),) for r in range(world_size)}


@pytest.mark.parametrize("shape", [(2, 1, 2, 2), (2, 2, 2, 1)])
def test_a_stage_leaf_counts_each_element_once_over_the_whole_world(shape):
    """Summed over every rank of both stages, the weights of each stage's leaf elements are exactly 1."""
    world_size = math.prod(shape)
    placements = [Replicate(), Shard(0), Shard(1)]  # HSDP replicate, FSDP shard, TP shard
    total_weight = {0: 0.0, 1: 0.0}  # per stage: sum over ranks of local elements / copies
    for rank in range(world_size):
        with fake_world(world_size, rank):
            root, pp_mesh, stage_mesh = _titan_meshes(shape)
            leaf = distribute_tensor(torch.ones(8, 8), stage_mesh, placements)
            world = resolve_world(root, pipeline_stages(root, None, pp_mesh), [stage_mesh])
            stage = _expected_stage(rank, shape)
            total_weight[stage] += leaf.to_local().numel() / count_copies(world, leaf)
    assert total_weight == {0: 64.0, 1: 64.0}


def test_the_1d_root_mesh_without_pp_mesh_raises_naming_pp_mesh():
    """torchtitan's world mesh says nothing of stages: the other stage must not be counted as a replica."""
    with fake_world(8, 5):
        root, pp_mesh, stage_mesh = _titan_meshes((2, 1, 2, 2))
        # The local shard built here: on the fake process group distribute_tensor's scatter leaves it unwritten
        # (whatever the memory held; a norm of inf once in CI).
        shard = torch.ones(2, 4)
        grads = {"w": DTensor.from_local(shard, stage_mesh, [Replicate(), Shard(0), Replicate()], run_check=False)}
        for call in (lambda: global_grad_norm(grads, root), lambda: clip_grad_norm(grads, root, 1.0)):
            with pytest.raises(ValueError, match=r"\['w'\].*pp_mesh=.*get_optional_mesh\('pp'\)"):
                call()
        # Told where the stages are, the same call goes through (pp_mesh, or the stage's pp dim by name).
        assert torch.isfinite(global_grad_norm(grads, root, pp_mesh=pp_mesh))


def test_a_leaf_on_whole_dims_of_the_world_is_a_replica_without_pipeline_information():
    """A named world mesh without "pp": a leaf on some of its dims is replicated over the others, as before."""
    with fake_world(8, 3):
        world_mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        leaf = distribute_tensor(torch.ones(4, 4), world_mesh["dp_shard", "tp"], [Shard(0), Replicate()])
        world = resolve_world(world_mesh, pipeline_stages(world_mesh, None, None), [leaf.device_mesh])
        assert count_copies(world, leaf) == 2 * 2  # dp_replicate (outside the leaf) x tp (Replicate)
        flat = world_mesh["dp_shard", "tp"]._flatten("dp_shard_tp")  # a flattened mesh is whole dims too
        flat_leaf = distribute_tensor(torch.ones(4, 4), flat, [Shard(0)])
        assert count_copies(resolve_world(world_mesh, (), [flat]), flat_leaf) == 2


def test_pp_mesh_and_pp_dim_together_raise():
    with fake_world(8, 0):
        root, pp_mesh, _ = _titan_meshes((2, 1, 2, 2))
        with pytest.raises(ValueError, match="pp_dim or pp_mesh, not both"):
            global_grad_norm([torch.ones(2)], root, pp_dim="world", pp_mesh=pp_mesh)
        with pytest.raises(TypeError, match="pp_mesh must be a DeviceMesh"):
            global_grad_norm([torch.ones(2)], root, pp_mesh="pp")


def test_plain_tensors_with_pp_mesh_are_replicated_within_their_stage_only():
    """Pipeline parallelism alone (no DTensor): each stage's ranks are replicas of each other, not of the other stage."""
    with fake_world(8, 6):
        root, pp_mesh, _ = _titan_meshes((2, 4, 1, 1))
        world = resolve_world(None, pipeline_stages(None, None, pp_mesh), [])
        assert world.mesh is root
        assert count_copies(world, torch.ones(3)) == 4


def test_plain_tensors_without_pipeline_information_are_taken_for_data_parallel_replicas():
    """The documented silent case (docs/failure-modes.md): a plain tensor says nothing of its stage.

    On the root mesh with no ``pp_mesh`` every rank is a replica of every
    other (DDP's layout, which looks the same), so each holds 1/8 of its
    tensor's square: over 2 stages of 4 ranks, the squares are averaged over
    the stages instead of added. With ``pp_mesh`` each counts 1/4.
    """
    with fake_world(8, 6):
        root, pp_mesh, _ = _titan_meshes((2, 4, 1, 1))
        assert count_copies(resolve_world(root, pipeline_stages(root, None, None), []), torch.ones(3)) == 8
        assert count_copies(resolve_world(root, pipeline_stages(root, None, pp_mesh), []), torch.ones(3)) == 4


def test_stage_table_at_thousands_of_ranks():
    """The stages of 4096 ranks, from the layout alone; a second resolve is served from the cache."""
    shape = (4, 8, 64, 2)
    with fake_world(4096, 4095):
        root, pp_mesh, stage_mesh = _titan_meshes(shape)
        stages = pipeline_stages(root, None, pp_mesh)
        world = resolve_world(root, stages, [stage_mesh])
        assert world.stage_size == 1024
        assert all(world.rank_stage[r] == (_expected_stage(r, shape),) for r in range(0, 4096, 97))
        assert resolve_world(root, stages, [stage_mesh]) is world
