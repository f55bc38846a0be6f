"""The package's caches: one registry, dropped when the process group changes, and one reset.

Spec: every cache the clip keeps across calls is registered in
``ppclip_func._base.caches``; a clip over a mesh fills the per-group ones and a
clip with ``groups`` the per-process ones; a new default process group drops
the per-group caches at the next clip; ``reset()`` empties them all, and the
next clip is as right as the first.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from ppclip_func import clip_grad_norm_
from ppclip_func._base import caches as _caches
from ppclip_func._core import layout as _layout
from tests._fake_pg import fake_world


def _clip_over_a_mesh(world: int) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    params = {f"layers.{i}.w": torch.zeros(8, requires_grad=True) for i in range(3)}
    for p in params.values():
        p.grad = torch.full((8,), 2.0)
    return clip_grad_norm_(params, mesh, 1.0, groups={"first": "layers.0"})[0]


def _sizes() -> tuple[list[int], list[int]]:
    per_process = [c.cache_info().currsize if hasattr(c, "cache_info") else len(c) for c in _caches._PER_PROCESS]
    return [len(c) for c in _caches._PER_GROUP], per_process


def test_every_cache_is_registered_and_reset_empties_them() -> None:
    with fake_world(4):
        first = _clip_over_a_mesh(4)
        per_group, per_process = _sizes()
        assert any(per_group) and any(per_process), (per_group, per_process)
        _caches.reset()
        assert _sizes() == ([0] * len(per_group), [0] * len(per_process))
        torch.testing.assert_close(_clip_over_a_mesh(4), first, rtol=0, atol=0)


def test_a_new_process_group_drops_the_per_group_caches() -> None:
    with fake_world(4):
        _clip_over_a_mesh(4)
        assert _layout._WORLDS and _layout._WORLDS in _caches._PER_GROUP
    with fake_world(8):
        _caches.follow_process_group()
        assert not any(len(c) for c in _caches._PER_GROUP)
        _clip_over_a_mesh(8)  # filled again, under the new group, with its own world
        assert any(len(c) for c in _caches._PER_GROUP)
        meshes = [world.mesh for world in _layout._WORLDS.values()]
        assert meshes and all(mesh.size() == 8 for mesh in meshes), meshes
