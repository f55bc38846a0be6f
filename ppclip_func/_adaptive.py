"""A threshold that follows the run, and step skipping: small device-side state, no host reads.

The state is a :class:`ClipState` of three 0-dim tensors, passed in and
returned, as optax passes optimizer state: nothing is read on the host,
every decision is a ``torch.where``, and a compiled step sees the same
graph from one step to the next.

The statistics follow ZClip (Kumar et al., "ZClip: Adaptive Spike
Mitigation for LLM Pre-Training", arXiv:2504.02507, 2025; its defaults
``alpha=0.97``, ``z_thresh=2.5``, 25 warm-up steps and ``max_grad_norm=1.0``
are ours): a warm-up whose norms give a plain mean and variance, then
exponentially weighted ones, updated with the norm *after* clipping, so one
spike does not raise the threshold that clips the next. The weighted
variance is the standard incremental form (T. Finch, "Incremental
calculation of weighted mean and variance", 2009): with
``d = x - mean``, ``mean += (1 - alpha) * d`` and
``var = alpha * (var + (1 - alpha) * d**2)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

__all__: list[str] = []


class ClipState(NamedTuple):
    """Running statistics of the global gradient norm, as 0-dim tensors on the grads' device.

    Attributes:
        count: Norms taken into the statistics so far (int64). Non-finite
            norms and skipped steps are left out.
        mean: Their mean (a plain mean during warm-up, then exponentially
            weighted).
        var: Their variance, likewise.
    """

    count: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor


class ClipStats(NamedTuple):
    """What a clip step measured and decided; every field is a tensor on the device.

    Attributes:
        total_norm: The global norm before clipping, as :func:`global_grad_norm`.
        threshold: The ``max_norm`` this step clipped to.
        zscore: ``(total_norm - mean) / std`` against the statistics before
            this step (``nan`` while there are fewer than two norms).
        skip: 0-dim bool: the caller should not apply this step (the norm
            is non-finite, or its z-score passed ``skip_z`` after warm-up).
            See :func:`skip_update_` and :func:`select_update`.
        state: The statistics after this step, for the next one.
        group_norms: ``{label: norm}`` with ``groups``, else ``None``.
        param_norms: With ``param_norms=index``, a 1-D tensor of every
            parameter's norm, in ``index.names`` order (``index.named(...)``
            keys them by name); else ``None``.
    """

    total_norm: torch.Tensor
    threshold: torch.Tensor
    zscore: torch.Tensor
    skip: torch.Tensor
    state: ClipState
    group_norms: dict[str, torch.Tensor] | None
    param_norms: torch.Tensor | None


def init_clip_state(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> ClipState:
    """Returns the statistics of no norm yet: the state for the first step.

    Args:
        device: Where the grads live (the state must be on the same device).
        dtype: Of ``mean`` and ``var``; float32 is plenty for them (the norm itself is float64).

    Example:
        >>> from ppclip_func import init_clip_state
        >>> init_clip_state()
        ClipState(count=tensor(0), mean=tensor(0.), var=tensor(0.))
    """
    zero = torch.zeros((), dtype=dtype, device=device)
    return ClipState(torch.zeros((), dtype=torch.int64, device=device), zero, zero.clone())


def check_adaptive_args(state: Any, z: float | None, alpha: float, warmup: int, skip_z: float | None) -> None:
    """Raises ``TypeError``/``ValueError`` for a malformed state or option (static checks only)."""
    if not isinstance(state, ClipState) or not all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in state):
        raise TypeError(f"state must be a ClipState of 0-dim tensors (see init_clip_state()), got {state!r}")
    for name, value in (("z", z), ("skip_z", skip_z)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be a number in (0, 1), got {alpha!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 2:
        raise ValueError(f"warmup must be an int >= 2 (a variance needs two norms), got {warmup!r}")


def threshold_and_skip(
    total: torch.Tensor,
    state: ClipState,
    *,
    max_norm: float | torch.Tensor,
    z: float | None,
    skip_z: float | None,
    warmup: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(threshold, zscore, skip)`` for this step's total norm, from the statistics before it."""
    count, mean, var = state
    total = total.to(mean.dtype)
    std = var.clamp_min(0.0).sqrt()
    warming = count < warmup
    fixed = torch.as_tensor(max_norm, dtype=mean.dtype, device=mean.device)
    threshold = fixed if z is None else torch.where(warming, fixed, mean + z * std)
    # Fewer than two norms have no spread: no z-score then.
    zscore = torch.where(count >= 2, (total - mean) / std, math.nan)
    skip = ~torch.isfinite(total)
    if skip_z is not None:
        skip = skip | (~warming & (zscore > skip_z))
    return threshold, zscore, skip


def update_state(
    state: ClipState, total: torch.Tensor, threshold: torch.Tensor, skip: torch.Tensor, *, alpha: float, warmup: int
) -> ClipState:
    """Returns the statistics with this step's norm after clipping taken in (unless skipped or non-finite)."""
    count, mean, var = state
    warming = count < warmup
    total = total.to(mean.dtype)
    # Warm-up takes the raw norms in, so the statistics start from the run, not from max_norm.
    x = torch.where(warming, total, torch.minimum(total, threshold))
    take = ~skip & torch.isfinite(x)
    x = torch.where(take, x, mean)  # keeps the arithmetic below finite on steps not taken
    d = x - mean
    # Warm-up: the plain mean and (population) variance of the norms so far.
    n = (count + 1).to(mean.dtype)
    plain_mean = mean + d / n
    plain_var = var + (d * (x - plain_mean) - var) / n
    # After it: exponentially weighted.
    ema_mean = mean + (1.0 - alpha) * d
    ema_var = alpha * (var + (1.0 - alpha) * d * d)
    new_mean = torch.where(warming, plain_mean, ema_mean)
    new_var = torch.where(warming, plain_var, ema_var)
    return ClipState(
        count + take.to(count.dtype),
        torch.where(take, new_mean, mean),
        torch.where(take, new_var, var),
    )


def select_update(skip: torch.Tensor, new: Any, old: Any) -> Any:
    """Returns ``old`` where ``skip`` is true and ``new`` where not, leaf by leaf; pure.

    For functional training loops that compute new parameters and optimizer
    state out of place: ``params, opt_state = select_update(stats.skip,
    (new_params, new_state), (params, opt_state))``. Branch-free (a
    ``torch.where`` per tensor leaf), so it traces into the compiled step;
    where ``skip`` is true the result is ``old`` bit for bit, even if
    ``new`` holds NaN. Non-tensor leaves are taken from ``new``.

    Example:
        >>> import torch
        >>> from ppclip_func import select_update
        >>> select_update(torch.tensor(True), {"w": torch.ones(2)}, {"w": torch.zeros(2)})
        {'w': tensor([0., 0.])}
    """
    new_flat, spec = pytree.tree_flatten(new)
    old_flat = pytree.tree_leaves(old)
    if len(old_flat) != len(new_flat):
        raise ValueError(f"new and old must have the same structure ({len(new_flat)} and {len(old_flat)} leaves)")
    out = [torch.where(skip, o, n) if isinstance(n, torch.Tensor) else n for n, o in zip(new_flat, old_flat)]
    return pytree.tree_unflatten(out, spec)


@torch.no_grad()
def skip_update_(skip: torch.Tensor, tensors: Iterable[torch.Tensor] | Any, update: Callable[[], Any]) -> Any:
    """Runs ``update()``, an in-place optimizer update of ``tensors``, and undoes it where ``skip`` is true.

    ``tensors`` must be everything ``update`` changes: the parameters *and*
    the optimizer state (AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``).
    They are copied first, and after the update each is set to
    ``torch.where(skip, copy, updated)``: bitwise the old values where
    ``skip``, with no branch and no host read, so the whole step traces into
    one ``torch.compile(fullgraph=True)`` graph. The cost is one copy of
    those tensors; inductor fuses the select with the update.

    Compare ``nonfinite="zero"``: zero gradients still move AdamW's moments
    (they decay), its step count and, through weight decay, the parameters.
    A skipped step moves nothing.

    Args:
        skip: 0-dim bool tensor, e.g. :attr:`ClipStats.skip`.
        tensors: A pytree of the tensors ``update`` modifies in place
            (DTensors are handled through their local shards).
        update: Called once with no arguments, under ``torch.no_grad()``
            (as optimizers update parameters); its result is returned.

    Example:
        >>> import torch
        >>> from ppclip_func import skip_update_
        >>> w = torch.ones(2)
        >>> skip_update_(torch.tensor(True), [w], lambda: w.mul_(3.0)) is w
        True
        >>> w
        tensor([1., 1.])
    """
    flat = [t.to_local() if isinstance(t, DTensor) else t for t in pytree.tree_leaves(tensors)]
    flat = [t for t in flat if isinstance(t, torch.Tensor)]
    saved = [t.clone() for t in flat]
    result = update()
    if torch.compiler.is_compiling():
        # One _foreach_copy_, not a copy_ per tensor: with torch 2.13, a tensor.copy_ after
        # _foreach_add_ on the same 0-dim tensor (AdamW's step count) is dropped from the graph
        # (measured: the count stayed incremented under aot_eager); _foreach_copy_ is kept.
        # Inductor fuses the select into the copy.
        if flat:
            torch._foreach_copy_(flat, [torch.where(skip.to(t.device), old, t) for t, old in zip(flat, saved)])
    else:
        # Eager: the select written in place, no new tensor per leaf (each would page-fault in).
        for t, old in zip(flat, saved):
            torch.where(skip.to(t.device), old, t, out=t)
    return result
