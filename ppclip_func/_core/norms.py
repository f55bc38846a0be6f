"""Norm types as reductions: what each rank computes locally, how ranks combine.

A p-norm over many shards is not a norm of norms but a root of a sum of p-th
powers, so every stage of the pipeline works on powers and the root is taken
once, after the collective:

=========  =============================  ==========  ========
norm_type  per-leaf statistic             combine     finish
=========  =============================  ==========  ========
p > 0      ``sum(|x|^p)``                 weighted +  ``^(1/p)``
0          number of non-zero elements    weighted +  none
inf        ``max(|x|)``                   max         none
-inf       ``min(|x|)``                   min         none
=========  =============================  ==========  ========

``norm_type=0`` is the number of non-zero gradient elements of the whole
model. (``torch.nn.utils.clip_grad_norm_`` instead counts the *leaves* whose
norm is non-zero, since it takes a norm of per-leaf norms.)
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__: list[str] = []


# What a rank knows about one group before the collective, as a level that the
# all-reduce combines with the same op as the statistics themselves.
ABSENT, HAS_LEAF, HAS_ELEMENT, HAS_NAN = 0.0, 1.0, 2.0, 3.0


@dataclasses.dataclass(frozen=True)
class NormKind:
    """How one ``norm_type`` is computed, combined across ranks and finished.

    Every per-norm-type decision lives here: the local combine, what crosses
    ranks, and how the reduced vector becomes norms.

    What crosses ranks, for ``n`` groups, is ``2 * n`` float64 values: each
    group's statistic, then each group's level (``ABSENT`` < ``HAS_LEAF`` <
    ``HAS_ELEMENT`` < ``HAS_NAN``), combined with the same op. The levels
    say, after one collective, whether any rank held a leaf of the group (a
    group that matches no leaf anywhere reports NaN rather than a norm of 0),
    whether any rank held an element (the ``-inf`` norm of nothing is 0), and
    whether any rank saw a NaN. The last matters for ``max``/``min``: an
    all-reduce max or min (gloo's, NCCL's fmax-style ones) drops a NaN unless
    it comes first, so a NaN is sent as a level and the statistic as ``±inf``.

    Attributes:
        p: The norm order as a float.
        op: The cross-rank combine: ``"sum"``, ``"max"`` or ``"min"``.
    """

    p: float
    op: str

    @property
    def identity(self) -> float:
        """The combine's neutral value: what a rank with no elements contributes."""
        return math.inf if self.op == "min" else 0.0

    def power(self, leaf_norms: torch.Tensor) -> torch.Tensor:
        """Maps per-leaf norms (as ``torch.linalg.vector_norm`` gives them) to summable statistics."""
        if self.op == "sum" and self.p not in (0.0, 1.0):
            return leaf_norms.pow(self.p)
        return leaf_norms

    def root(self, total: torch.Tensor) -> torch.Tensor:
        """Maps a combined statistic back to a norm."""
        if self.op == "sum" and self.p not in (0.0, 1.0):
            return total.pow(1.0 / self.p)
        return total

    def combine(self, stats: torch.Tensor) -> torch.Tensor:
        """Combines a vector of statistics into one, locally; a NaN anywhere gives NaN."""
        if self.op == "sum":
            return stats.sum()
        return stats.amax() if self.op == "max" else stats.amin()

    def encode(self, stats: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """Returns this rank's ``2 * n`` values for the all-reduce: statistics, then signed levels.

        ``levels`` are ``ABSENT``/``HAS_LEAF``/``HAS_ELEMENT`` per group; a
        NaN statistic raises its group's level to ``HAS_NAN``.
        """
        if self.op == "sum":  # a sum carries a NaN by itself: the levels need not say it
            return torch.cat([stats, levels])
        nan = torch.isnan(stats)
        levels = torch.where(nan, HAS_NAN, levels)
        # The all-reduce would drop the NaN: carry it in the level.
        stats = torch.where(nan, math.inf if self.op == "max" else -math.inf, stats)
        return torch.cat([stats, -levels if self.op == "min" else levels])

    def poison(self, n_groups: int, device: torch.device) -> torch.Tensor:
        """What a rank that cannot compute its statistics sends: every group's norm becomes NaN on every rank."""
        nan = torch.full((n_groups,), math.nan, dtype=torch.float64, device=device)
        return self.encode(nan, torch.full_like(nan, HAS_NAN))

    def decode(
        self, reduced: torch.Tensor, per_group: bool = True, n_total: int | None = None, n: int | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Returns ``(per-entry norms, total norm)`` from the all-reduced vector, in float64.

        The total covers the first ``n_total`` entries (default: all), the
        groups; entries after them (per-parameter ones) are norms of their
        own, not part of the total. An entry that no rank holds a leaf of
        gets NaN; a NaN on any rank makes its entry's norm and, within the
        first ``n_total``, the total NaN. With ``per_group=False`` the first
        is ``None`` and a sum-type total costs two ops (the eager clip of
        many small leaves feels each one). ``n`` is the number of entries
        (default: half the vector); values after the ``2 * n`` (the adaptive
        state's fingerprint) are not read.
        """
        n = reduced.numel() // 2 if n is None else n
        k = n if n_total is None else n_total
        if self.op == "sum" and not per_group:
            return None, self.root(reduced[0] if k == 1 else reduced[:k].sum())
        stats, levels = reduced[:n], reduced[n : 2 * n].abs()
        nan = torch.full_like(stats, math.nan)
        if self.op == "sum":  # sums carry NaN by themselves; a level sum > 0 means some rank had a leaf
            norms = torch.where(levels > 0, self.root(stats), nan)
            return norms, self.root(stats[:k].sum())
        seen_nan = levels >= HAS_NAN
        if self.op == "max":
            values, total = stats, stats[:k].amax()
        else:  # the -inf norm of no element is 0, as for an empty tensor
            has_element = levels >= HAS_ELEMENT
            values = torch.where(has_element, stats, 0.0)
            total = torch.where(has_element[:k].any(), stats[:k].amin(), 0.0)
        norms = torch.where(seen_nan, nan, torch.where(levels >= HAS_LEAF, values, nan))
        return norms, torch.where(seen_nan[:k].any(), math.nan, total)


def norm_kind(norm_type: float) -> NormKind:
    """Returns the :class:`NormKind` for ``norm_type``.

    Raises:
        TypeError: ``norm_type`` is not a real number.
        ValueError: ``norm_type`` is negative and finite, or NaN.
    """
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a real number (p > 0, 0, inf or -inf), got {norm_type!r}")
    p = float(norm_type)
    if p == math.inf:
        return NormKind(p, "max")
    if p == -math.inf:
        return NormKind(p, "min")
    if not p >= 0:  # NaN too, and traceable: math.isnan fails on the symbolic float of dynamic=True
        raise ValueError(f"norm_type must be p > 0, 0, inf or -inf, got {norm_type!r}")
    return NormKind(p, "sum")
