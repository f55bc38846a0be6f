"""A fake process group in this process: many ranks' worth of meshes, no communication."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Runs the block as ``rank`` of a ``world_size`` fake process group, then tears it down.

    Collectives complete instantly without moving data (each rank's result is
    its own input), which is enough for layout logic, validation and tracing.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_world() -> Iterator[DeviceMesh]:
    """Runs the block in a real one-rank gloo group with a 1-D mesh ``("dp",)`` over it, then tears it down:
    the collective moves data, as a one-rank NCCL group's does on one GPU."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()
