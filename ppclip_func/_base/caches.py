"""Every cache the package keeps across calls, in one registry, with one reset.

A clip's host work does not grow with the number of ranks or repeat per
step because the facts it derives from static inputs are kept: the world a
mesh resolves to, each layout's copy count, the configurations every rank
has agreed on, group membership by name, device constants. Each such cache
is registered here when its module is imported, as one of two kinds:

* **per process group** (:func:`per_group`): facts about ranks and groups.
  A group destroyed and re-created in the same process (a notebook, an
  in-process restart, elastic re-configuration, a test re-joining a fake
  world as another rank) gives equal-looking meshes whose group names and
  ranks may now mean something else, so these are dropped whenever the
  default process group is not the one they were filled under
  (:func:`follow_process_group`, called where they are read);
* **per process** (:func:`per_process`): facts about values alone (group
  membership of a tuple of names, row widths, checksum weights, device
  constants), right under any group.

:func:`reset` drops both, for a test or a process that wants to start
afresh. A CUDA graph captured before it may still read a device constant
that the package no longer holds: capture it again after a reset.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

__all__: list[str] = []

C = TypeVar("C")

_PER_GROUP: list[dict[Any, Any]] = []
_PER_PROCESS: list[Any] = []
_OWNER: list[object] = [None]  # the default process group the per-group caches were filled under


def per_group(cache: dict[Any, Any]) -> dict[Any, Any]:
    """Registers ``cache`` as a fact about the current process group; returns it."""
    _PER_GROUP.append(cache)
    return cache


def per_process(cache: C) -> C:
    """Registers ``cache`` (a dict, or a ``functools`` cache with ``cache_clear``) as valid under any group."""
    _PER_PROCESS.append(cache)
    return cache


def follow_process_group() -> None:
    """Drops the per-group caches if the default process group is not the one they were filled under."""
    group = dist.group.WORLD if dist.is_initialized() else None
    if group is not _OWNER[0]:
        for cache in _PER_GROUP:
            cache.clear()
        _OWNER[0] = group


def reset() -> None:
    """Drops every cache of the package."""
    for cache in _PER_GROUP:
        cache.clear()
    for cache in _PER_PROCESS:
        (cache.cache_clear if hasattr(cache, "cache_clear") else cache.clear)()
    _OWNER[0] = None
