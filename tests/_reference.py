"""The float64 reference, computed the obvious way: flatten everything, one vector norm."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def reference_norm(full_tensors: Iterable[torch.Tensor], norm_type: float) -> float:
    """Norm of the concatenation of ``full_tensors`` in float64 (0 for no elements).

    ``norm_type=0`` counts the non-zero elements.
    """
    flat = [t.detach().to(torch.float64).reshape(-1).cpu() for t in full_tensors]
    flat = [t for t in flat if t.numel()]
    if not flat:
        return 0.0
    v = torch.cat(flat)
    if norm_type == 0:
        return float((v != 0).sum())
    return float(torch.linalg.vector_norm(v, norm_type))


def reference_coefficient(total: float, max_norm: float, eps: float = 1e-6) -> float:
    """The clip coefficient the reference applies."""
    return min(max_norm / (total + eps), 1.0) if math.isfinite(total) else 0.0


def assert_close_rel(actual: float, expected: float, rel: float, what: str = "norm") -> None:
    """Asserts ``|actual - expected| <= rel * |expected|`` (exact for 0 and infinities)."""
    if math.isinf(expected) or expected == 0:
        assert actual == expected, f"{what}: got {actual}, expected {expected}"
        return
    err = abs(actual - expected) / abs(expected)
    assert err <= rel, f"{what}: got {actual!r}, expected {expected!r} (relative error {err:.3g} > {rel:g})"
