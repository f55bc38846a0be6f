"""The step's loss statistics in the clip's one collective, and the token normalization folded into the clip.

A trainer that divides its loss by the number of tokens of the whole step
(every rank, every microbatch, ignored tokens left out) must know that
number before its backward: torchtitan all-reduces the local token count
before the forward, then all-reduces the loss again, on logging steps, to
report it. Both are sums, and the clip's statistics vector is summed over
every rank anyway (for a finite ``norm_type``), so they can ride in it.

The step then runs its backward on the *local summed* loss, and hands the
sum and its token count to the clip. The gradient of the global mean loss
is the gradient of the summed loss divided by the global token count ``N``,
and so is its norm; the clip scales every gradient once, by
``min(max_norm / (norm / N + eps), 1) / N``: the normalization costs no
pass of its own.

Three more float64 entries cross ranks: the loss sum, the token count and a
count of the ranks that flagged their step non-finite, each divided by the
number of ranks that hold the same copy (``LocalLoss.copies``: tensor-parallel
ranks compute the same loss), so that a sum over every rank counts each once.
A NaN or an infinity in any rank's loss makes the global sum non-finite by
itself; :attr:`StepStats.nonfinite` says so, and whether any gradient was.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._core.annotations import TiedSpec
from .._core.measure import Measured
from .._core.norms import NormKind, norm_kind
from .._core.scale import clip_coefficient, finite_mask, scale
from .._core.setup import Checked, NormOptions, PpDim, check_clip_args
from .path import output, run

__all__ = ["LocalLoss", "StepStats", "clip_grad_norm_with_loss", "clip_grad_norm_with_loss_"]

PyTree = TypeVar("PyTree")

# The step's entries in the collective, after the norms': the loss sum, the token count, the flags.
_SUMS = 3
_LOSS_DTYPES = (torch.float32, torch.float64)


class LocalLoss(NamedTuple):
    """This rank's part of the step's loss, handed to the clip's one collective.

    Attributes:
        loss_sum: The sum of this rank's per-token losses over the whole
            step (every microbatch of a gradient accumulation or a pipeline
            schedule), a 0-dim float32 or float64 tensor or a number; ``0.0``
            on a rank that computes no loss (a pipeline stage before the last).
        tokens: The number of tokens in that sum (ignored tokens left out):
            a 0-dim tensor or a number; ``0`` where ``loss_sum`` is ``0.0``.
        nonfinite: Optional 0-dim bool tensor: this rank saw something
            non-finite of its own (an activation, an auxiliary loss), which
            makes :attr:`StepStats.nonfinite` true on every rank.
        copies: How many ranks hold this same ``loss_sum`` and ``tokens``
            (tensor-parallel ranks compute the same loss: the TP degree);
            each copy is counted once.
    """

    loss_sum: torch.Tensor | float
    tokens: torch.Tensor | int | float
    nonfinite: torch.Tensor | None = None
    copies: int = 1


class StepStats(NamedTuple):
    """What the step's one collective measured; every field is a 0-dim tensor, the same bits on every rank.

    Attributes:
        total_norm: The norm of the gradients the clip measured, before
            clipping: of the normalized gradients (over ``tokens``) with
            ``normalize=True``, float64.
        loss: The global mean loss: every rank's ``loss_sum`` over every
            rank's ``tokens``, float64.
        tokens: The global token count, float64 (exact below 2**53).
        nonfinite: 0-dim bool: a rank's loss, a rank's flag, or a gradient
            was not finite (or no rank had a token). Feed it to
            :func:`~ppclip_func.skip_update_` or
            :func:`~ppclip_func.select_update` to skip the step.
    """

    total_norm: torch.Tensor
    loss: torch.Tensor
    tokens: torch.Tensor
    nonfinite: torch.Tensor


@torch.no_grad()
def clip_grad_norm_with_loss_(
    parameters: torch.Tensor | Any,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    loss: LocalLoss,
    norm_type: float = 2.0,
    *,
    normalize: bool = True,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> StepStats:
    """Clips ``p.grad`` in place and returns the step's global loss and token count, with one collective.

    As :func:`~ppclip_func.clip_grad_norm_`, and the same all-reduce also
    sums every rank's :class:`LocalLoss`. With ``normalize=True`` the
    gradients are those of the local *summed* loss (the sum over ranks, as
    DDP and FSDP2 give them when they do not average: FSDP2's
    ``set_gradient_divide_factor(1.0)``): they are divided by the global
    token count in the same pass that clips them, so the all-reduce of the
    token count before the forward is not needed. With ``normalize=False``
    the gradients are clipped as given and the loss statistics are only
    reported.

    fp16: a 16-bit loss sum is refused (a sum of many tokens' losses
    overflows float16 and loses its digits in bfloat16: accumulate it in
    float32). The gradients of a summed loss are larger than those of a mean
    by the token count; in float16 they can overflow where the mean's would
    not, which this clip reports as a non-finite norm and
    ``StepStats.nonfinite``: scale the loss down before the backward
    (``torch.amp.GradScaler``) or use ``normalize=False`` with a mean loss.

    Args:
        parameters: As :func:`~ppclip_func.clip_grad_norm_`.
        mesh: The world mesh, or ``None`` (see :func:`~ppclip_func.global_grad_norm`).
        max_norm: The largest norm allowed (of the normalized gradients).
        loss: This rank's :class:`LocalLoss`.
        norm_type: ``p > 0`` or ``0``: the loss statistics are sums, so the
            norm's statistics must be summed too (not ``inf``/``-inf``).
        normalize: Divide the gradients by the global token count.
        pp_dim, pp_mesh, eps, tied, partial, nonfinite, overflow_safe: As
            :func:`~ppclip_func.clip_grad_norm_`; ``nonfinite`` acts on the
            gradients' norm.

    Returns:
        A :class:`StepStats`.

    Raises:
        TypeError, ValueError, RuntimeError: As
            :func:`~ppclip_func.clip_grad_norm_`, and for a malformed
            ``loss``, a 16-bit loss sum, or an ``inf``/``-inf`` norm.

    Example:
        >>> import torch
        >>> from ppclip_func import LocalLoss, clip_grad_norm_with_loss_
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> w.grad = torch.tensor([30.0, 40.0])  # the gradient of a loss summed over 10 tokens
        >>> stats = clip_grad_norm_with_loss_([w], None, 1.0, LocalLoss(torch.tensor(25.0), 10))
        >>> float(stats.loss), float(stats.tokens), float(stats.total_norm), w.grad
        (2.5, 10.0, 5.0, tensor([0.6000, 0.8000]))
    """
    layout = (pp_dim, pp_mesh, tied, partial, overflow_safe)
    _, _, stats = _with_loss(
        "clip_grad_norm_with_loss_",
        parameters,
        mesh,
        max_norm,
        loss,
        norm_type,
        normalize,
        layout,
        eps,
        nonfinite,
        True,
    )
    return stats


@torch.no_grad()
def clip_grad_norm_with_loss(
    grads: PyTree,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    loss: LocalLoss,
    norm_type: float = 2.0,
    *,
    normalize: bool = True,
    pp_dim: PpDim = None,
    pp_mesh: DeviceMesh | None = None,
    eps: float = 1e-6,
    tied: TiedSpec | None = None,
    partial: str = "error",
    nonfinite: str = "propagate",
    overflow_safe: bool = False,
) -> tuple[PyTree, StepStats]:
    """The pure form of :func:`clip_grad_norm_with_loss_`: returns ``(clipped grads, stats)``.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients or ``None``.
        mesh, max_norm, loss, norm_type, normalize, pp_dim, pp_mesh, eps,
            tied, partial, nonfinite, overflow_safe: As
            :func:`clip_grad_norm_with_loss_`.

    Returns:
        The normalized and clipped gradients, with the structure of
        ``grads``, and a :class:`StepStats`.

    Example:
        >>> import torch
        >>> from ppclip_func import LocalLoss, clip_grad_norm_with_loss
        >>> grads = {"w": torch.tensor([3.0, 4.0])}  # the gradient of a loss summed over 4 tokens
        >>> clipped, stats = clip_grad_norm_with_loss(grads, None, 10.0, LocalLoss(6.0, 4))
        >>> clipped["w"], float(stats.loss), float(stats.total_norm)
        (tensor([0.7500, 1.0000]), 1.5, 1.25)
    """
    layout = (pp_dim, pp_mesh, tied, partial, overflow_safe)
    measured, out, stats = _with_loss(
        "clip_grad_norm_with_loss", grads, mesh, max_norm, loss, norm_type, normalize, layout, eps, nonfinite, False
    )
    return output(measured, out), stats


def _with_loss(
    form: str,
    given: Any,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    loss: LocalLoss,
    norm_type: float,
    normalize: bool,
    layout: tuple[Any, ...],
    eps: float,
    nonfinite: str,
    in_place: bool,
) -> tuple[Measured, list[torch.Tensor], StepStats]:
    """The clip with the step's loss statistics: the measured norms, the scaled local shards, the stats."""
    pp_dim, pp_mesh, tied, partial, overflow_safe = layout
    agree = (("eps", eps), ("nonfinite", nonfinite), ("normalize", normalize))
    opts = NormOptions(pp_dim, None, tied, partial, overflow_safe, pp_mesh=pp_mesh, also_agree=agree, sums=_SUMS)

    def validate() -> Checked:
        check_clip_args(max_norm, eps, nonfinite)
        kind = _sum_kind(norm_type)
        _check_loss(loss)
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {normalize!r}")
        return Checked(kind)

    found, measured = run(form, given, mesh, norm_type, opts, validate, in_place=in_place, sums=lambda: _local(loss))
    assert measured.sums is not None  # measured with opts.sums entries
    loss_sum, tokens, flagged = measured.sums.unbind()
    # The count of non-zero elements (p = 0) is the same for g / N as for g.
    total = measured.total / tokens if normalize and found.kind.p != 0 else measured.total
    mean = loss_sum / tokens
    stats = StepStats(total, mean, tokens, ~mean.isfinite() | (flagged > 0) | ~total.isfinite())
    keep = finite_mask(total, found.kind.p, nonfinite)

    def coefficient(dtype: torch.dtype) -> torch.Tensor:
        coef = clip_coefficient(max_norm, total, eps, dtype)
        return coef / tokens.to(dtype) if normalize else coef

    return measured, scale(measured.leaves.shards, coefficient, inplace=in_place, keep=keep), stats


def _sum_kind(norm_type: float) -> NormKind:
    kind = norm_kind(norm_type)
    if kind.op != "sum":
        raise ValueError(
            f"norm_type={norm_type} reduces with {kind.op}, and the loss statistics are sums: "
            "use a finite norm_type (p > 0 or 0) with the loss"
        )
    return kind


def _check_loss(loss: Any) -> None:
    """Raises ``TypeError``/``ValueError`` for a malformed :class:`LocalLoss`; reads no tensor value."""
    if not isinstance(loss, LocalLoss):
        raise TypeError(f"loss must be a LocalLoss(loss_sum, tokens), got {type(loss).__name__}")
    for name in ("loss_sum", "tokens"):
        value = getattr(loss, name)
        if isinstance(value, torch.Tensor):
            if value.dim() != 0:
                raise ValueError(f"loss.{name} must be a 0-dim tensor, got shape {tuple(value.shape)}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"loss.{name} must be a number or a 0-dim tensor, got {type(value).__name__}")
    if isinstance(loss.loss_sum, torch.Tensor) and loss.loss_sum.dtype not in _LOSS_DTYPES:
        raise TypeError(
            f"loss.loss_sum is {loss.loss_sum.dtype}: a sum of many tokens' losses overflows float16 and loses "
            "its digits in bfloat16; accumulate it in float32 or float64"
        )
    flag = loss.nonfinite
    if flag is not None and not (isinstance(flag, torch.Tensor) and flag.dim() == 0 and flag.dtype == torch.bool):
        raise TypeError(f"loss.nonfinite must be None or a 0-dim bool tensor, got {flag!r}")
    copies = loss.copies
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"loss.copies must be an int >= 1 (the ranks holding this same loss), got {copies!r}")


def _local(loss: LocalLoss) -> torch.Tensor:
    """This rank's three summed entries, each copy of the loss weighted so that the ranks' sum counts it once."""
    tensors = [t for t in (loss.loss_sum, loss.tokens, loss.nonfinite) if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else None
    flag = loss.nonfinite if loss.nonfinite is not None else False
    values = [torch.as_tensor(v, dtype=torch.float64, device=device) for v in (loss.loss_sum, loss.tokens, flag)]
    local = torch.stack(values)
    return local / loss.copies if loss.copies != 1 else local
