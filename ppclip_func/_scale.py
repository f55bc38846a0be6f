"""Scaling: the clip coefficient and its branch-free application to every shard."""

from __future__ import annotations

from collections import defaultdict

import torch

__all__: list[str] = []


def clip_coefficient(max_norm: float | torch.Tensor, total_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """Returns ``min(max_norm / (total_norm + eps), 1)`` as a 0-dim tensor.

    Clamping instead of ``if total_norm > max_norm`` keeps the decision on
    the device: a Python ``if`` on a tensor would need a device-to-host sync
    every step, and a graph break under ``torch.compile``.
    """
    return torch.clamp(max_norm / (total_norm + eps), max=1.0)


def scale(tensors: list[torch.Tensor], coef: torch.Tensor, *, inplace: bool) -> list[torch.Tensor]:
    """Multiplies every tensor by ``coef``, one foreach call per (device, dtype).

    Returns the scaled tensors in input order (the inputs themselves when
    ``inplace``). The result keeps each tensor's dtype: the product is
    computed in the higher precision of the pair and rounded once.
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        buckets[(t.device, t.dtype)].append(i)
    out: list[torch.Tensor] = list(tensors)
    for (device, _), idx in buckets.items():
        group = [tensors[i] for i in idx]
        c = coef.to(device)
        if inplace:
            torch._foreach_mul_(group, c)
        else:
            for i, t in zip(idx, torch._foreach_mul(group, c)):
                # A 0-dim grad times the 0-dim fp32 coefficient promotes to fp32.
                out[i] = t if t.dtype == tensors[i].dtype else t.to(tensors[i].dtype)
    return out
