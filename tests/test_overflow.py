"""Overflow and precision: finite grads keep a finite norm; low-precision grads keep fp32 accuracy."""

from __future__ import annotations

import math

import pytest
import torch

from ppclip_func import clip_grad_norm, global_grad_norm
from tests._reference import assert_close_rel, reference_norm


def test_fp32_grads_of_1e20_have_a_finite_norm_with_overflow_safe():
    # 10**3 elements of 1e20: sum of squares 1e43 overflows fp32 (3.4e38), the norm 3.2e21 does not.
    grads = {"w": torch.full((1000,), 1e20), "b": torch.full((10,), -1e20)}
    expected = reference_norm(grads.values(), 2.0)
    assert math.isfinite(expected) and expected < torch.finfo(torch.float32).max

    params = [torch.zeros_like(g, requires_grad=True) for g in grads.values()]
    for p, g in zip(params, grads.values()):
        p.grad = g.clone()
    assert math.isinf(float(torch.nn.utils.clip_grad_norm_(params, 1.0))), "torch overflows here"
    assert all(torch.equal(p.grad, torch.zeros_like(p.grad)) for p in params), "...and zeroes every grad"
    assert math.isinf(float(global_grad_norm(grads, None))), "the default (fp32 accumulation) matches torch"

    clipped, total = clip_grad_norm(grads, None, 1.0, overflow_safe=True)
    assert total.dtype == torch.float64
    assert_close_rel(float(total), expected, 1e-6)
    out_norm = reference_norm(clipped.values(), 2.0)
    assert out_norm == pytest.approx(1.0, rel=1e-5), "clipped to max_norm, not zeroed"


@pytest.mark.parametrize("norm_type", [1.0, 3.5, math.inf])
def test_overflow_safe_other_norm_types(norm_type):
    grads = [torch.full((4096,), 3e19), torch.full((3,), -2e19)]
    expected = reference_norm(grads, norm_type)
    assert_close_rel(float(global_grad_norm(grads, None, norm_type, overflow_safe=True)), expected, 1e-6)


@pytest.mark.slow
def test_1e8_bf16_elements_within_1e5_of_float64():
    """The documented bound: 10^8 bf16 grads, 2-norm within 1e-5 relative of float64.

    A bf16 accumulator would be off by orders of magnitude here (it stops
    growing once a term is below half an ulp of the running sum).
    """
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(25_000_000, generator=g).to(torch.bfloat16) for _ in range(4)]
    for norm_type in (2.0, 1.0):
        got = float(global_grad_norm(leaves, None, norm_type))
        assert_close_rel(got, reference_norm(leaves, norm_type), 1e-5)
