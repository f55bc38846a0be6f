"""The baseline of study 3: torchtitan's own ``clip_grad_norm_``, called as its trainer calls it.

torchtitan 0.3.0's trainer (``torchtitan/trainer.py``) clips with::

    dist_utils.clip_grad_norm_(
        [p for m in self.model_parts for p in m.parameters()],
        self.config.training.max_norm,
        foreach=True,
        pp_mesh=parallel_dims.get_optional_mesh("pp"),
        ep_enabled=parallel_dims.ep_enabled,
    )

and :func:`clip` makes the same call. The package is installed with
``pip install --no-deps torchtitan==0.3.0`` (its declared dependencies
include datasets, tensorboard and wandb, which the clip does not use);
importing ``torchtitan.distributed.utils`` then needs only ``spmd_types`` and
``tyro``, both pure Python (the ``bench`` extra; ``make bench`` installs all
three).

Without torchtitan (CI installs only the ``test`` extra) the baseline falls
back to the same algorithm written here from public torch APIs
(:func:`bench._dist.torchtitan_clip`, and the expert-parallel split below),
and :data:`SOURCE` says so.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from bench._dist import torchtitan_clip, torchtitan_norm

__all__ = ["INSTALLED", "SOURCE", "clip"]

VERSION = "0.3.0"

try:
    from torchtitan.distributed.utils import clip_grad_norm_ as _titan_clip_grad_norm_
except ImportError as e:
    _titan_clip_grad_norm_: Callable[..., torch.Tensor] | None = None
    _why = f"{type(e).__name__}: {e}"
    INSTALLED = False
    SOURCE = (
        f"written here (torchtitan is not importable: {_why}); "
        f"pip install --no-deps torchtitan=={VERSION} spmd_types tyro for the real one"
    )
else:
    INSTALLED = True
    SOURCE = f"torchtitan {importlib.metadata.version('torchtitan')}: torchtitan.distributed.utils.clip_grad_norm_"


def clip(
    params: list[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh, *, ep_enabled: bool, norm_type: float = 2.0
) -> torch.Tensor:
    """Clips ``p.grad`` in place as torchtitan's trainer does; returns the total norm."""
    if _titan_clip_grad_norm_ is not None:
        return _titan_clip_grad_norm_(params, max_norm, norm_type, foreach=True, pp_mesh=pp_mesh, ep_enabled=ep_enabled)
    if not ep_enabled:
        return torchtitan_clip(params, max_norm, norm_type, pp_mesh.get_group())
    return _clip_with_ep(params, max_norm, norm_type, pp_mesh.get_group())


@torch.no_grad()
def _clip_with_ep(
    params: list[torch.Tensor], max_norm: float, norm_type: float, pp_group: dist.ProcessGroup
) -> torch.Tensor:
    """torchtitan's expert-parallel path, written here: a norm per mesh family, combined, then over the pipeline.

    Leaves whose mesh has an ``ep`` dim and the others live on different
    meshes, so ``get_total_norm`` cannot stack their norms together: each
    family is reduced on its own (``full_tensor()``), the two are combined on
    this rank, and the pipeline is reduced last. As in torchtitan 0.3.0,
    ``-inf`` is combined like ``inf`` (a max), and ``norm_type=0`` fails on
    the ``1 / norm_type`` root.
    """
    experts, dense = [], []
    for p in params:
        if p.grad is not None:
            (experts if "ep" in (p.device_mesh.mesh_dim_names or ()) else dense).append(p)
    norms = [torchtitan_norm(family, norm_type) for family in (experts, dense)]
    if math.isinf(norm_type):
        total = torch.maximum(*norms)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
    else:
        total = norms[0] ** norm_type + norms[1] ** norm_type
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total **= 1.0 / norm_type
    for family in (experts, dense):
        torch.nn.utils.clip_grads_with_norm_(family, max_norm, total, True)
    return total
