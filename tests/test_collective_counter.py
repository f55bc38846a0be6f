"""The collective counter the distributed tests rely on sees every collective, those DTensor issues included."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests._collectives import CollectiveCounter
from tests._fake_pg import fake_world


def test_counts_the_collectives_a_dtensor_op_issues() -> None:
    """``get_total_norm(...).full_tensor()`` on sharded DTensors all-reduces once; counted for p=2 and inf alike."""
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        grads = [distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)]) for _ in range(2)]
        for norm_type in (2.0, float("inf")):
            with CollectiveCounter() as counter:
                torch.nn.utils.get_total_norm(grads, norm_type, foreach=True).full_tensor()
            assert counter.ops == ["_c10d_functional.all_reduce"], (norm_type, counter.ops)
