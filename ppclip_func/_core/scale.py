"""Scaling: the clip coefficient, the non-finite policy, and branch-free application to every shard."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from .._base import torch_compat

__all__: list[str] = []

NONFINITE_POLICIES = ("propagate", "zero", "error", "abort")
ABORT_MESSAGE = "the global gradient norm is non-finite (nonfinite='abort')"


def clip_coefficient(
    max_norm: float | torch.Tensor, total_norm: torch.Tensor, eps: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Returns ``min(max_norm / (total_norm + eps), 1)`` as a 0-dim tensor, computed in ``dtype``.

    Clamping instead of ``if total_norm > max_norm`` keeps the decision on
    the device: a Python ``if`` on a tensor would need a device-to-host sync
    every step, and a graph break under ``torch.compile``.

    Args:
        max_norm: A number or a 0-dim tensor.
        total_norm: The 0-dim norm (float64 from :func:`global_grad_norm`).
        eps: Added to the norm before dividing.
        dtype: The arithmetic's dtype (default ``total_norm``'s). :func:`scale`
            asks for each gradient's compute dtype: float32 for fp32, bf16 and
            fp16 leaves, float64 for float64 ones. Each is a function of the
            norm alone, so every rank, whatever leaves it holds, scales a leaf
            of a given dtype by the same coefficient.
    """
    if dtype is not None and total_norm.dtype != dtype:
        total_norm = total_norm.to(dtype)
    if isinstance(max_norm, torch.Tensor) and max_norm.dtype != total_norm.dtype:
        max_norm = max_norm.to(total_norm.dtype)
    denominator = total_norm + eps
    if isinstance(max_norm, torch.Tensor):
        return torch.clamp(max_norm / denominator, max=1.0)
    # What `max_norm / denominator` computes for a Python number (Tensor.__rdiv__), without its Python
    # wrapper, which costs more than the op, once per compute dtype of every eager clip.
    return torch.clamp(denominator.reciprocal() * max_norm, max=1.0)


def finite_mask(total_norm: torch.Tensor, norm_type: float | None, nonfinite: str) -> torch.Tensor | None:
    """Applies the ``nonfinite`` policy to the total norm before any gradient is scaled.

    Returns:
        ``None`` for ``"propagate"``, ``"error"`` and ``"abort"`` (gradients
        are scaled as computed); for ``"zero"``, a 0-dim bool tensor that is
        ``True`` where the norm is finite: the gradients are kept (scaled)
        where it is and zeroed where it is not, with ``torch.where``, on the
        device.

    Raises:
        ValueError: ``nonfinite`` is not one of the policies.
        RuntimeError: ``nonfinite="error"`` and the norm is not finite. Every
            rank holds the same bits of the norm, so every rank raises. The
            check reads the norm on the host (a sync); under
            ``torch.compile`` it fails at trace time instead.
        RuntimeError: ``nonfinite="abort"`` and the norm is not finite, on
            CPU: ``torch._assert_async`` checks there and then, eagerly (before
            any gradient is scaled) and in a compiled graph (the generated
            kernel throws; whether the scaling kernels ran first is the
            compiler's choice). On CUDA the check is a device-side assert
            that nothing raises at this call: the next synchronizing call
            fails with "device-side assert triggered", the CUDA context is
            lost and the process must exit (see docs/failure-modes.md). Every rank holds the same norm, so every rank stops.
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    if nonfinite == "zero":
        return torch.isfinite(total_norm)
    if nonfinite == "abort":
        # No host read, eager or compiled: the check runs where the norm is. It comes before the
        # scaling in program order, so an eager clip on CPU raises with every gradient unscaled.
        torch._assert_async(torch.isfinite(total_norm), ABORT_MESSAGE)
        return None
    if nonfinite == "error":
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "nonfinite='error' needs the norm on the host (a device sync), which a compiled graph cannot "
                "do without a graph break; use nonfinite='zero' under torch.compile"
            )
        if not bool(torch.isfinite(total_norm)):
            what = f"norm_type={norm_type}" if norm_type is not None else "the given total_norm"
            raise RuntimeError(
                f"the global gradient norm is non-finite ({float(total_norm)}, {what}); "
                "no gradient was scaled (nonfinite='error')"
            )
    return None


# Devices whose _foreach_mul_ keeps its fast multi-tensor kernel only for a factor of the tensors' own
# dtype: bf16/fp16 tensors times a float32 0-dim tensor fall back to a generic kernel per tensor (CUDA;
# measured: bench/README.md, "Why the local statistics are built as they are").
SAME_DTYPE_FACTOR = frozenset({"cuda"})
_ROUNDED = (torch.bfloat16,)  # fp16 is not: a coefficient below 6e-8 would round to 0 there


def factor_for(factor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``factor`` as the multiply of ``dtype`` tensors on ``device`` takes it fastest.

    Eagerly on a :data:`SAME_DTYPE_FACTOR` device, bf16 grads are
    multiplied by the factor rounded to bf16, as torch's own clip does (the
    clipped norm is then within 2**-8 of its target, relative); fp16 grads,
    all grads elsewhere, and compiled (inductor computes the product in
    float32 in registers), by the float32 factor: one rounding, of the product.
    """
    if dtype in _ROUNDED and device.type in SAME_DTYPE_FACTOR and not torch.compiler.is_compiling():
        return factor.to(dtype)
    return factor


def scale(
    tensors: list[torch.Tensor],
    coefficient: Callable[[torch.dtype], torch.Tensor],
    *,
    inplace: bool,
    keep: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Multiplies every tensor by its clip coefficient, one foreach call per (device, dtype).

    Args:
        tensors: The local shards to scale.
        coefficient: The 0-dim clip coefficient computed in a given dtype
            (:func:`clip_coefficient` with its first three arguments bound);
            called once per compute dtype.
        inplace: Scale the tensors themselves instead of returning new ones.
        keep: Optional 0-dim bool tensor; where ``False`` every result is
            zero (``nonfinite="zero"``). ``coef * inf`` would be ``nan``, so
            the products are zeroed after the multiply, not multiplied by a
            zero coefficient: one more pass over the gradients in eager mode,
            fused with the multiply under ``torch.compile``.

    Returns:
        The scaled tensors in input order (the inputs themselves when
        ``inplace``). Each keeps its dtype: the product is computed in the
        higher precision of the pair and rounded once (but see
        :func:`factor_for`: eager bf16 on CUDA).
    """
    out: list[torch.Tensor] = list(tensors)
    coefs: dict[torch.dtype, torch.Tensor] = {}
    for (device, dtype), (group, idx) in _by_device_and_dtype(tensors).items():
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        if compute not in coefs:
            coefs[compute] = own_buffer(coefficient(compute))
        coef = coefs[compute]
        # Tensor.to is a dispatched op even when it returns self: a few us of every eager clip.
        factor = factor_for(coef if coef.device == device else coef.to(device), device, dtype)
        multiply_group(tensors, out, group, idx, factor, keep, inplace=inplace)
    return out


def own_buffer(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself in eager mode; traced, ``t`` computed once into a buffer of its own.

    Inductor inlines the arithmetic that makes a small tensor (the decode of
    the reduced statistics, the clip rule) into every kernel that reads it,
    and a CPU kernel then redoes it for each vector of gradient elements,
    several times where the optimizer's update reads the scaled gradient
    more than once (as the optimizer step compiled in the same graph does).
    A scatter is a buffer inductor cannot inline.
    """
    if not torch.compiler.is_compiling():
        return t
    flat = t.reshape(-1)
    where = (torch.arange(flat.numel(), device=flat.device),)
    return torch.zeros_like(flat).index_put_(where, flat).view(t.shape)


def multiply_group(
    tensors: list[torch.Tensor],
    out: list[torch.Tensor],
    group: list[torch.Tensor],
    idx: list[int],
    factor: torch.Tensor | list[torch.Tensor],
    keep: torch.Tensor | None,
    *,
    inplace: bool,
) -> None:
    """Multiplies one (device, dtype) group of ``tensors`` by ``factor``, writing the results into ``out``.

    ``factor`` is one 0-dim tensor for the whole group, or one per tensor
    (``_foreach_mul`` takes either). Where ``keep`` is ``False`` every
    result is zero. In place, ``out`` already holds the tensors themselves.
    """
    drop = None if keep is None else own_buffer(~keep.to(group[0].device))
    if inplace:
        torch._foreach_mul_(group, factor)
        if drop is not None:
            for t in group:
                t.masked_fill_(drop, 0.0)
        return
    for i, t in zip(idx, torch._foreach_mul(group, factor)):
        if drop is not None:
            # In place even for the pure API: the products are this call's
            # own tensors, and a torch.where would allocate (and on CPU,
            # page-fault in) a second copy of every gradient.
            t.masked_fill_(drop, 0.0)
        # A 0-dim grad times the 0-dim fp32 coefficient promotes to fp32.
        out[i] = t if t.dtype == tensors[i].dtype else t.to(tensors[i].dtype)


def _by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]]:
    """The tensors of each (device, dtype) and their positions in ``tensors``."""
    if tensors and not torch.compiler.is_compiling():
        if len({t.dtype for t in tensors}) == 1:
            # The common case. Callers pass the leaves of one rank, on one device (flatten_grads checks).
            return {(tensors[0].device, tensors[0].dtype): (tensors, list(range(len(tensors))))}
        grouped = torch_compat.group_natively(tensors)
        if grouped is not None:
            return grouped
    buckets: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = defaultdict(
        lambda: ([], [])
    )
    for i, t in enumerate(tensors):
        group, idx = buckets[(t.device, t.dtype)]
        group.append(t)
        idx.append(i)
    return buckets
