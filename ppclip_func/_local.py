"""Local statistics: one rank's weighted contribution to each norm, before any collective.

The heavy work is one ``torch._foreach_norm`` per (device, dtype) bucket of
local shards, accumulating in float32 at least (float64 for float64 grads),
so bf16/fp16 gradients keep fp32 precision. Per-leaf norms are then raised to
the p-th power, weighted and summed in float64: that part touches one scalar
per leaf and costs nothing next to reading the gradients.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ._norms import NormKind

__all__: list[str] = []

STAT_DTYPE = torch.float64


def leaf_norms(tensors: list[torch.Tensor], kind: NormKind, *, overflow_safe: bool = False) -> list[torch.Tensor]:
    """Returns ``vector_norm(t, kind.p)`` of each tensor, 0-dim, in fp32 or fp64.

    Tensors are grouped by device and dtype so each group is one foreach call.
    With ``overflow_safe``, every leaf accumulates in float64: an fp32 leaf
    whose sum of squares passes 3.4e38 (elements around 1e19 and up) then
    still has a finite norm. It is off by default because torch's eager
    float64 accumulation is much slower than float32 on CPU (see the README).
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        buckets[(t.device, t.dtype)].append(i)
    norms: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for (_, dtype), idx in buckets.items():
        acc = torch.float64 if overflow_safe else torch.promote_types(dtype, torch.float32)
        for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx], kind.p, dtype=acc)):
            norms[i] = n
    return norms


def local_statistics(
    tensors: list[torch.Tensor],
    weights: list[float],
    groups: list[int],
    n_groups: int,
    kind: NormKind,
    device: torch.device,
    *,
    overflow_safe: bool = False,
) -> torch.Tensor:
    """Returns this rank's contribution to every group's norm, ready to all-reduce.

    Args:
        tensors: Local shards, one per gradient leaf.
        weights: ``1 / copies`` of each leaf (used by sum-type norms only).
        groups: The group index of each leaf, in ``range(n_groups)``.
        n_groups: Number of groups.
        kind: The norm being computed.
        device: Where the statistics live (the grads' device).
        overflow_safe: Accumulate every leaf in float64 (see :func:`leaf_norms`).

    Returns:
        A float64 vector. For sum and max norms it has ``n_groups`` entries.
        For ``-inf`` it has ``2 * n_groups``: the minima, then ``-1`` where
        this rank holds an element of the group (``0`` where not), so that a
        single ``min`` all-reduce also says whether a group is empty everywhere.
    """
    width = 2 * n_groups if kind.op == "min" else n_groups
    out = torch.full((width,), kind.identity, dtype=STAT_DTYPE, device=device)
    if kind.op == "min":
        out[n_groups:] = 0.0
    live = [i for i, t in enumerate(tensors) if t.numel() > 0]
    norms = leaf_norms([tensors[i] for i in live], kind, overflow_safe=overflow_safe)

    # Bucket leaves by (group, weight): one stack and one reduction per bucket.
    buckets: dict[tuple[int, float], list[torch.Tensor]] = defaultdict(list)
    for i, n in zip(live, norms):
        weight = weights[i] if kind.op == "sum" else 1.0
        buckets[(groups[i], weight)].append(n)
    per_group: dict[int, list[torch.Tensor]] = defaultdict(list)
    for (g, weight), ns in buckets.items():
        stats = kind.power(torch.stack(ns).to(STAT_DTYPE))
        if kind.op == "sum":
            per_group[g].append(stats.sum() * weight)
        elif kind.op == "max":
            per_group[g].append(stats.max())
        else:
            per_group[g].append(stats.min())
    for g, parts in per_group.items():
        stacked = torch.stack(parts)
        if kind.op == "sum":
            out[g] = stacked.sum()
        elif kind.op == "max":
            out[g] = stacked.max()
        else:
            out[g] = stacked.min()
            out[n_groups + g] = -1.0
    return out
