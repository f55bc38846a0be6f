"""The torch internals this package relies on, and where torch releases differ.

Everything the clip takes from torch beyond its public, stable API is
reached through this module, so a user on a release that moved something
finds out here, in one clear error, not from a traceback deep in a
collective. Each piece is found by what the running torch provides
(feature detection), never by parsing its version:

* ``torch.distributed.all_gather_single`` (torch >= 2.13), else
  ``all_gather_into_tensor`` (deprecated in 2.13, where it warns on every
  call): the options check's one small gather.
* ``torch.distributed.distributed_c10d._resolve_process_group``: a process
  group from its name (what funcol and a DeviceMesh store).
* ``DeviceMesh._get_root_mesh`` and the root's ``_flatten_mapping``: the
  world mesh of a pipeline mesh, and the flattened meshes whose process
  groups the clip may reduce over.
* ``DeviceMesh._layout`` and ``_rank_map``: every rank's pipeline stage,
  read from the layout a sliced mesh keeps of its root, with no collective.
* ``torch._C._group_tensors_by_device_and_dtype``: the C++ grouping torch's
  own clip uses (the caller loops in Python where it is missing).

Other torch APIs the package uses (``_functional_collectives``,
``torch.library.custom_op``, DTensor placements with ``_StridedShard``,
``torch.compiler``) are present and alike in every release tested.

Releases: the suite passed on torch :data:`TESTED_OLDEST` to
:data:`TESTED_NEWEST` (docs/versions.md). A newer one is accepted: the
package imports and works, with one :class:`UntestedTorchWarning` per
process; where an internal above is missing or has changed shape, the
first call that needs it raises :class:`UnsupportedTorchError`, naming the
release, the piece and the tested range.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TESTED_NEWEST", "TESTED_OLDEST", "UnsupportedTorchError", "UntestedTorchWarning"]

TESTED_OLDEST = "2.11.0"
TESTED_NEWEST = "2.14.1"


class UnsupportedTorchError(RuntimeError):
    """The running torch lacks an internal the clip needs, or has changed its shape."""


class UntestedTorchWarning(UserWarning):
    """The running torch is newer than the newest release the suite passed on."""


def tested_range() -> str:
    return f"torch {TESTED_OLDEST} to {TESTED_NEWEST}"


def unsupported(piece: str, why: str = "is missing") -> UnsupportedTorchError:
    """The error for an internal ``piece`` that this torch lacks or has reshaped."""
    return UnsupportedTorchError(
        f"ppclip_func needs {piece}, which {why} in torch {torch.__version__}; the package was tested "
        f"with {tested_range()} (docs/versions.md). Install a tested torch, or report this with your "
        "torch version"
    )


def _release(version: str) -> tuple[int, ...]:
    """``"2.15.0.dev20261001+cu130"`` -> ``(2, 15, 0)``: the release, without local or pre-release tags."""
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in match.group(1).split(".")) if match else ()


_WARNED: list[bool] = [False]


def warn_if_untested(version: str | None = None) -> bool:
    """Warns once per process if ``version`` (the running torch's) is newer than the newest tested.

    Newer releases are accepted, never refused: an internal that moved
    raises where it is needed. Returns whether this call warned.
    """
    version = torch.__version__ if version is None else version
    if _WARNED[0] or _release(version)[:3] <= _release(TESTED_NEWEST):
        return False
    _WARNED[0] = True
    warnings.warn(
        f"ppclip_func was tested with {tested_range()}; torch {version} is newer. It should work: any torch "
        "internal it needs that has moved raises a clear error at the first clip that needs it.",
        UntestedTorchWarning,
        stacklevel=2,
    )
    return True


def _need(owner: Any, name: str, piece: str) -> Any:
    found = getattr(owner, name, None)  # (never traced: every caller runs eagerly, or at trace time)
    if found is None:
        raise unsupported(piece)
    return found


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Gathers ``tensor`` from every rank of ``group`` into ``output``, in group rank order (one collective)."""
    gather = getattr(dist, "all_gather_single", None)  # torch >= 2.13; the older name warns there
    if gather is None:
        gather = _need(dist, "all_gather_into_tensor", "torch.distributed.all_gather_single or all_gather_into_tensor")
    gather(output, tensor, group=group)


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group named ``group_name`` (the name a DeviceMesh and funcol carry)."""
    c10d = dist.distributed_c10d
    resolve = _need(c10d, "_resolve_process_group", "torch.distributed.distributed_c10d._resolve_process_group")
    return resolve(group_name)


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced, flattened or unflattened from (itself if it is a root).

    Not traceable by dynamo in torch 2.11: call it where it runs eagerly (at trace time).
    """
    return _need(mesh, "_get_root_mesh", "DeviceMesh._get_root_mesh")()


def flattened_meshes(root: Any) -> Iterable[Any]:
    """The meshes flattened from ``root`` so far (``root[dims]._flatten()``), each with its process group."""
    mapping = getattr(root, "_flatten_mapping", None)
    if not isinstance(mapping, dict):
        raise unsupported("DeviceMesh._flatten_mapping (a dict of the root's flattened meshes)", _found(mapping))
    return mapping.values()


def layout_copies(mesh: Any) -> list[list[int]]:
    """The global ranks of every copy of ``mesh`` that tiles its root, one row per copy, in mesh order.

    A DeviceMesh made by slicing or unflattening keeps its layout over the
    root's ranks (``_layout``, ``_rank_map``); its copies, one per
    combination of the root's other dims, are the rows.
    """
    layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    remap: Callable | None = getattr(layout, "remap_to_tensor", None)
    if remap is None or not isinstance(rank_map, torch.Tensor):
        raise unsupported("DeviceMesh._layout.remap_to_tensor and DeviceMesh._rank_map", _found(layout, rank_map))
    return remap(rank_map).reshape(-1, mesh.size()).tolist()


def _found(*pieces: Any) -> str:
    return "is missing" if all(p is None for p in pieces) else "has another shape"


_GROUP_BY_DEVICE_AND_DTYPE = getattr(torch._C, "_group_tensors_by_device_and_dtype", None)


def group_natively(
    tensors: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] | None:
    """The tensors of each (device, dtype) and their positions, by torch's C++ grouping; ``None`` without it.

    It is what torch's own clip uses: no Python work per leaf.
    """
    if _GROUP_BY_DEVICE_AND_DTYPE is None:
        return None
    grouped = _GROUP_BY_DEVICE_AND_DTYPE([tensors], True)
    return {key: (lists[0], idx) for key, (lists, idx) in grouped.items()}
