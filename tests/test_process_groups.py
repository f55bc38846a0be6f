"""Which process group the one collective uses: never a stale one, never one made inside the clip.

On a fake process group in this process (group bookkeeping is real there;
only the data movement is skipped). The real-rank counterpart, where a stage
that never calls the clip must not fall out of step, is in
``tests/test_reliability_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ppclip_func import global_grad_norm
from tests._collectives import CollectiveCounter
from tests._fake_pg import fake_world


def _leaf(mesh) -> DTensor:
    return DTensor.from_local(torch.ones(2), mesh, [Shard(0)] * mesh.ndim, run_check=False)


def _group_names() -> dict:
    return dict(dist.distributed_c10d._world.pg_names)


def test_a_process_group_re_created_in_the_same_process_is_reduced_over_by_its_current_name():
    with fake_world(8):
        dp = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))["dp"]
        global_grad_norm({"w": _leaf(dp)}, None)
    with fake_world(8):
        # A notebook re-run or an in-process restart: the same meshes again, but
        # other groups were made first, so every group name has moved on.
        dist.new_group()
        dist.new_group()
        dp = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))["dp"]
        with CollectiveCounter() as counter:
            global_grad_norm({"w": _leaf(dp)}, None)
        assert counter.groups == [dp.get_group().group_name]


def test_the_clip_never_creates_a_process_group():
    # Creating a group is a collective over every rank; a stage that does not
    # call the clip would fall out of step (or hang, with NCCL).
    with fake_world(16):
        world = init_device_mesh("cpu", (2, 4, 2), mesh_dim_names=("pp", "dp", "tp"))
        stage = world["dp", "tp"]
        before = _group_names()
        with (
            CollectiveCounter() as counter,
            pytest.raises(ValueError, match=r"no process group of its own.*world_mesh\['dp', 'tp'\]._flatten\(\)"),
        ):
            global_grad_norm({"w": _leaf(stage)}, None)
        assert _group_names() == before
        assert counter.count == 0


def test_a_sub_mesh_flattened_up_front_is_reduced_over_by_that_group():
    with fake_world(16):
        world = init_device_mesh("cpu", (2, 4, 2), mesh_dim_names=("pp", "dp", "tp"))
        flat = world["dp", "tp"]._flatten()  # on every rank, before training
        before = _group_names()
        with CollectiveCounter() as counter:
            global_grad_norm({"w": _leaf(world["dp", "tp"])}, None)
        assert counter.groups == [flat.get_group().group_name]
        assert _group_names() == before


def test_host_work_per_call_does_not_grow_with_the_world():
    # The layout of each leaf is worked out once per world; a later call only
    # looks it up. Counted in calls to the per-layout analysis, not in time.
    from ppclip_func._core import layout as _layout

    calls = []
    real = _layout.replica_count

    def counting(*args):
        calls.append(len(args[1]))  # the leaf mesh's ranks it walks
        return real(*args)

    with fake_world(16384), pytest.MonkeyPatch.context() as mp:
        mp.setattr(_layout, "replica_count", counting)
        world = init_device_mesh("cpu", (4, 2048, 2), mesh_dim_names=("pp", "dp", "tp"))
        grads = [_leaf(world["dp", "tp"]) for _ in range(200)]
        global_grad_norm(grads, world)
        assert calls == [4096]  # one layout, analysed once
        global_grad_norm(grads, world)
        assert calls == [4096]
