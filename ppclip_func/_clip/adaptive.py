"""A threshold that follows the run (ZClip), and step skipping: small device-side state, no host reads.

The state is a :class:`ClipState` of three 0-dim tensors, passed in and
returned, as optax passes optimizer state: nothing is read on the host,
every decision is a ``torch.where``, and a compiled step sees the same
graph from one step to the next.

The rule is ZClip's (Kumar et al., "ZClip: Adaptive Spike Mitigation for
LLM Pre-Training", arXiv:2504.02507, 2025) as its reference package
``zclip==1.0.0`` computes it, with the same defaults; tests/test_zclip_reference.py
runs that package's ``ZClip.step`` beside this code for 200 steps per mode.
With ``g`` the step's norm and ``mean``, ``std`` the statistics before it:

* **Warm-up**, the first ``warmup`` norms: clipped at ``max_norm`` only;
  their plain mean and population variance start the statistics.
* **Then** a step is a spike when, in ``"zscore"`` mode (the default), its
  z-score ``(g - mean) / (std + zscore_eps)`` is above ``z``, or, in
  ``"percentile"`` mode, when ``g > mean + z * std``. A spike is clipped to
  ``mean + z * std / (zscore / z)`` times ``clip_factor`` (``"zscore"`` with
  ``clip_option="adaptive_scaling"``), to ``mean`` (``clip_option="mean"``)
  or to ``mean + z * std`` (``"percentile"``). ``max_norm`` caps every step.
* **The statistics** take in ``v``, the spike's clip target or else the norm
  itself (the cap does not enter them): ``mean' = alpha * mean + (1 - alpha) * v``
  and ``var' = alpha * var + (1 - alpha) * (v - mean')**2``, the new mean in
  the variance's term (so ``d = v - mean`` enters as ``alpha**2 * (1 - alpha) * d**2``).
  With ``freeze_on_spike`` (ZClip's ``skip_update_on_spike``) a spike leaves them alone.

Where this differs from ZClip, on purpose:

* A non-finite norm is a skipped step: the statistics stay as they were and
  the run adapts on. ZClip takes every norm in: a NaN one (or an infinite
  one during warm-up) leaves its statistics, and so its threshold,
  non-finite from then on; an infinite one after warm-up is taken in at the
  spike's clip target.
* The warm-up statistics are updated norm by norm (B. P. Welford, 1962), not
  from a buffer at the end of warm-up: the same population mean and
  variance, equal up to rounding, and a state of three scalars.

The statistics are float64 by default, as ZClip keeps them (Python floats);
float32 statistics drift from ZClip's over hundreds of steps (how far:
bench/README.md, "Why the local statistics are built as they are").
* ``skip_z`` (skip a step whose z-score passes it) and ``z=None`` (a fixed
  threshold, statistics kept for ``skip_z`` and logging) are ours.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from .._base.devices import scalar
from .._core.scale import own_buffer

__all__: list[str] = []

MODES = ("zscore", "percentile")
CLIP_OPTIONS = ("adaptive_scaling", "mean")


class ClipState(NamedTuple):
    """Running statistics of the global gradient norm, as 0-dim tensors on the grads' device.

    Identical on every rank (every rank computes them from the same
    all-reduced norm), so a checkpoint needs one copy: see :class:`ClipStateful`.

    Attributes:
        count: Norms taken into the statistics so far (int64). Non-finite
            norms and skipped steps are left out.
        mean: Their mean (a plain mean during warm-up, then exponentially
            weighted).
        var: Their variance, likewise.
    """

    count: torch.Tensor  # type: ignore[assignment]  # the public field's name shadows tuple.count
    mean: torch.Tensor
    var: torch.Tensor


class ClipStats(NamedTuple):
    """What a clip step measured and decided; every field is a tensor on the device.

    Attributes:
        total_norm: The global norm before clipping, as :func:`global_grad_norm`.
        threshold: The norm this step clipped to: the gradients' norm after
            clipping is ``min(total_norm, threshold)`` (up to ``eps``).
            During warm-up (and always with ``z=None``) it is ``max_norm``
            (``inf`` for ``None``); after it, a spike's clip target, or else
            the largest norm the rule lets through (``mean + z * (std + zscore_eps)``
            in ``"zscore"`` mode, ``mean + z * std`` in ``"percentile"``
            mode), either one capped at ``max_norm``.
        zscore: ``(total_norm - mean) / (std + zscore_eps)`` against the statistics
            before this step, ZClip's z-score (``nan`` while there are fewer
            than two norms).
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


class Rule(NamedTuple):
    """The options of the adaptive clip: static Python values (``max_norm`` may be a 0-dim tensor)."""

    max_norm: float | torch.Tensor | None
    z: float | None
    alpha: float
    warmup: int
    skip_z: float | None
    mode: str
    clip_option: str
    clip_factor: float
    zscore_eps: float
    freeze_on_spike: bool


def init_clip_state(device: torch.device | str | None = None, dtype: torch.dtype = torch.float64) -> ClipState:
    """Returns the statistics of no norm yet: the state for the first step.

    Args:
        device: Where the grads live (the state must be on the same device).
        dtype: Of ``mean`` and ``var``: float64 (the default) follows ZClip
            within 1e-6 over hundreds of steps; float32 drifts from it by a
            few 1e-6 (a device without float64 needs it). The norm itself is
            float64.

    Example:
        >>> from ppclip_func import init_clip_state
        >>> init_clip_state()
        ClipState(count=tensor(0), mean=tensor(0., dtype=torch.float64), var=tensor(0., dtype=torch.float64))
    """
    zero = torch.zeros((), dtype=dtype, device=device)
    return ClipState(torch.zeros((), dtype=torch.int64, device=device), zero, zero.clone())


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_adaptive_args(state: Any, rule: Rule) -> None:
    """Raises ``TypeError``/``ValueError`` for a malformed state or option (static checks only).

    ``max_norm`` is checked with the plain clip's options.
    """
    if not isinstance(state, ClipState) or not all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in state):
        raise TypeError(f"state must be a ClipState of 0-dim tensors (see init_clip_state()), got {state!r}")
    for name in ("z", "skip_z"):
        value = getattr(rule, name)
        if value is not None and (not _is_number(value) or not value > 0):
            raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")
    if not _is_number(rule.alpha) or not 0.0 < rule.alpha < 1.0:
        raise ValueError(f"alpha must be a number in (0, 1), got {rule.alpha!r}")
    if isinstance(rule.warmup, bool) or not isinstance(rule.warmup, int) or rule.warmup < 2:
        raise ValueError(f"warmup must be an int >= 2 (a variance needs two norms), got {rule.warmup!r}")
    if rule.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {rule.mode!r}")
    if rule.clip_option not in CLIP_OPTIONS:
        raise ValueError(f"clip_option must be one of {CLIP_OPTIONS}, got {rule.clip_option!r}")
    if not _is_number(rule.clip_factor) or not rule.clip_factor > 0:
        raise ValueError(f"clip_factor must be a number > 0, got {rule.clip_factor!r}")
    if not _is_number(rule.zscore_eps) or not rule.zscore_eps >= 0:
        raise ValueError(f"zscore_eps must be a number >= 0, got {rule.zscore_eps!r}")
    if not isinstance(rule.freeze_on_spike, bool):
        raise TypeError(f"freeze_on_spike must be a bool, got {rule.freeze_on_spike!r}")


def adapt(
    total: torch.Tensor, state: ClipState, rule: Rule
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ClipState]:
    """Returns ``(threshold, zscore, skip, new state)`` for this step's total norm; branch-free.

    ``threshold``, ``zscore`` and the state are in the state's dtype. The
    ``if``s below are on the static options only.
    """
    count, mean, var = state
    x = total.to(mean.dtype)
    inf = torch.full((), math.inf, dtype=mean.dtype, device=mean.device)
    warming = count < rule.warmup
    std = var.clamp_min(0.0).sqrt()
    # Fewer than two norms have no spread: no z-score then.
    zscore = torch.where(count >= 2, (x - mean) / (std + rule.zscore_eps), math.nan)

    # The adaptive rule: which norms are spikes, what a spike is clipped to, and the largest norm let through.
    if rule.z is None:
        spike, target, let_through = torch.zeros_like(warming), x, inf
    elif rule.mode == "percentile":
        let_through = mean + rule.z * std
        spike, target = x > let_through, let_through
    else:
        spike = zscore > rule.z
        let_through = mean + rule.z * (std + rule.zscore_eps)
        if rule.clip_option == "mean":
            target = mean
        else:
            # The further above z, the lower the target: z * std scaled by z / zscore.
            target = (mean + rule.z * std / (zscore / rule.z)) * rule.clip_factor
    spike = spike & ~warming
    cap = inf if rule.max_norm is None else scalar(rule.max_norm, mean.dtype, mean.device)
    threshold = torch.minimum(torch.where(warming, inf, torch.where(spike, target, let_through)), cap)

    skip = ~torch.isfinite(x)
    if rule.skip_z is not None:
        skip = skip | (~warming & (zscore > rule.skip_z))
    return threshold, zscore, skip, _update(state, torch.where(spike, target, x), spike, skip, rule)


def _update(state: ClipState, taken: torch.Tensor, spike: torch.Tensor, skip: torch.Tensor, rule: Rule) -> ClipState:
    """The statistics with ``taken`` (the norm, or a spike's clip target) in, unless skipped or non-finite."""
    count, mean, var = state
    take = ~skip & torch.isfinite(taken)
    if rule.freeze_on_spike:
        take = take & ~spike
    v = torch.where(take, taken, mean)  # keeps the arithmetic below finite on steps not taken
    # Warm-up: the plain mean and population variance of the raw norms so far, one norm at a time.
    n = (count + 1).to(mean.dtype)
    d = v - mean
    plain_mean = mean + d / n
    plain_var = var + (d * (v - plain_mean) - var) / n
    # After it: exponentially weighted, as ZClip defines them (the new mean in the variance's term).
    ema_mean = rule.alpha * mean + (1.0 - rule.alpha) * v
    ema_var = rule.alpha * var + (1.0 - rule.alpha) * (v - ema_mean) ** 2
    warming = count < rule.warmup
    return ClipState(
        count + take.to(count.dtype),
        torch.where(take, torch.where(warming, plain_mean, ema_mean), mean),
        torch.where(take, torch.where(warming, plain_var, ema_var), var),
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
    skip = own_buffer(skip)  # traced: the decision computed once, not in every element's select
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
        # One _foreach_copy_, which inductor fuses with the select and the update: each tensor's new value
        # is computed from its own saved copy and the update, both read before it is stored. Not the
        # write-back op (ppclip_func/_clip/write_back.py): the update has already written these tensors, so inductor would
        # copy them out and back around the op (bench/write_back_study.py). tests/test_write_back.py
        # checks the compiled step, returning nothing, against eager on every release tested. Not a
        # copy_ per tensor: with torch 2.11 to 2.13 a second Tensor.copy_ into an input can be dropped.
        # The decision is a buffer of its own (own_buffer), computed once, not in every element's select.
        if flat:
            skip = own_buffer(skip)
            torch._foreach_copy_(flat, [torch.where(skip.to(t.device), old, t) for t, old in zip(flat, saved)])
    else:
        # Eager: the select written in place, no new tensor per leaf (each would page-fault in).
        for t, old in zip(flat, saved):
            torch.where(skip.to(t.device), old, t, out=t)
    return result
