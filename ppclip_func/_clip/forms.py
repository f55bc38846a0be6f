"""Public API: measure the global norm, apply a clip, or both, over a device mesh."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Any, TypeVar, overload

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._core.agreement import label_set, rule_fields
from .._core.annotations import GroupSpec, TiedSpec
from .._core.excluded import check_exclude, without_excluded
from .._core.measure import Measured
from .._core.norms import norm_kind
from .._core.param_norms import ParamIndex
from .._core.setup import Checked, GroupNorms, NormOptions, PpDim, check_clip_args
from .._core.tree import flatten_grads
from .adaptive import ClipState, ClipStats, Rule, check_adaptive_args
from .path import adaptive_stats, apply_clip, output, rewrapped, run

__all__ = [
    "adaptive_clip_grad_norm",
    "adaptive_clip_grad_norm_",
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grads_with_norm",
    "global_grad_norm",
]

PyTree = TypeVar("PyTree")


@overload
def global_grad_norm(
    grads: Any,
    mesh: DeviceMesh | None,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    groups: None = None,
    tied: TiedSpec | None = None,
    partial: str = "error",
    overflow_safe: bool = False,
) -> torch.Tensor: ...


@overload
def global_grad_norm(
    grads: Any,
    mesh: DeviceMesh | None,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    groups: GroupSpec,
    tied: TiedSpec | None = None,
    partial: str = "error",
    overflow_safe: bool = False,
) -> tuple[torch.Tensor, GroupNorms]: ...


@torch.no_grad()
def global_grad_norm(
    grads: Any,
    mesh: DeviceMesh | None,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    groups: GroupSpec | None = None,
    tied: TiedSpec | None = None,
    partial: str = "error",
    overflow_safe: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, GroupNorms]:
    """Returns the norm of the whole model's gradient, with one collective.

    Every leaf is weighed by its layout (see docs/layouts.md, "Leaf semantics:
    how one collective counts every element once"), the weighted local statistics are combined
    on this rank, and a single ``all_reduce`` over the ranks of ``mesh``
    completes the sum (or max/min). Nothing here reads a tensor value on the
    host.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients; ``None``
            leaves are skipped.
        mesh: The device mesh spanning every rank that holds part of the
            model, e.g. ``("pp", "dp_shard", "tp")``; or ``None`` for a model
            held whole on this rank (DTensor leaves are then still reduced
            over their own mesh, like ``full_tensor()``).
        norm_type: ``p > 0``, ``0`` (number of non-zero elements), ``inf`` or
            ``-inf``.
        pp_dim: Name(s) of the mesh dims whose coordinates hold different
            parts of the model (pipeline stages). Default: ``"pp"`` if the mesh
            has such a dim, else none.
        pp_mesh: The pipeline mesh, as torchtitan passes it
            (``parallel_dims.get_optional_mesh("pp")``): every rank's stage
            is read from its layout in the root mesh, with no collective, so
            any world mesh works, torchtitan's 1-D ``("world",)`` included.
            With ``mesh=None`` the world is its root mesh. Not with ``pp_dim``.
        groups: Optional ``{label: pattern}``; a leaf belongs to the first
            group whose pattern matches its dotted name (see docs/api.md,
            "Names and patterns": ``"layers.0"`` matches
            ``layers.0.attn.wq.weight``, not ``layers.01.w``), or a
            predicate on the name. Each group's global norm is computed in
            the same collective. Every rank must pass the same labels; a
            group that matches no leaf on any rank gets a NaN norm.
        tied: Optional ``{parameter name: n}``: the leaf's gradient is held,
            already summed and identical, by ``n`` pipeline stages (a tied
            embedding and output head: ``n=2``); it is counted once. Each
            stage declares the tied parameters it holds: a name that matches
            none of this rank's leaves raises.
        partial: ``"error"`` (default) rejects ``Partial`` DTensor leaves;
            ``"reduce"`` all-reduces their ``Partial("sum"/"avg")`` dims first,
            one extra collective per such leaf.
        overflow_safe: Accumulate every leaf in float64, so finite fp32 grads
            whose sum of squares overflows fp32 still have a finite norm.
            Slower in eager mode on CPU.

    Returns:
        A 0-dim float64 tensor on the grads' device: the all-reduced value
        itself, bitwise equal on every rank of ``mesh`` whatever leaves each
        rank holds (fp32, bf16 and fp16 grads give a norm accurate to fp32
        precision; float64 grads one accurate to float64 precision). NaN if any rank holds a NaN gradient, or failed (see
        Raises). With ``groups``, a pair ``(total_norm, {label: group_norm})``.

    Raises:
        TypeError: A leaf is not a float16/bfloat16/float32/float64 tensor,
            or an option has the wrong type.
        ValueError: ``norm_type`` is negative and finite, ``pp_dim`` is not a
            dim of ``mesh``, this rank or a leaf's mesh lies outside ``mesh``,
            a DTensor leaf lives on part of ``mesh`` and nothing says whether
            the other ranks are replicas or other stages (pass ``pp_mesh``),
            a multi-dim world smaller than the process group was not
            flattened up front, a ``tied`` name matches no leaf, or a leaf
            has a ``Partial`` placement that cannot be handled. A rank that
            raises after the arguments are known to be well-formed first
            joins the collective, so that its peers get a NaN norm instead
            of waiting for it.

    Example:
        >>> import torch
        >>> from ppclip_func import global_grad_norm
        >>> grads = {"w": torch.full((3,), 2.0), "b": None, "h": [torch.ones(4, 4)]}
        >>> global_grad_norm(grads, None)
        tensor(5.2915, dtype=torch.float64)
        >>> total, per_group = global_grad_norm(grads, None, groups={"w": "w", "h": "h"})
        >>> per_group
        {'w': tensor(3.4641, dtype=torch.float64), 'h': tensor(4., dtype=torch.float64)}
    """
    opts = NormOptions(pp_dim, groups, tied, partial, overflow_safe, pp_mesh=pp_mesh)
    _, measured = run(
        "global_grad_norm", grads, mesh, norm_type, opts, lambda: Checked(norm_kind(norm_type)), in_place=False
    )
    return measured.norms(groups is not None)


@torch.no_grad()
def clip_grads_with_norm(
    grads: PyTree,
    max_norm: float | torch.Tensor,
    total_norm: torch.Tensor,
    *,
    eps: float = 1e-6,
    nonfinite: str = "propagate",
) -> PyTree:
    """Returns ``grads`` scaled by ``min(max_norm / (total_norm + eps), 1)``.

    Pure: the inputs are not modified. Each DTensor comes back a DTensor with
    the same mesh, placements, shape and stride; dtypes and devices are kept.
    Local shards are scaled directly, so no DTensor dispatch happens per leaf.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients or ``None``.
        max_norm: The largest norm allowed, a number or a 0-dim tensor.
        total_norm: The norm to clip against, as from :func:`global_grad_norm`.
        eps: Added to ``total_norm`` before dividing.
        nonfinite: What to do when ``total_norm`` is inf or NaN:
            ``"propagate"`` (scale anyway, as torch does), ``"zero"`` (return
            all-zero grads, on the device, no sync), ``"error"`` (raise; a
            host read, not under ``torch.compile``) or ``"abort"`` (stop the
            process with ``torch._assert_async``: no host read, eager or
            compiled; on CPU a ``RuntimeError`` before any grad is scaled,
            on CUDA a device-side assert that loses the CUDA context; see
            docs/failure-modes.md).

    Returns:
        The scaled gradients, with the structure of ``grads``.

    Raises:
        TypeError: A leaf is not a real floating-point tensor, or
            ``total_norm`` is not a 0-dim tensor.
        ValueError: ``max_norm`` or ``eps`` is negative or NaN, or
            ``nonfinite`` is not a policy.
        RuntimeError: ``nonfinite="error"`` and ``total_norm`` is not finite;
            or ``nonfinite="abort"`` and it is not finite, on CPU (on CUDA
            the next synchronizing call fails instead).

    Example:
        >>> import torch
        >>> from ppclip_func import clip_grads_with_norm
        >>> clip_grads_with_norm([torch.full((4,), 3.0)], 1.0, torch.tensor(6.0), eps=0.0)
        [tensor([0.5000, 0.5000, 0.5000, 0.5000])]
    """
    check_clip_args(max_norm, eps, nonfinite)
    if not isinstance(total_norm, torch.Tensor) or total_norm.dim() != 0:
        raise TypeError(f"total_norm must be a 0-dim tensor, got {total_norm!r}")
    leaves = flatten_grads(grads)
    scaled = apply_clip(leaves.shards, max_norm, total_norm, eps, nonfinite, None, inplace=False)
    return leaves.unflatten(rewrapped(leaves, scaled))


@overload
def clip_grad_norm(
    grads: PyTree,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: None = None,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> tuple[PyTree, torch.Tensor]: ...


@overload
def clip_grad_norm(
    grads: PyTree,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: GroupSpec,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> tuple[PyTree, torch.Tensor, GroupNorms]: ...


@torch.no_grad()
def clip_grad_norm(
    grads: PyTree,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: GroupSpec | None = None,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> tuple[PyTree, torch.Tensor] | tuple[PyTree, torch.Tensor, GroupNorms]:
    """Clips a gradient pytree by the global norm over ``mesh``; pure.

    Equivalent to :func:`global_grad_norm` followed by
    :func:`clip_grads_with_norm`, sharing one flattening of the tree. Exactly
    one collective is issued (none when nothing is distributed), and the
    whole function traces into one ``torch.compile`` graph.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients or ``None``.
        mesh: The world mesh, or ``None`` (see :func:`global_grad_norm`).
        max_norm: The largest norm allowed, a number or a 0-dim tensor. Under
            ``torch.compile`` a Python number is baked into the first graph
            (a different value recompiles once); pass a 0-dim tensor for a
            schedule.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf``.
        pp_dim: The pipeline dim name(s) of ``mesh`` (default ``"pp"`` if present).
        pp_mesh: The pipeline mesh (see :func:`global_grad_norm`).
        eps: Added to the total norm before dividing.
        groups: Per-group norms (see :func:`global_grad_norm`).
        tied: Leaves held by several pipeline stages (see :func:`global_grad_norm`).
        partial: ``"error"`` or ``"reduce"`` (see :func:`global_grad_norm`).
        nonfinite: ``"propagate"``, ``"zero"``, ``"error"`` or ``"abort"``
            (see :func:`clip_grads_with_norm`).
        overflow_safe: Float64 accumulation (see :func:`global_grad_norm`).

    Returns:
        ``(clipped, total_norm)``: the scaled gradients, with the structure
        of ``grads``, and the norm before clipping; with ``groups``,
        ``(clipped, total_norm, {label: group_norm})``.

    Raises:
        TypeError, ValueError, RuntimeError: As :func:`global_grad_norm` and
            :func:`clip_grads_with_norm`.

    Example:
        >>> import torch
        >>> from ppclip_func import clip_grad_norm
        >>> clipped, norm = clip_grad_norm({"w": torch.full((4,), 3.0), "b": None}, None, max_norm=1.0)
        >>> norm
        tensor(6., dtype=torch.float64)
        >>> clipped["w"], clipped["b"]
        (tensor([0.5000, 0.5000, 0.5000, 0.5000]), None)
    """
    layout = (pp_dim, pp_mesh, groups, tied, partial, overflow_safe)
    measured, scaled = _fixed(
        "clip_grad_norm", grads, mesh, max_norm, norm_type, layout, eps, nonfinite, in_place=False
    )
    clipped = output(measured, scaled)
    return (clipped, *measured.norms(True)) if groups is not None else (clipped, measured.norms(False))


@overload
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor] | Any,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: None = None,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> torch.Tensor: ...


@overload
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor] | Any,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: GroupSpec,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> tuple[torch.Tensor, GroupNorms]: ...


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor] | Any,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: GroupSpec | None = None,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, GroupNorms]:
    """Clips ``p.grad`` of every parameter in place by the global norm over ``mesh``.

    The drop-in for a torchtitan-style trainer: same norm and the same one
    collective as :func:`clip_grad_norm`, but the gradients are scaled in
    place (one ``_foreach_mul_`` per device and dtype) and only the norm is
    returned. Parameters without a gradient are skipped. A generator is
    consumed once, into a list, so it is never silently exhausted.

    Args:
        parameters: A tensor, an iterable of tensors (a generator works), or
            a pytree of them such as ``dict(model.named_parameters())`` (then
            ``groups`` and ``tied`` patterns see the parameter names). An
            already consumed generator warns.
        mesh: The world mesh, or ``None`` (see :func:`global_grad_norm`).
        max_norm: The largest norm allowed, a number or a 0-dim tensor.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf``.
        pp_dim: The pipeline dim name(s) of ``mesh`` (default ``"pp"`` if present).
        pp_mesh: The pipeline mesh (see :func:`global_grad_norm`).
        eps: Added to the total norm before dividing.
        groups: Per-group norms (see :func:`global_grad_norm`).
        tied: Leaves held by several pipeline stages (see :func:`global_grad_norm`).
        partial: ``"error"`` or ``"reduce"`` (see :func:`global_grad_norm`).
        nonfinite: ``"propagate"``, ``"zero"``, ``"error"`` or ``"abort"``
            (see :func:`clip_grads_with_norm`).
        overflow_safe: Float64 accumulation (see :func:`global_grad_norm`).

    Returns:
        The total norm of the gradients before clipping; with ``groups``,
        ``(total_norm, {label: group_norm})``.

    Raises:
        TypeError, ValueError, RuntimeError: As :func:`clip_grad_norm`; leaf
            paths name the parameter.

    Example:
        >>> import torch
        >>> from ppclip_func import clip_grad_norm_
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> clip_grad_norm_(model.parameters(), None, max_norm=1.0)
        tensor(5., dtype=torch.float64)
        >>> model.weight.grad
        tensor([[0.6000, 0.8000]])
    """
    layout = (pp_dim, pp_mesh, groups, tied, partial, overflow_safe)
    measured, _ = _fixed(
        "clip_grad_norm_", parameters, mesh, max_norm, norm_type, layout, eps, nonfinite, in_place=True
    )
    return measured.norms(groups is not None)


@torch.no_grad()
def adaptive_clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor] | Any,
    mesh: DeviceMesh | None,
    state: ClipState,
    norm_type: float = 2.0,
    *,
    max_norm: float | torch.Tensor | None = 1.0,
    z: float | None = 2.5,
    alpha: float = 0.97,
    warmup: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    zscore_eps: float = 1e-6,
    freeze_on_spike: bool = False,
    skip_z: float | None = None,
    param_norms: ParamIndex | None = None,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: GroupSpec | None = None,
    exclude: Collection[str] = (),
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> ClipStats:
    """Clips ``p.grad`` in place to a threshold that follows the run (ZClip); says whether to skip the step.

    One collective, as :func:`clip_grad_norm_`, and nothing read on the host:
    the threshold, the skip decision and the new statistics are 0-dim
    tensors computed on the device. The rule and its defaults are ZClip's
    (Kumar et al. 2025, arXiv:2504.02507) as its package ``zclip==1.0.0``
    computes them, tested step by step against it; docs/adaptive.md ("Adaptive
    threshold: ZClip") maps ZClip's option names to these.

    * **Warm-up** (the first ``warmup`` finite norms): clip at ``max_norm``;
      the norms' mean and variance start the statistics.
    * **Then** (with ``z``): a norm is a spike when its z-score
      ``(norm - mean) / (std + zscore_eps)`` is above ``z`` (``mode="zscore"``) or
      when it is above ``mean + z * std`` (``mode="percentile"``); a spike is
      clipped to a target near the mean (``clip_option``), and the statistics,
      exponentially weighted with ``alpha``, take that target in instead of
      the norm, so one spike does not raise the next threshold.
      ``max_norm`` caps every step. With ``z=None`` the clip stays at
      ``max_norm`` and the statistics still follow the norm (for ``skip_z``
      and logging).
    * **Skip**: ``stats.skip`` is true when the norm is non-finite, or (with
      ``skip_z``, after warm-up) its z-score is above ``skip_z``. A skipped
      step leaves the statistics unchanged, so a NaN norm does not end the
      adaptation (ZClip's statistics would be NaN from then on). The grads
      are clipped either way; apply the decision to the optimizer update
      with :func:`skip_update_` (in place) or :func:`select_update` (pure).

    Args:
        parameters: As :func:`clip_grad_norm_`; for ``param_norms``, the
            tree the index was built from (``dict(model.named_parameters())``).
        mesh: The world mesh, or ``None`` (see :func:`global_grad_norm`).
        state: The previous step's ``stats.state``; :func:`init_clip_state`
            for the first step.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf``.
        max_norm: ZClip's ``max_grad_norm``: the cap on every step's
            threshold (the threshold itself during warm-up, and always with
            ``z=None``); a number, a 0-dim tensor, or ``None`` for no cap.
        z: ZClip's ``z_thresh``: how many standard deviations above the mean
            make a spike, or ``None`` for a fixed threshold.
        alpha: Weight of the past in the running statistics, in (0, 1):
            about ``1 / (1 - alpha)`` steps of memory (33 by default).
        warmup: ZClip's ``warmup_steps``: norms taken before the threshold
            adapts (>= 2).
        mode: ``"zscore"`` (ZClip's default) or ``"percentile"`` (a norm
            above ``mean + z * std`` is clipped to it).
        clip_option: What a spike is clipped to in ``"zscore"`` mode:
            ``"adaptive_scaling"``, ``mean + z * std / (zscore / z)`` (the
            larger the spike, the lower) times ``clip_factor``; or ``"mean"``.
        clip_factor: Multiplies the ``"adaptive_scaling"`` target, mean
            included, as ZClip's package computes it (> 0).
        zscore_eps: ZClip's ``eps``: added to ``std`` in the z-score (>= 0).
        freeze_on_spike: ZClip's ``skip_update_on_spike``: a spike leaves the
            statistics unchanged (its gradient is still clipped, and the
            step is not skipped).
        skip_z: Z-score above which a step is skipped, or ``None`` to skip
            only on a non-finite norm. Larger than ``z`` to mean anything:
            clip moderate spikes, skip extreme ones.
        param_norms: A :class:`ParamIndex` from :func:`param_norm_index`:
            every parameter's norm, of the whole model, on every rank, from
            the same collective.
        exclude: Labels of ``groups`` kept out of the clip: not in
            ``total_norm`` (so not in the statistics nor the skip decision),
            never scaled; their norms are still in ``group_norms``.
        pp_dim, pp_mesh, eps, groups, tied, partial, nonfinite,
            overflow_safe: As :func:`clip_grad_norm_` (``eps=1e-6`` is
            ZClip's clip coefficient, whatever its own ``eps``).

    Returns:
        A :class:`ClipStats`: the norm before clipping, the threshold, the
        z-score, ``skip``, the new state, and the group and parameter norms
        if asked for.

    Raises:
        TypeError, ValueError, RuntimeError: As :func:`clip_grad_norm_`, and
            for a malformed ``state`` or option.

    Example:
        >>> import torch
        >>> from ppclip_func import adaptive_clip_grad_norm_, init_clip_state
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> state = init_clip_state()
        >>> opts = dict(max_norm=None, warmup=5, skip_z=50.0)
        >>> for step in range(30):
        ...     w.grad = torch.full((2,), 1.0 + 0.1 * (step % 3))  # norms 1.41 to 1.70
        ...     stats = adaptive_clip_grad_norm_([w], None, state, **opts)
        ...     state = stats.state
        >>> w.grad = torch.full((2,), 3.0)  # a spike, clipped to just above the mean (1.55)
        >>> stats = adaptive_clip_grad_norm_([w], None, state, **opts)
        >>> [round(float(t), 2) for t in (stats.total_norm, stats.zscore, stats.threshold, w.grad.norm())]
        [4.24, 24.13, 1.57, 1.57]
        >>> w.grad = torch.full((2,), 50.0)  # an extreme one: skipped
        >>> bool(adaptive_clip_grad_norm_([w], None, stats.state, **opts).skip)
        True
    """
    rule = Rule(max_norm, z, alpha, warmup, skip_z, mode, clip_option, clip_factor, zscore_eps, freeze_on_spike)
    layout = (pp_dim, pp_mesh, groups, tied, partial, overflow_safe, param_norms)
    _, _, stats = _adaptive(
        "adaptive_clip_grad_norm_",
        parameters,
        mesh,
        state,
        norm_type,
        rule,
        layout,
        eps,
        exclude,
        nonfinite,
        in_place=True,
    )
    return stats


@torch.no_grad()
def adaptive_clip_grad_norm(
    grads: PyTree,
    mesh: DeviceMesh | None,
    state: ClipState,
    norm_type: float = 2.0,
    *,
    max_norm: float | torch.Tensor | None = 1.0,
    z: float | None = 2.5,
    alpha: float = 0.97,
    warmup: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    zscore_eps: float = 1e-6,
    freeze_on_spike: bool = False,
    skip_z: float | None = None,
    param_norms: ParamIndex | None = None,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    groups: GroupSpec | None = None,
    exclude: Collection[str] = (),
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> tuple[PyTree, ClipStats]:
    """The pure form of :func:`adaptive_clip_grad_norm_`: returns ``(clipped grads, stats)``.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients or ``None``.
        mesh, state, norm_type, max_norm, z, alpha, warmup, mode,
            clip_option, clip_factor, zscore_eps, freeze_on_spike, skip_z,
            param_norms, pp_dim, pp_mesh, eps, groups, exclude, tied,
            partial, nonfinite, overflow_safe: As :func:`adaptive_clip_grad_norm_`
            (excluded leaves come back unscaled).

    Returns:
        The clipped gradients, with the structure of ``grads``, and a
        :class:`ClipStats`.

    Example:
        >>> import torch
        >>> from ppclip_func import adaptive_clip_grad_norm, init_clip_state
        >>> clipped, stats = adaptive_clip_grad_norm({"w": torch.full((4,), 3.0)}, None, init_clip_state())
        >>> clipped["w"], float(stats.total_norm), float(stats.threshold)
        (tensor([0.5000, 0.5000, 0.5000, 0.5000]), 6.0, 1.0)
    """
    rule = Rule(max_norm, z, alpha, warmup, skip_z, mode, clip_option, clip_factor, zscore_eps, freeze_on_spike)
    layout = (pp_dim, pp_mesh, groups, tied, partial, overflow_safe, param_norms)
    measured, out, stats = _adaptive(
        "adaptive_clip_grad_norm", grads, mesh, state, norm_type, rule, layout, eps, exclude, nonfinite, in_place=False
    )
    return output(measured, out), stats


# The fixed and the adaptive rule, each shared by its pure and its in-place form: ``layout`` is the forms'
# (pp_dim, pp_mesh, groups, tied, partial, overflow_safe[, param_norms]), as they take them.


def _fixed(
    form: str,
    given: Any,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    norm_type: float,
    layout: tuple[Any, ...],
    eps: float,
    nonfinite: str,
    *,
    in_place: bool,
) -> tuple[Measured, list[torch.Tensor]]:
    """The clip at a fixed ``max_norm``: the measured norms and the scaled local shards."""
    pp_dim, pp_mesh, groups, tied, partial, overflow_safe = layout
    agree = (("eps", eps), ("nonfinite", nonfinite))
    opts = NormOptions(pp_dim, groups, tied, partial, overflow_safe, pp_mesh=pp_mesh, also_agree=agree)

    def validate() -> Checked:
        check_clip_args(max_norm, eps, nonfinite)
        return Checked(norm_kind(norm_type))

    found, measured = run(form, given, mesh, norm_type, opts, validate, in_place=in_place)
    shards = measured.leaves.shards
    return measured, apply_clip(shards, max_norm, measured.total, eps, nonfinite, found.kind.p, inplace=in_place)


def _adaptive(
    form: str,
    given: Any,
    mesh: DeviceMesh | None,
    state: ClipState,
    norm_type: float,
    rule: Rule,
    layout: tuple[Any, ...],
    eps: float,
    exclude: Collection[str],
    nonfinite: str,
    *,
    in_place: bool,
) -> tuple[Measured, list[torch.Tensor], ClipStats]:
    """The clip at ZClip's threshold: the measured norms, the local shards (the excluded ones as given), the stats."""
    pp_dim, pp_mesh, groups, tied, partial, overflow_safe, param_norms = layout
    agree = (("rule", rule_fields(rule)), ("eps", eps), ("nonfinite", nonfinite), ("exclude", label_set(exclude)))
    opts = NormOptions(pp_dim, groups, tied, partial, overflow_safe, param_norms, pp_mesh, agree)

    def validate() -> Checked:
        check_clip_args(math.inf if rule.max_norm is None else rule.max_norm, eps, nonfinite)  # None: no cap
        check_adaptive_args(state, rule)
        labels, excluded = check_exclude(groups, exclude)
        return Checked(norm_kind(norm_type), labels, excluded)

    found, measured = run(form, given, mesh, norm_type, opts, validate, in_place=in_place, state=state)
    measured, scaled = without_excluded(measured, found.kind, groups, found.labels, found.excluded)
    stats = adaptive_stats(measured, state, rule, groups is not None)
    shards, p = measured.leaves.shards, found.kind.p
    if len(scaled) == len(shards):  # nothing excluded
        return measured, apply_clip(shards, stats.threshold, measured.total, eps, nonfinite, p, inplace=in_place), stats
    out = list(shards)
    new = apply_clip([out[i] for i in scaled], stats.threshold, measured.total, eps, nonfinite, p, inplace=in_place)
    for i, t in zip(scaled, new):
        out[i] = t
    return measured, out, stats
