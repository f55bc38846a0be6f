"""Local statistics: one rank's weighted contribution to each norm, before any collective.

The heavy work reads every local shard once, accumulating in float32 at least
(float64 for float64 grads, or for all grads with ``overflow_safe``), so
bf16/fp16 gradients keep fp32 precision. Small leaves go through one
``torch._foreach_norm`` per (device, dtype); a leaf larger than ``CHUNK``
elements is viewed as rows of ``CHUNK`` and reduced row-wise in one
``vector_norm`` call. Chunking is for accuracy: torch's CPU norm kernel
accumulates a whole tensor sequentially, which loses about 1e-3 relative on a
25M-element fp32 leaf; per-chunk sums of 4096 elements combined in float64
stay within about 1e-8 (fp32) and 5e-7 (bf16) there, at the same speed. The
per-chunk norms are raised to the p-th power, weighted and summed in
float64; that touches one scalar per 4096 elements and costs little next to
reading the gradients.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ._norms import ABSENT, HAS_ELEMENT, HAS_LEAF, NormKind

__all__: list[str] = []

STAT_DTYPE = torch.float64
CHUNK = 1 << 12


def leaf_norms(tensors: list[torch.Tensor], kind: NormKind, *, overflow_safe: bool = False) -> list[list[torch.Tensor]]:
    """Returns, for each tensor, the ``vector_norm``s of its chunks, in fp32 or fp64.

    Each tensor's chunks partition its elements, so its norm statistic is the
    sum (max, min) of its chunks' statistics. A dense tensor (contiguous up to
    a permutation of dims) of more than ``CHUNK`` elements is split into rows
    of ``CHUNK`` (one 1-D tensor of row norms) plus a remainder (a 0-dim
    norm); others (e.g. a strided slice) are one chunk, a 0-dim norm from a
    foreach call. With ``overflow_safe``, every leaf accumulates in
    float64: an fp32 leaf whose sum of squares passes 3.4e38 (elements around
    1e19 and up) then still has a finite norm. It is off by default because
    torch's eager float64 accumulation is much slower than float32 on CPU.
    """
    pieces: list[list[torch.Tensor]] = [[] for _ in tensors]
    whole: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for i, t in enumerate(tensors):
        if t.numel() > CHUNK:
            t = _dense_view(t)
            rows = t.numel() // CHUNK if t.is_contiguous() else 0
            if rows:
                flat = t.view(-1)
                body = flat[: rows * CHUNK].view(rows, CHUNK)
                acc = _acc_dtype(t.dtype, overflow_safe)
                pieces[i].append(torch.linalg.vector_norm(body, kind.p, dim=1, dtype=acc))
                t = flat[rows * CHUNK :]
                if t.numel() == 0:
                    continue
        whole[(t.device, t.dtype)].append((i, t))
    for (_, dtype), items in whole.items():
        norms = torch._foreach_norm([t for _, t in items], kind.p, dtype=_acc_dtype(dtype, overflow_safe))
        for (i, _), n in zip(items, norms):
            pieces[i].append(n)
    return pieces


def _dense_view(t: torch.Tensor) -> torch.Tensor:
    """Returns ``t`` with its dims permuted into memory order when that makes it contiguous.

    A norm does not depend on element order, so a transposed gradient is
    reduced in the order its storage holds it, and can be chunked too.
    """
    if t.is_contiguous() or t.dim() < 2:
        return t
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    u = t.permute(order)
    return u if u.is_contiguous() else t


def _acc_dtype(dtype: torch.dtype, overflow_safe: bool) -> torch.dtype:
    return torch.float64 if overflow_safe else torch.promote_types(dtype, torch.float32)


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
        A float64 vector of ``2 * n_groups`` values, as :meth:`NormKind.encode`
        lays them out: each group's statistic, then what this rank holds of it.
    """
    stats = torch.full((n_groups,), kind.identity, dtype=STAT_DTYPE, device=device)
    levels = [ABSENT] * n_groups  # static facts (shapes), known on the host
    for i, t in enumerate(tensors):
        levels[groups[i]] = max(levels[groups[i]], HAS_ELEMENT if t.numel() > 0 else HAS_LEAF)
    live = [i for i, t in enumerate(tensors) if t.numel() > 0]
    norms = leaf_norms([tensors[i] for i in live], kind, overflow_safe=overflow_safe)

    # Bucket chunk norms by (group, weight): one stack/cat and one reduction per bucket.
    buckets: dict[tuple[int, float], tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(lambda: ([], []))
    for i, pieces in zip(live, norms):
        weight = weights[i] if kind.op == "sum" else 1.0
        scalars, rows = buckets[(groups[i], weight)]
        for n in pieces:
            (rows if n.dim() else scalars).append(n)
    per_group: dict[int, list[torch.Tensor]] = defaultdict(list)
    for (g, weight), (scalars, rows) in buckets.items():
        parts = [r.to(STAT_DTYPE) for r in rows]
        if scalars:
            parts.append(torch.stack(scalars).to(STAT_DTYPE))
        combined = kind.combine(kind.power(parts[0] if len(parts) == 1 else torch.cat(parts)))
        per_group[g].append(combined * weight if kind.op == "sum" else combined)
    for g, parts in per_group.items():
        stats[g] = kind.combine(torch.stack(parts))
    return kind.encode(stats, torch.tensor(levels, dtype=STAT_DTYPE, device=device))
