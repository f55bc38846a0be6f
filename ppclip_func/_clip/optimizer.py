"""The clip handed to the optimizer: the gradients read once, a skipped step that copies nothing.

A clip followed by an optimizer step reads the gradients three times (the
norm, the scaling, the step) and a skipped step, done by undoing it
(:func:`~ppclip_func.skip_update_`), copies every parameter and moment. torch's
fused optimizers (``Adam``, ``AdamW`` and ``SGD`` with ``fused=True``) already
take what a clip and a skip need, the way ``torch.amp.GradScaler`` uses them:
a ``grad_scale`` tensor the kernel divides every gradient by, and a
``found_inf`` tensor that, when non-zero, leaves parameters, moments and step
count untouched. So the clip measures the norm (its one collective), and
hands ``grad_scale = 1 / coefficient`` and ``found_inf = skip`` to the
optimizer, as attributes that the optimizer's next ``step()`` reads and that
a one-shot step post-hook removes: a later step without a clip is a plain
step. Nothing is read on the host and no gradient is written by the clip.

Other optimizers (``foreach``/for-loop, Muon, anything without
``_step_supports_amp_scaling``) get the fallback: their gradients are scaled
in place (one ``_foreach_mul_``), and a skip replaces their next ``step()``
by one that reads the skip flag on the host (one sync, which a trainer that
logs the norm pays anyway) and returns without stepping when it is set.

Containers of optimizers (torchtitan's ``OptimizersContainer``, anything
with an ``optimizers`` list) are handled optimizer by optimizer. Under
``torch.compile`` the norm is traced and the hand-over runs at a graph
break, as a fused ``optimizer.step()`` does; for one graph with no break,
the traced clip and :func:`~ppclip_func.select_update` /
:func:`~ppclip_func.skip_update_` fuse into a compiled functional step
instead (see docs/compile.md, "A compiled optimizer step").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from .._core.agreement import rule_fields
from .._core.annotations import GroupSpec, TiedSpec
from .._core.norms import norm_kind
from .._core.param_norms import ParamIndex
from .._core.scale import clip_coefficient, finite_mask, scale
from .._core.setup import Checked, GroupNorms, NormOptions, PpDim, check_clip_args
from .adaptive import ClipState, ClipStats, Rule, check_adaptive_args
from .path import adaptive_stats, run

__all__: list[str] = []

_HANDED = "_ppclip_handed"  # the attribute marking an optimizer that holds a handed-over clip
_BUFFERS = "_ppclip_scale_buffers"  # the optimizer's (grad_scale, found_inf), written in place at each hand-over


def optimizers_of(optimizer: Any) -> list[Optimizer]:
    """Returns the torch optimizers behind ``optimizer``: itself, or a container's ``optimizers``.

    Raises:
        TypeError: Neither a ``torch.optim.Optimizer`` nor a container of them.
    """
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, (list, tuple)):
        found = [o for item in inner for o in optimizers_of(item)]
    elif isinstance(optimizer, Optimizer):
        found = [optimizer]
    elif isinstance(optimizer, (list, tuple)):
        found = [o for item in optimizer for o in optimizers_of(item)]
    else:
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a list of them, or a container with an `optimizers` "
            f"list (torchtitan's OptimizersContainer), got {type(optimizer).__name__}"
        )
    return found


# torch's optimizers whose step passes ``self.grad_scale`` and ``self.found_inf`` to a fused kernel.
_FUSED_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def takes_scale(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step()`` applies ``grad_scale`` and ``found_inf`` itself (torch's fused kernels).

    Read from the parameter groups, not from ``_step_supports_amp_scaling``:
    torchtitan puts ``fused=True`` in each group, and torch sets that flag only
    for a ``fused=True`` constructor argument. Every group must be fused (a
    non-fused group of the same optimizer rejects a ``grad_scale``).
    """
    return isinstance(optimizer, _FUSED_TYPES) and all(g.get("fused") for g in optimizer.param_groups)


# Host-side bookkeeping on Python objects (attributes, hooks, a bound method): under torch.compile
# it runs eagerly, at a graph break, as the optimizer step it prepares does.
@torch.compiler.disable
def hand_over(
    optimizers: Iterable[Optimizer], coefficient: Callable[[torch.dtype], torch.Tensor], skip: torch.Tensor | None
) -> None:
    """Arranges for each optimizer's next ``step()`` to clip by ``coefficient`` and to skip where ``skip``.

    Args:
        optimizers: Torch optimizers (:func:`optimizers_of`).
        coefficient: The 0-dim clip coefficient (at most 1) computed in a
            given dtype (:func:`~ppclip_func._core.scale.clip_coefficient` with
            its first arguments bound), as :func:`~ppclip_func._core.scale.scale`
            takes it.
        skip: A 0-dim bool tensor, or ``None`` for never.
    """
    for opt in optimizers:
        if takes_scale(opt):
            # torch's fused kernels compute in float32 for fp32, bf16 and fp16 parameters.
            _hand_to_fused(opt, coefficient(torch.float32), skip)
        else:
            scale(_local_grads(opt), coefficient, inplace=True)
            if skip is not None:
                _skip_next_step(opt, skip)


def _hand_to_fused(opt: Optimizer, coef: torch.Tensor, skip: torch.Tensor | None) -> None:
    """Writes ``1 / coef`` and ``skip`` into the optimizer's own two 0-dim float32 tensors and hands them
    over as its ``grad_scale`` and ``found_inf``.

    The two tensors are made at the first hand-over on their device and
    written in place from then on, so their storage never changes: a CUDA
    graph that captured ``optimizer.step()`` reads each step's values there,
    whether the clip is captured with it or runs before each replay.
    """
    buffers = opt.__dict__.get(_BUFFERS)
    if buffers is None or buffers[0].device != coef.device:
        zero = torch.zeros((), dtype=torch.float32, device=coef.device)
        buffers = opt.__dict__[_BUFFERS] = (zero, zero.clone())
    grad_scale, found_inf = buffers
    # The kernel divides by grad_scale in float32; 1 / coef is exact where coef is a power of two
    # and otherwise within one rounding of multiplying by coef. Plain in-place ops: this function is
    # never traced (torch.compiler.disable), so inductor never orders them (ppclip_func/_clip/write_back.py).
    torch.reciprocal(coef.to(torch.float32), out=grad_scale)
    if skip is None:
        found_inf.zero_()
    else:
        found_inf.copy_(skip)
    handed = opt.__dict__.get(_HANDED)
    if handed is None:  # not stepped since an earlier hand-over: this one replaces it
        handed = opt.__dict__[_HANDED] = {"hook": opt.register_step_post_hook(_take_back)}
    handed["grad_scale"] = opt.grad_scale = grad_scale  # type: ignore[attr-defined]  # read by the fused kernels, as GradScaler sets it
    handed["found_inf"] = opt.found_inf = found_inf  # type: ignore[attr-defined]  # read by the fused kernels, as GradScaler sets it


def _take_back(opt: Optimizer, args: Any, kwargs: Any) -> None:
    """Step post-hook: the handed-over clip was used by this step; the next one is plain.

    Only this clip's own tensors are removed: a ``GradScaler`` that set its
    own (its product of scales, its ``found_inf``) removes them itself.
    """
    handed = opt.__dict__.pop(_HANDED)
    for name in ("grad_scale", "found_inf"):
        if opt.__dict__.get(name) is handed[name]:
            delattr(opt, name)
    handed["hook"].remove()


def _local_grads(opt: Optimizer) -> list[torch.Tensor]:
    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def _skip_next_step(opt: Optimizer, skip: torch.Tensor) -> None:
    """Replaces ``opt.step`` for one call by one that does nothing where ``skip`` is true (one host read)."""
    step = type(opt).step.__get__(opt)  # the class's (hooked) step, not a wrapper left by an earlier call

    def step_unless_skipped(*args: Any, **kwargs: Any) -> Any:
        _restore_step(opt)  # one call: the class's step again from now on
        if bool(skip):
            return None
        return step(*args, **kwargs)

    opt.step = step_unless_skipped  # type: ignore[method-assign]  # for one call: _restore_step puts it back


# Eager even under torch.compile: torch 2.11's dynamo cannot trace deleting an instance attribute.
@torch.compiler.disable
def _restore_step(opt: Optimizer) -> None:
    del opt.step


NONFINITE_IN_OPTIMIZER = ("propagate", "skip", "error")


@torch.no_grad()
def clip_grad_norm_in_optimizer(
    optimizer: Any,
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
    """Measures the global norm now and hands the clip to ``optimizer``'s next ``step()``.

    The norm is that of :func:`~ppclip_func.clip_grad_norm_` (the same one
    collective, the same options). Nothing is scaled here for torch's fused
    optimizers (``fused=True`` Adam, AdamW, SGD): their next ``step()``
    divides each gradient by ``1 / coefficient`` as it reads it, so the
    gradients are read once for the norm and once for the step. Other
    optimizers get their gradients scaled in place here (as
    :func:`~ppclip_func.clip_grad_norm_` does). The trainer's own
    ``optimizer.step()`` stays as it is, wherever it is called; the step
    after it is a plain one.

    On CPU, torch's fused kernels write the clipped gradients back into
    ``.grad``; on CUDA ``.grad`` keeps the unclipped values (the step uses
    the clipped ones). Under ``torch.compile`` the hand-over runs at a graph
    break (see the module docstring). Not combined with ``torch.amp.GradScaler`` (its ``found_inf`` and
    scale replace what is handed over).

    Args:
        optimizer: A ``torch.optim.Optimizer``, a list of them, or a
            container with an ``optimizers`` list (torchtitan's
            ``OptimizersContainer``).
        parameters: The parameters whose gradients are measured, as for
            :func:`~ppclip_func.clip_grad_norm_` (all of the model's, on
            this rank).
        mesh, max_norm, norm_type, pp_dim, pp_mesh, eps, groups, tied,
            partial, overflow_safe: As :func:`~ppclip_func.clip_grad_norm_`.
        nonfinite: ``"propagate"`` (torch's behaviour: a NaN norm makes a
            NaN step), ``"skip"`` (the step is skipped, parameters and
            optimizer state untouched, when the norm is not finite; on the
            device for fused optimizers, one host read in the fallback) or
            ``"error"`` (raise before the step, a host read).

    Returns:
        The total norm before clipping; with ``groups``, ``(total_norm,
        {label: group_norm})``.

    Raises:
        TypeError, ValueError, RuntimeError: As
            :func:`~ppclip_func.clip_grad_norm_`; ``TypeError`` for an
            ``optimizer`` that is none of the above.

    Example:
        >>> import torch
        >>> from ppclip_func import clip_grad_norm_in_optimizer
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = torch.optim.SGD([w], lr=1.0, fused=True)
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> clip_grad_norm_in_optimizer(opt, [w], None, max_norm=1.0)
        tensor(5., dtype=torch.float64)
        >>> opt.step()  # the clip happens here
        >>> w.detach()
        tensor([-0.6000, -0.8000])
    """
    optimizers = optimizers_of(optimizer)
    agree = (("eps", eps), ("nonfinite", nonfinite))
    opts = NormOptions(pp_dim, groups, tied, partial, overflow_safe, pp_mesh=pp_mesh, also_agree=agree)

    def validate() -> Checked:
        if nonfinite not in NONFINITE_IN_OPTIMIZER:
            raise ValueError(f"nonfinite must be one of {NONFINITE_IN_OPTIMIZER} here, got {nonfinite!r}")
        check_clip_args(max_norm, eps, "propagate")
        return Checked(norm_kind(norm_type))

    found, measured = run("clip_grad_norm_in_optimizer", parameters, mesh, norm_type, opts, validate, in_place=True)
    if nonfinite == "error":
        finite_mask(measured.total, found.kind.p, "error")
    skip = ~torch.isfinite(measured.total) if nonfinite == "skip" else None
    hand_over(optimizers, functools.partial(clip_coefficient, max_norm, measured.total, eps), skip)
    return measured.norms(groups is not None)


@torch.no_grad()
def adaptive_clip_grad_norm_in_optimizer(
    optimizer: Any,
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
    tied: TiedSpec | None = None,
    partial: str = "error",
    overflow_safe: bool = False,
) -> ClipStats:
    """:func:`~ppclip_func.adaptive_clip_grad_norm_` with the clip and the skip handed to ``optimizer``.

    The threshold, the skip decision and the new statistics are those of
    :func:`~ppclip_func.adaptive_clip_grad_norm_` (one collective, no host
    read); instead of scaling the gradients here, the coefficient and
    ``stats.skip`` go to the optimizer's next ``step()``, as
    :func:`clip_grad_norm_in_optimizer` hands them: a fused optimizer skips
    the step in its kernel, copying nothing (``skip_update_`` copies every
    parameter and moment). A non-finite norm is always a skipped step.

    Args:
        optimizer: As :func:`clip_grad_norm_in_optimizer`.
        parameters, mesh, state, norm_type, max_norm, z, alpha, warmup, mode,
            clip_option, clip_factor, zscore_eps, freeze_on_spike, skip_z,
            param_norms, pp_dim, pp_mesh, eps, groups, tied, partial,
            overflow_safe: As :func:`~ppclip_func.adaptive_clip_grad_norm_`.

    Returns:
        A :class:`~ppclip_func.ClipStats`; pass ``stats.state`` to the next step.

    Raises:
        TypeError, ValueError: As :func:`~ppclip_func.adaptive_clip_grad_norm_`
            and :func:`clip_grad_norm_in_optimizer`.

    Example:
        >>> import torch
        >>> from ppclip_func import adaptive_clip_grad_norm_in_optimizer, init_clip_state
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = torch.optim.AdamW([w], lr=0.1, fused=True)
        >>> state = init_clip_state()
        >>> for step in range(30):
        ...     w.grad = torch.full((2,), 1.0 + 0.1 * (step % 3))
        ...     state = adaptive_clip_grad_norm_in_optimizer(opt, [w], None, state, warmup=5, skip_z=6.0).state
        ...     opt.step()
        >>> w.grad = torch.full((2,), 50.0)  # a spike: the next step is skipped in the fused kernel
        >>> stats = adaptive_clip_grad_norm_in_optimizer(opt, [w], None, state, warmup=5, skip_z=6.0)
        >>> before = w.detach().clone()
        >>> opt.step()
        >>> bool(stats.skip), torch.equal(w.detach(), before), int(opt.state[w]["step"])
        (True, True, 30)
    """
    rule = Rule(max_norm, z, alpha, warmup, skip_z, mode, clip_option, clip_factor, zscore_eps, freeze_on_spike)
    optimizers = optimizers_of(optimizer)
    agree = (("rule", rule_fields(rule)), ("eps", eps))
    opts = NormOptions(pp_dim, groups, tied, partial, overflow_safe, param_norms, pp_mesh, agree)

    def validate() -> Checked:
        check_clip_args(math.inf if max_norm is None else max_norm, eps, "propagate")  # None: no cap
        check_adaptive_args(state, rule)
        return Checked(norm_kind(norm_type))

    form = "adaptive_clip_grad_norm_in_optimizer"
    _, measured = run(form, parameters, mesh, norm_type, opts, validate, in_place=True, state=state)
    stats = adaptive_stats(measured, state, rule, groups is not None)
    hand_over(optimizers, functools.partial(clip_coefficient, stats.threshold, measured.total, eps), stats.skip)
    return stats
