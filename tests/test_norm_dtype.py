"""The norm's dtype: float64 on every rank, so a float64 model gets torch's answer and every rank the same bits.

The statistics cross ranks as float64 and the norm is returned as float64,
whatever this rank's leaves are: a stage that holds a float64 leaf and one
that does not return the same norm, and scale a leaf of a given dtype by the
same coefficient (``tests/test_exact_ranks.py`` checks it on real ranks). A
float64 model thus gets torch's finite norm where torch's is finite (2e200
gradients, ``p=1`` and ``inf``), to float64 precision; the coefficient of
fp32, bf16 and fp16 leaves is computed in float32 from that norm, as before.
"""

from __future__ import annotations

import math

import pytest
import torch

from ppclip_func import clip_grad_norm, clip_grad_norm_, clip_grads_with_norm, global_grad_norm
from tests._reference import assert_close_rel, reference_norm

NORM_TYPES = [2.0, 1.0, 3.5, 0.0, math.inf, -math.inf]


def _torch_clip(grads: list[torch.Tensor], max_norm: float, norm_type: float) -> tuple[torch.Tensor, list]:
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, foreach=True)
    return total, [p.grad for p in params]


@pytest.mark.parametrize("norm_type", [1.0, math.inf])
def test_a_float64_model_with_2e200_gradients_gets_torchs_finite_norm(norm_type):
    grads = [torch.full((10,), 2e200, dtype=torch.float64)]
    torch_total, torch_clipped = _torch_clip(grads, 1.0, norm_type)
    assert math.isfinite(float(torch_total)), "torch's norm is finite here"

    total = global_grad_norm(grads, None, norm_type)
    assert total.dtype == torch.float64
    assert_close_rel(float(total), float(torch_total), 1e-15)
    clipped, total_ = clip_grad_norm(grads, None, 1.0, norm_type, nonfinite="propagate")
    assert torch.equal(total_, total)
    assert bool((clipped[0] != 0).all()), "scaled by 1/norm, not by 0"
    torch.testing.assert_close(clipped[0], torch_clipped[0], rtol=1e-15, atol=0.0)


@pytest.mark.parametrize("norm_type", [2.0, 3.5])
def test_a_float64_norm_that_overflows_float64_is_inf_as_in_torch(norm_type):
    grads = [torch.full((10,), 2e200, dtype=torch.float64)]
    torch_total, _ = _torch_clip(grads, 1.0, norm_type)
    assert math.isinf(float(torch_total))
    assert math.isinf(float(global_grad_norm(grads, None, norm_type)))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_float64_grads_are_measured_to_float64_precision(norm_type):
    g = torch.Generator().manual_seed(0)
    grads = [torch.rand(n, generator=g, dtype=torch.float64) * 10 for n in (3, 5000, 70_001)]
    expected = reference_norm(grads, norm_type)
    total = global_grad_norm(grads, None, norm_type)
    assert total.dtype == torch.float64
    assert_close_rel(float(total), expected, 1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_norm_is_float64_whatever_the_leaves(dtype):
    # What a stage returns must not depend on the leaves it holds: another stage holds others.
    total = global_grad_norm([torch.ones(4, dtype=dtype)], None)
    assert total.dtype == torch.float64 and float(total) == 2.0
    assert global_grad_norm([], None).dtype == torch.float64
    _, groups = global_grad_norm({"a": torch.ones(4, dtype=dtype)}, None, groups={"a": "a", "b": "b"})
    assert all(n.dtype == torch.float64 for n in groups.values())


def test_a_float64_leaf_changes_neither_the_norm_dtype_nor_the_fp32_coefficient():
    """Two stages: one holds an fp32 leaf and a float64 leaf, the other the same fp32 leaf only.

    Given the same reduced norm, both scale the fp32 leaf by the same
    coefficient, bit for bit: it is computed from the shared float64 norm,
    not from anything this stage holds.
    """
    w = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    b = torch.randn(7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    total = global_grad_norm([w, b], None)
    with_b = clip_grads_with_norm([w, b], 0.5, total)
    without_b = clip_grads_with_norm([w], 0.5, total)
    assert torch.equal(with_b[0], without_b[0])
    assert with_b[0].dtype == torch.float32 and with_b[1].dtype == torch.float64


def test_the_fp32_coefficient_is_computed_in_float32_from_the_norm():
    # The scale of fp32/bf16/fp16 leaves is what it was with a float32 norm: fp32 arithmetic on the
    # norm rounded to float32 (a compiled fp32 step keeps its float32 coefficient).
    w = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    total = global_grad_norm([w], None)
    coef32 = torch.clamp(0.5 / (total.to(torch.float32) + 1e-6), max=1.0)
    assert torch.equal(clip_grads_with_norm([w], 0.5, total)[0], w * coef32)


def test_mixed_fp32_and_fp64_trees_scale_each_leaf_like_torch():
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(100, generator=g), torch.randn(50, generator=g, dtype=torch.float64)]
    torch_total, torch_clipped = _torch_clip(grads, 0.1, 2.0)
    params = [torch.zeros_like(x, requires_grad=True) for x in grads]
    for p, x in zip(params, grads):
        p.grad = x.clone()
    total = clip_grad_norm_(params, None, 0.1)
    assert_close_rel(float(total), float(torch_total), 1e-7)
    torch.testing.assert_close(params[0].grad, torch_clipped[0], rtol=2e-7, atol=0.0)
    torch.testing.assert_close(params[1].grad, torch_clipped[1], rtol=1e-7, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_where_the_multiply_is_fast_only_in_the_grads_dtype_bf16_takes_the_rounded_factor(monkeypatch, dtype):
    # CUDA's _foreach_mul_ has no fast kernel for bf16 tensors times a float32 factor (ppclip_func._core.scale):
    # there, eagerly, the factor is rounded to the grads' dtype, as torch's clip does. Run here on the CPU.
    import ppclip_func._core.scale as scale_module

    torch.manual_seed(0)
    grads = [torch.randn(300, dtype=torch.float32).to(dtype) for _ in range(3)]
    monkeypatch.setattr(scale_module, "SAME_DTYPE_FACTOR", frozenset({"cpu"}))
    clipped, total = clip_grad_norm(grads, None, 0.3)
    factor = torch.clamp(0.3 / (total.float() + 1e-6), max=1.0)  # the float32 coefficient, as the clip makes it
    for c, g in zip(clipped, grads, strict=True):
        assert c.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(c, g * factor.to(dtype)), "one multiply by the factor in bf16"
        else:  # fp16 keeps the float32 factor (a small one would round to 0 in fp16); fp32 has it already
            assert torch.equal(c, (g.float() * factor).to(dtype))
        exact = g.double() * 0.3 / float(total)
        tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}[dtype]
        atol = 6e-8 if dtype == torch.float16 else 0.0  # fp16's subnormals: an absolute step of 6e-8
        torch.testing.assert_close(c.double(), exact, rtol=tol, atol=atol)
    monkeypatch.setattr(scale_module, "SAME_DTYPE_FACTOR", frozenset())
    clipped, _ = clip_grad_norm(grads, None, 0.3)
    for c, g in zip(clipped, grads, strict=True):
        assert torch.equal(c, (g.float() * factor).to(dtype)), "elsewhere: the float32 product, rounded once"
