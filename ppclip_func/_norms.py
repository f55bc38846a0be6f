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


@dataclasses.dataclass(frozen=True)
class NormKind:
    """How one ``norm_type`` is computed and combined.

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
    if math.isnan(p) or p < 0:
        raise ValueError(f"norm_type must be p > 0, 0, inf or -inf, got {norm_type!r}")
    return NormKind(p, "sum")
