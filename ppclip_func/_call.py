"""A clip call's way in and out, shared by every entry point around the core.

The public functions (``_api``) and the edge modules that build on the same
pipeline (``_optim``, ``_adagc``, ``_group_clip``) all check the same
arguments, read gradients out of parameters the same way (a generator
consumed once, with torch's warning when it is already empty), put scaled
local shards back into DTensors with their layout, and turn the measured norm
into :class:`~ppclip_func.ClipStats`. That plumbing lives here, below the
public surface, so that no module imports private names from ``_api``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ._adaptive import ClipState, ClipStats, Rule, adapt
from ._measure import Measured
from ._scale import NONFINITE_POLICIES
from ._tree import Leaves


def _adapt(measured: Measured, state: ClipState, rule: Rule, with_groups: bool) -> ClipStats:
    total = measured.total
    threshold, zscore, skip, new_state = adapt(total, state, rule)
    if measured.agree is not None:
        # Ranks whose states differ stop at the check (_agree); where that stop is asynchronous
        # (CUDA), nothing is scaled or stepped by a decision the ranks do not share.
        threshold = torch.where(measured.agree, threshold, math.inf)
        skip = torch.where(measured.agree, skip, True)
    groups = measured.per_group if with_groups else None
    return ClipStats(total, threshold.to(total.dtype), zscore, skip, new_state, groups, measured.per_param)


_PARAMETER_TYPES = frozenset({torch.nn.Parameter, torch.Tensor})


def _grad_reader(parameters: Any, caller: str) -> tuple[Any, Callable[[], Any]]:
    """Returns the parameters as a tensor pytree (a generator consumed once) and a function reading their grads."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    elif isinstance(parameters, Iterator):
        parameters = list(parameters)  # consumed once, here
        if not parameters:
            warnings.warn(
                f"{caller}: `parameters` is an empty iterator (a generator that was already consumed?); "
                "no gradient of this rank will be clipped",
                stacklevel=4,
            )
    elif not isinstance(parameters, (list, tuple, dict)) and isinstance(parameters, Iterable):
        parameters = list(parameters)

    def read_grads() -> Any:
        # The common cases, a list or a dict of parameters, without tree_map's per-leaf overhead.
        if isinstance(parameters, list):
            if set(map(type, parameters)) <= _PARAMETER_TYPES:
                return [p.grad for p in parameters]
            return [_grad_of(p) for p in parameters]
        if type(parameters) is dict and set(map(type, parameters.values())) <= _PARAMETER_TYPES:
            return {name: p.grad for name, p in parameters.items()}
        return pytree.tree_map(_grad_of, parameters)

    return parameters, read_grads


def _grad_of(p: Any) -> torch.Tensor | None:
    if p is None:
        return None
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
    return p.grad


def _rewrap(leaves: Leaves, new_locals: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for leaf, local in zip(leaves.tensors, new_locals):
        if isinstance(leaf, DTensor):
            local = DTensor.from_local(
                local, leaf.device_mesh, leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride()
            )
        out.append(local)
    return out


def _check_clip_args(max_norm: float | torch.Tensor, eps: float, nonfinite: str) -> None:
    if isinstance(max_norm, torch.Tensor):
        if max_norm.dim() != 0:
            raise ValueError(f"max_norm must be a number or a 0-dim tensor, got shape {tuple(max_norm.shape)}")
    elif isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm must be a number or a 0-dim tensor, got {type(max_norm).__name__}")
    elif not max_norm >= 0:  # NaN too; math.isnan fails on the symbolic float torch.compile may pass
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    # `not x >= 0` is false for NaN too: math.isnan fails on the symbolic float torch.compile passes with dynamic=True.
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
