"""The float64 reference: the whole model's gradient, gathered from every rank of a real run.

Each rank turns its named gradient leaves into whole float64 tensors
(``full_tensor()`` for a DTensor: all-gathers over its own mesh, and the sum
of a ``Partial`` placement), all ranks exchange them, and the copies of one
parameter held by several ranks (data-parallel replicas, TP replicas, tied
weights on two stages) are kept once, by name. Copies must agree bit for bit:
a layout whose replicas disagree has no single gradient to compare against.

:func:`shared_dir` is a folder every rank writes a checkpoint to.

Everything here issues collectives and must be called by every rank in the
same order (the ranks of one stage hold the same names, in the same order).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

Grads = Mapping[str, Any]


def full_grads(grads: Grads) -> dict[str, torch.Tensor]:
    """This rank's gradients as whole float64 tensors, by name (``None`` leaves are left out)."""
    out = {}
    for name, g in grads.items():
        if g is not None:
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().to(torch.float64).cpu()
    return out


def model_gradient(grads: Grads, same_as: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The whole model's gradient in float64: one tensor per parameter, from every rank's ``grads``.

    Args:
        grads: This rank's ``{parameter name: gradient or None}``; names are
            the whole model's (a stage keeps the names it has in the model).
        same_as: ``{name: canonical name}`` for tied parameters, whose copies
            on different stages are one parameter of the model.

    Raises:
        AssertionError: Two copies of one parameter differ (raised on every rank).
    """
    same_as = same_as or {}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, full_grads(grads))
    model: dict[str, torch.Tensor] = {}
    for rank, named in enumerate(everyone):
        for name, full in named.items():
            key = same_as.get(name, name)
            if key not in model:
                model[key] = full
            elif not torch.equal(model[key], full):
                raise AssertionError(f"rank {rank} holds a copy of {key} ({name}) that differs from another rank's")
    return model


def cast_grads(grads: Grads, dtype: torch.dtype) -> dict[str, Any]:
    """New gradients in ``dtype`` (DTensors keep their mesh, placements, shape and stride)."""
    out = {}
    for name, g in grads.items():
        if isinstance(g, DTensor):
            local = g.to_local().detach().to(dtype, copy=True)
            g = DTensor.from_local(
                local, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
            )
        elif g is not None:
            g = g.detach().to(dtype, copy=True)
        out[name] = g
    return out


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


@contextlib.contextmanager
def shared_dir(prefix: str) -> Iterator[str]:
    """A directory every rank of the default group writes to; rank 0 removes it when all are done."""
    path = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
    finally:
        with contextlib.suppress(Exception):
            dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)
