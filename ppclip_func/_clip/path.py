"""The one path every public form runs: setup, local statistics, the one collective, decision, apply.

A public form differs from another only in what it decides from the
measured norms (a fixed threshold, ZClip, AdaGC, a threshold per group, a
hand-over to the optimizer) and in where it writes (in place on ``p.grad``,
or new tensors for a pure form). Everything else is :func:`run`: the
gradients read out of the parameters (a generator consumed once), the
form's own checks run so that a rank they fail on leaves no peer waiting
(``_core.failure``), and :func:`~ppclip_func._core.measure.measure`, which weighs every
leaf by its layout and issues the one collective. :func:`output` puts a
pure form's new local shards back into the input's tree, DTensors with
their layout; :func:`apply_clip` scales by one coefficient, as torch's clip.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from .._core.failure import checked
from .._core.measure import Measured, measure
from .._core.scale import clip_coefficient, finite_mask, scale
from .._core.setup import Checked, NormOptions
from .._core.tree import Leaves
from .adaptive import ClipState, ClipStats, Rule, adapt

__all__: list[str] = []


def run(
    form: str,
    given: Any,
    mesh: Any,
    norm_type: Any,
    opts: NormOptions,
    validate: Callable[[], Checked],
    *,
    in_place: bool,
    state: tuple[torch.Tensor, ...] | None = None,
    sums: Callable[[], torch.Tensor] | None = None,
) -> tuple[Checked, Measured]:
    """Runs ``form``'s checks and measures its gradients with the one collective.

    Args:
        form: The public function's name, for its messages.
        given: Parameters whose ``.grad`` is read (``in_place``), or a
            pytree of gradients.
        mesh, norm_type: As the public form's.
        opts: The form's layout options and its static options for the
            ranks-agree check.
        validate: The form's own argument checks; returns what they found.
        in_place: Whether ``given`` holds parameters.
        state: An adaptive state, which rides in the collective.
        sums: Makes the step's other statistics, summed in the collective
            (:func:`~ppclip_func._core.measure.measure`).

    Returns:
        What ``validate`` found, and the measured norms.
    """
    if in_place:
        given, read = grads_of(given, form)
        what = "parameter grad"
    else:
        read, what = (lambda: given), "gradient"
    found = checked(validate, mesh, given, norm_type, opts, state)
    return found, measure(read, given, what, mesh, found.kind, opts, state, sums)


def output(measured: Measured, new_locals: list[torch.Tensor]) -> Any:
    """A pure form's result: ``new_locals`` in the structure of its input, DTensors with their layout."""
    return measured.leaves.unflatten(rewrapped(measured.leaves, new_locals))


def apply_clip(
    locals_: list[torch.Tensor],
    max_norm: float | torch.Tensor,
    total: torch.Tensor,
    eps: float,
    nonfinite: str,
    norm_type: float | None,
    *,
    inplace: bool,
) -> list[torch.Tensor]:
    """Scales every shard by ``min(max_norm / (total + eps), 1)``, with ``nonfinite``'s policy."""
    keep = finite_mask(total, norm_type, nonfinite)
    return scale(locals_, functools.partial(clip_coefficient, max_norm, total, eps), inplace=inplace, keep=keep)


def adaptive_stats(measured: Measured, state: ClipState, rule: Rule, with_groups: bool) -> ClipStats:
    """ZClip's decision on the measured norm, as a :class:`~ppclip_func.ClipStats`; branch-free."""
    total = measured.total
    threshold, zscore, skip, new_state = adapt(total, state, rule)
    if measured.agree is not None:
        # Ranks whose states differ stop at the check (_core.agreement); where that stop is asynchronous
        # (CUDA), nothing is scaled or stepped by a decision the ranks do not share.
        threshold = torch.where(measured.agree, threshold, math.inf)
        skip = torch.where(measured.agree, skip, True)
    groups = measured.per_group if with_groups else None
    return ClipStats(total, threshold.to(total.dtype), zscore, skip, new_state, groups, measured.per_param)


_PARAMETER_TYPES = frozenset({torch.nn.Parameter, torch.Tensor})


def grads_of(parameters: Any, caller: str) -> tuple[Any, Callable[[], Any]]:
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


def rewrapped(leaves: Leaves, new_locals: list[torch.Tensor]) -> list[torch.Tensor]:
    """``new_locals`` as ``leaves``' tensors: a DTensor leaf's new local shard wrapped with its layout."""
    out = []
    for leaf, local in zip(leaves.tensors, new_locals):
        if isinstance(leaf, DTensor):
            local = DTensor.from_local(
                local, leaf.device_mesh, leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride()
            )
        out.append(local)
    return out
