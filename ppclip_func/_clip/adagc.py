"""AdaGC: every parameter clipped against the running average of its own clipped norm; one collective.

The rule is AdaGC's (Wang et al., "AdaGC: Enhancing LLM Pretraining Stability
via Adaptive Gradient Clipping", ICML 2026, arXiv:2502.11034) as the
authors' PyTorch code computes it (github.com/lishuai-97/AdaGC,
``megatron-gpt2.patch``, class ``AdaGC`` in ``megatron/optimizer/clip_grads.py``,
its ``unshard_tensor_wise`` mode: a tensor-parallel parameter's norm is the
whole tensor's), with its defaults. With ``g_i`` parameter ``i``'s gradient
norm over all its shards and stages (the clip's one collective carries every
one of them, see :func:`param_norm_index`) and ``gamma_i`` its state:

* **Warm-up**, the first ``warmup`` steps: the plain global clip at
  ``max_norm`` (AdaGC's ``lambda_abs``), coefficient
  ``h = min(max_norm / (total + eps), 1)``; each ``gamma_i`` follows the
  running minimum of the clipped norms, ``gamma_i = min(gamma_i, h * g_i)``.
* **Then**, per parameter: with ``relative`` (``lambda_rel``), a norm above
  ``relative * gamma_i`` is clipped to it (coefficient
  ``relative * gamma_i / (g_i + eps)``), and
  ``gamma_i = beta * gamma_i + (1 - beta) * min(g_i, relative * gamma_i)``.

A ``gamma_i`` that has seen no norm yet is ``inf``; the first norm it sees
starts it (the authors' code starts a missing state at the norm, in either
phase). The coefficient of each parameter is gathered for each of this rank's
leaves by its slot and applied with ``_foreach_mul_``, per (device, dtype),
with one 0-dim coefficient per leaf; nothing is read on the host and a
compiled step is one graph with the one collective.

Where this differs from the authors' code, on purpose: a step whose total
norm is non-finite is skipped (``stats.skip``) and leaves the state as it was,
step count included; theirs takes a NaN norm into ``gamma`` (NaN from then
on). A parameter with no gradient on any rank this step keeps its ``gamma``,
as theirs does.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Any, NamedTuple, TypeVar, cast

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._base.devices import constant, scalar
from .._core.agreement import label_set, rule_fields
from .._core.annotations import GroupSpec, TiedSpec
from .._core.excluded import check_exclude, included_params, without_excluded
from .._core.measure import Measured
from .._core.norms import norm_kind
from .._core.param_norms import ParamIndex, leaf_slots
from .._core.scale import _by_device_and_dtype, factor_for, finite_mask, multiply_group, own_buffer
from .._core.setup import Checked, NormOptions, PpDim, check_clip_args
from .path import output, run

__all__ = ["AdaGCState", "AdaGCStats", "adagc_clip_grad_norm", "adagc_clip_grad_norm_", "init_adagc_state"]

PyTree = TypeVar("PyTree")


class AdaGCState(NamedTuple):
    """AdaGC's state: a step count and one running norm per parameter, on the grads' device.

    Identical on every rank (every rank computes it from the same all-reduced
    norms), so a checkpoint needs one copy: see :class:`AdaGCStateful`, which
    keys ``gamma`` by parameter name.

    Attributes:
        count: Steps taken so far (int64, 0-dim); steps with a non-finite
            total norm are left out.
        gamma: 1-D, one entry per parameter of the whole model in
            ``index.names`` order: the running minimum (warm-up) or average
            (after) of its clipped norm; ``inf`` until it sees a norm.
    """

    count: torch.Tensor  # type: ignore[assignment]  # the public field's name shadows tuple.count
    gamma: torch.Tensor


class AdaGCStats(NamedTuple):
    """What an AdaGC step measured and decided; every field is a tensor on the device.

    Attributes:
        total_norm: The global norm before clipping, as :func:`global_grad_norm`.
        param_norms: Every parameter's norm before clipping, 1-D in
            ``index.names`` order (NaN for a parameter with no gradient).
        coefficients: What each parameter's gradient was multiplied by, 1-D
            in ``index.names`` order.
        skip: 0-dim bool: the total norm is non-finite; the state did not move.
        state: The state after this step, for the next one.
        group_norms: ``{label: norm}`` with ``groups``, else ``None``.
    """

    total_norm: torch.Tensor
    param_norms: torch.Tensor
    coefficients: torch.Tensor
    skip: torch.Tensor
    state: AdaGCState
    group_norms: dict[str, torch.Tensor] | None


class AdaGCRule(NamedTuple):
    """AdaGC's options: static Python values (``max_norm`` may be a 0-dim tensor)."""

    max_norm: float | torch.Tensor | None
    relative: float
    beta: float
    warmup: int
    eps: float


def init_adagc_state(
    index: ParamIndex, device: torch.device | str | None = None, dtype: torch.dtype = torch.float64
) -> AdaGCState:
    """Returns AdaGC's state before any step: no step taken, every ``gamma`` unset (``inf``).

    Args:
        index: The :class:`ParamIndex` every step passes (:func:`param_norm_index`).
        device: Where the grads live.
        dtype: Of ``gamma`` (float64 by default; float32 for a device without it).

    Example:
        >>> import torch
        >>> from ppclip_func import init_adagc_state, param_norm_index
        >>> init_adagc_state(param_norm_index({"w": torch.zeros(2), "b": torch.zeros(1)}, None))
        AdaGCState(count=tensor(0), gamma=tensor([inf, inf], dtype=torch.float64))
    """
    if not isinstance(index, ParamIndex):
        raise TypeError(f"index must be a ParamIndex from param_norm_index(), got {type(index).__name__}")
    gamma = torch.full((len(index.names),), math.inf, dtype=dtype, device=device)
    return AdaGCState(torch.zeros((), dtype=torch.int64, device=device), gamma)


def check_adagc_args(state: Any, index: Any, rule: AdaGCRule) -> None:
    """Raises ``TypeError``/``ValueError`` for a malformed state, index or option (static checks only)."""
    if not isinstance(index, ParamIndex):
        raise TypeError(f"index must be a ParamIndex from param_norm_index(), got {type(index).__name__}")
    ok = isinstance(state, AdaGCState) and all(isinstance(t, torch.Tensor) for t in state)
    if not ok or state.count.dim() != 0 or state.gamma.dim() != 1:
        raise TypeError(f"state must be an AdaGCState (see init_adagc_state()), got {state!r}")
    if state.gamma.numel() != len(index.names):
        raise ValueError(
            f"state has {state.gamma.numel()} parameters but the index {len(index.names)}; "
            "build the state with init_adagc_state(index) from the index every step passes"
        )
    for name in ("relative", "beta"):
        value = getattr(rule, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
    if not rule.relative > 0:
        raise ValueError(f"relative must be > 0, got {rule.relative!r}")
    if not 0.0 <= rule.beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {rule.beta!r}")
    if isinstance(rule.warmup, bool) or not isinstance(rule.warmup, int) or rule.warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {rule.warmup!r}")


def adagc_update(
    total: torch.Tensor, norms: torch.Tensor, state: AdaGCState, rule: AdaGCRule
) -> tuple[torch.Tensor, torch.Tensor, AdaGCState]:
    """Returns ``(per-parameter coefficients, skip, new state)``; branch-free, in ``gamma``'s dtype.

    The ``if`` below is on a static option only.
    """
    count, gamma = state
    x = norms.to(gamma.dtype)
    t = total.to(gamma.dtype)
    warming = count < rule.warmup
    skip = ~torch.isfinite(t)
    # Warm-up: the global clip, and the running minimum of the clipped norms.
    if rule.max_norm is None:
        global_coef = torch.ones_like(t)
    else:
        cap = scalar(rule.max_norm, t.dtype, t.device)
        global_coef = torch.clamp(cap / (t + rule.eps), max=1.0)
    warm_gamma = torch.minimum(gamma, x * global_coef)
    # After it: each parameter against its own history; an unset one starts at its norm.
    prev = torch.where(torch.isinf(gamma), x, gamma)
    limit = rule.relative * prev
    over = x > limit
    own_coef = torch.where(over, limit / (x + rule.eps), 1.0)
    ema_gamma = rule.beta * prev + (1.0 - rule.beta) * torch.where(over, limit, x)

    coef = torch.where(warming, global_coef, own_coef)
    # A parameter with no gradient anywhere (a NaN norm) keeps its gamma; a skipped step moves nothing.
    take = ~skip & torch.isfinite(x)
    new_gamma = torch.where(take, torch.where(warming, warm_gamma, ema_gamma), gamma)
    return coef, skip, AdaGCState(count + (~skip).to(count.dtype), new_gamma)


def scale_per_leaf(
    shards: list[torch.Tensor], coef: torch.Tensor, keep: torch.Tensor | None, *, inplace: bool
) -> list[torch.Tensor]:
    """Multiplies each shard by its own 0-dim coefficient (``coef[i]``), one foreach call per (device, dtype).

    ``keep`` (``nonfinite="zero"``): where ``False`` every result is zero.
    """
    out: list[torch.Tensor] = list(shards)
    for (device, dtype), (group, idx) in _by_device_and_dtype(shards).items():
        c = coef.to(device, torch.float64 if dtype == torch.float64 else torch.float32)
        if len(idx) != len(shards):
            c = c[constant(idx, torch.int64, device)]
        # Traced, the whole rule (norms, gamma, divisions) would otherwise be inlined into every element's
        # multiply (see _core.scale.own_buffer).
        c = factor_for(own_buffer(c), device, dtype)
        multiply_group(shards, out, group, idx, list(c.unbind()), keep, inplace=inplace)
    return out


def _validate(
    rule: AdaGCRule, state: Any, index: Any, nonfinite: str, groups: Any, exclude: Any, norm_type: Any
) -> Checked:
    """AdaGC's argument checks: the norm kind, the group labels and the excluded ones."""
    check_clip_args(math.inf if rule.max_norm is None else rule.max_norm, rule.eps, nonfinite)
    check_adagc_args(state, index, rule)
    labels, excluded = check_exclude(groups, exclude)
    return Checked(norm_kind(norm_type), labels, excluded)


def _step(
    measured: Measured,
    index: ParamIndex,
    state: AdaGCState,
    rule: AdaGCRule,
    nonfinite: str,
    p: float,
    exclusion: tuple[list[str], frozenset[str], GroupSpec | None],
    *,
    inplace: bool,
) -> tuple[list[torch.Tensor], AdaGCStats]:
    labels, excluded, groups = exclusion
    measured, counted = without_excluded(measured, norm_kind(p), groups, labels, excluded)
    leaves = measured.leaves
    per_param = cast(torch.Tensor, measured.per_param)  # measured with params=index: never None
    coef, skip, new_state = adagc_update(measured.total, per_param, state, rule)
    # States that differ: no gradient scaled, the step skipped (_clip.path.adaptive_stats).
    if measured.agree is not None:
        coef = torch.where(measured.agree, coef, 1.0)
        skip = torch.where(measured.agree, skip, True)
    params_in = included_params(index.names, groups, labels, excluded)
    if params_in is not None:  # excluded parameters: coefficient 1, gamma left as it was (static mask)
        mask = constant(params_in, torch.bool, coef.device)
        coef = torch.where(mask, coef, 1.0)
        new_state = AdaGCState(new_state.count, torch.where(mask, new_state.gamma, state.gamma))
    slots = leaf_slots(index, leaves.index, len(leaves.flat), leaves.paths)
    if len(counted) != len(slots):
        slots = [slots[i] for i in counted]
    keep = finite_mask(measured.total, p, nonfinite)
    per_leaf = coef[constant(slots, torch.int64, coef.device)] if slots else coef[:0]
    if len(counted) == len(leaves.shards):
        out = scale_per_leaf(leaves.shards, per_leaf, keep, inplace=inplace)
    else:
        out = list(leaves.shards)
        for i, t in zip(counted, scale_per_leaf([out[i] for i in counted], per_leaf, keep, inplace=inplace)):
            out[i] = t
    stats = AdaGCStats(measured.total, per_param, coef, skip, new_state, measured.per_group or None)
    return out, stats


@torch.no_grad()
def adagc_clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor] | Any,
    mesh: DeviceMesh | None,
    state: AdaGCState,
    index: ParamIndex,
    norm_type: float = 2.0,
    *,
    max_norm: float | torch.Tensor | None = 1.0,
    relative: float = 1.04,
    beta: float = 0.99,
    warmup: int = 100,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: GroupSpec | None = None,
    exclude: Collection[str] = (),
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> AdaGCStats:
    """Clips each parameter's ``p.grad`` in place against its own history (AdaGC), with one collective.

    For ``warmup`` steps the plain global clip at ``max_norm``; then each
    parameter's gradient is clipped to ``relative`` times the running average
    of its own clipped norm (see the module's rule, from Wang et al.,
    arXiv:2502.11034, as the authors' code computes it). Every parameter's
    norm, over all its shards and pipeline stages, comes from the clip's one
    all-reduce; the coefficients are applied in one ``_foreach_mul_`` per
    (device, dtype); nothing is read on the host.

    Args:
        parameters: The tree ``index`` was built from, e.g.
            ``dict(model.named_parameters())`` of this rank's stage.
        mesh: The world mesh, or ``None`` (see :func:`global_grad_norm`).
        state: The previous step's ``stats.state``; :func:`init_adagc_state`
            for the first step.
        index: From :func:`param_norm_index`, built once on every rank.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf`` (AdaGC uses 2).
        max_norm: The global threshold during warm-up (AdaGC's
            ``lambda_abs``; the authors' runs use 1.0), or ``None``.
        relative: AdaGC's ``lambda_rel``: how far above its running average
            a parameter's norm may go (> 0).
        beta: Weight of the past in the running averages, in [0, 1).
        warmup: Steps under the global clip (AdaGC's ``T_start``), >= 0.
        exclude: Labels of ``groups`` kept out of the clip: not in the
            total (the warm-up's global clip, ``skip``), never scaled, their
            ``gamma`` left alone (their norms are still reported).
        pp_dim, pp_mesh, eps, groups, tied, partial, nonfinite,
            overflow_safe: As :func:`clip_grad_norm_` (``eps`` is also the
            authors' 1e-6 in each per-parameter coefficient).

    Returns:
        An :class:`AdaGCStats`: the norms before clipping, each parameter's
        coefficient, ``skip``, the new state and the group norms if asked for.

    Raises:
        TypeError, ValueError, RuntimeError: As :func:`clip_grad_norm_`, and
            for a malformed state, index or option.

    Example:
        >>> import torch
        >>> from ppclip_func import adagc_clip_grad_norm_, init_adagc_state, param_norm_index
        >>> params = {"w": torch.nn.Parameter(torch.zeros(2)), "b": torch.nn.Parameter(torch.zeros(1))}
        >>> index = param_norm_index(params, None)
        >>> state = init_adagc_state(index)
        >>> for step in range(5):
        ...     params["w"].grad, params["b"].grad = torch.full((2,), 0.3), torch.full((1,), 0.1)
        ...     state = adagc_clip_grad_norm_(params, None, state, index, warmup=2).state
        >>> params["w"].grad, params["b"].grad = torch.full((2,), 0.3), torch.full((1,), 5.0)  # b spikes
        >>> stats = adagc_clip_grad_norm_(params, None, state, index, warmup=2)
        >>> params["w"].grad, params["b"].grad  # w untouched, b clipped to 1.04 x its average
        (tensor([0.3000, 0.3000]), tensor([0.1040]))
    """
    rule = AdaGCRule(max_norm, relative, beta, warmup, eps)
    layout = (pp_dim, pp_mesh, groups, exclude, tied, partial, overflow_safe)
    _, _, stats = _adagc(
        "adagc_clip_grad_norm_", parameters, mesh, state, index, norm_type, rule, layout, nonfinite, in_place=True
    )
    return stats


@torch.no_grad()
def adagc_clip_grad_norm(
    grads: PyTree,
    mesh: DeviceMesh | None,
    state: AdaGCState,
    index: ParamIndex,
    norm_type: float = 2.0,
    *,
    max_norm: float | torch.Tensor | None = 1.0,
    relative: float = 1.04,
    beta: float = 0.99,
    warmup: int = 100,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: GroupSpec | None = None,
    exclude: Collection[str] = (),
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> tuple[PyTree, AdaGCStats]:
    """The pure form of :func:`adagc_clip_grad_norm_`: returns ``(clipped grads, stats)``.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients or ``None``,
            with the structure ``index`` was built from.
        mesh, state, index, norm_type, max_norm, relative, beta, warmup,
            pp_dim, pp_mesh, eps, groups, exclude, tied, partial, nonfinite,
            overflow_safe: As :func:`adagc_clip_grad_norm_`.

    Returns:
        The clipped gradients, with the structure of ``grads``, and an
        :class:`AdaGCStats`.

    Example:
        >>> import torch
        >>> from ppclip_func import adagc_clip_grad_norm, init_adagc_state, param_norm_index
        >>> grads = {"w": torch.full((4,), 3.0)}
        >>> index = param_norm_index(grads, None)
        >>> clipped, stats = adagc_clip_grad_norm(grads, None, init_adagc_state(index), index)
        >>> clipped["w"], stats.state.gamma  # warm-up: the global clip at 1.0; gamma starts at the clipped norm
        (tensor([0.5000, 0.5000, 0.5000, 0.5000]), tensor([1.0000], dtype=torch.float64))
    """
    rule = AdaGCRule(max_norm, relative, beta, warmup, eps)
    layout = (pp_dim, pp_mesh, groups, exclude, tied, partial, overflow_safe)
    measured, scaled, stats = _adagc(
        "adagc_clip_grad_norm", grads, mesh, state, index, norm_type, rule, layout, nonfinite, in_place=False
    )
    return output(measured, scaled), stats


def _adagc(
    form: str,
    given: Any,
    mesh: DeviceMesh | None,
    state: AdaGCState,
    index: ParamIndex,
    norm_type: float,
    rule: AdaGCRule,
    layout: tuple[Any, ...],
    nonfinite: str,
    *,
    in_place: bool,
) -> tuple[Measured, list[torch.Tensor], AdaGCStats]:
    """Both forms' one path; ``layout`` is ``(pp_dim, pp_mesh, groups, exclude, tied, partial, overflow_safe)``."""
    pp_dim, pp_mesh, groups, exclude, tied, partial, overflow_safe = layout
    agree = (("rule", rule_fields(rule)), ("nonfinite", nonfinite), ("exclude", label_set(exclude)))
    opts = NormOptions(pp_dim, groups, tied, partial, overflow_safe, index, pp_mesh, agree)
    found, measured = run(
        form,
        given,
        mesh,
        norm_type,
        opts,
        lambda: _validate(rule, state, index, nonfinite, groups, exclude, norm_type),
        in_place=in_place,
        state=state,
    )
    exclusion = (list(found.labels), found.excluded, groups)
    scaled, stats = _step(measured, index, state, rule, nonfinite, found.kind.p, exclusion, inplace=in_place)
    return measured, scaled, stats
