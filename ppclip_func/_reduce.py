"""The one collective: all local statistics of a clip cross ranks in a single all-reduce.

Every rank of the world mesh calls :func:`all_reduce_statistics` exactly once
per clip, with a float64 vector of the same length on every rank (its length
depends only on the number of groups and the norm type, never on what this
rank holds), so a rank whose pipeline stage has no gradient still joins and
no rank waits on a collective another rank skipped.

It is ``torch.distributed._functional_collectives.all_reduce`` over the
process group that spans the world mesh:

* in eager mode it launches the collective and returns an
  ``AsyncCollectiveTensor``; the first op that reads the result waits for it,
  so the clip never blocks the host on the network by itself;
* under ``torch.compile`` it traces to one ``_c10d_functional.all_reduce`` and
  one ``_c10d_functional.wait_tensor`` node, with no graph break, and the
  group appears in the graph only by name (the world group's name is the same
  on every rank, so every rank traces the same graph).

The reduced vector is identical, bit for bit, on every rank: all-reduce
delivers one result to all participants, and everything computed from it
afterwards is the same arithmetic on the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate

__all__: list[str] = []


def all_reduce_statistics(stats: torch.Tensor, op: str, group_name: str | None) -> torch.Tensor:
    """Combines every rank's statistics with ``op`` (``"sum"``, ``"max"`` or ``"min"``).

    With ``group_name=None`` (nothing distributed) the statistics are returned
    as they are and no collective is issued.
    """
    if group_name is None:
        return stats
    return funcol.all_reduce(stats, op, group_name)


def reduce_partial(leaf: DTensor) -> DTensor:
    """Returns ``leaf`` with each ``Partial`` mesh dim reduced to ``Replicate``.

    This is the one documented exception to the single collective: a
    ``Partial`` DTensor's local values are addends, not elements, so its norm
    needs the reduced values. It costs one all-reduce of the leaf per
    ``Partial`` dim (DTensor's own ``redistribute``), issued before the
    statistics collective, and only when the caller asks for it with
    ``partial="reduce"``.

    Raises:
        ValueError: A ``Partial`` reduce op other than ``sum`` or ``avg``
            (a ``max``/``min`` partial has no norm-preserving reduction here);
            the message reads on after the leaf's name.
    """
    placements = tuple(leaf.placements)
    for p in placements:
        if p.is_partial() and p.reduce_op not in ("sum", "avg"):
            raise ValueError(
                f"has placement {p}; only Partial('sum') and Partial('avg') grads can be reduced for a norm"
            )
    return leaf.redistribute(leaf.device_mesh, [Replicate() if p.is_partial() else p for p in placements])
