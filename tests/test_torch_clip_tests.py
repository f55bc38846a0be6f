"""PyTorch's own clip_grad_norm_ tests, rewritten against ours with ``mesh=None``.

Source: pytorch/pytorch ``test/test_nn.py``, ``TestNNDeviceType``:
``test_clip_grad_norm`` (read at commit 74f2fa66feec00335f72813782f4802e80bff4cb)
and ``test_clip_grad_norm_error_if_nonfinite``, both parametrized over
``foreach``. They are rewritten here, not copied; where our documented
semantics differ on purpose, a comment says so:

* ``norm_type=0``: torch takes the 0-"norm" of the per-parameter norms (it
  counts parameters with a non-zero gradient), ours counts non-zero gradient
  elements (docs/api.md). Both are finite in every case here, which is all
  the non-finite test asks of them.
* Negative finite ``norm_type`` (torch's ``-0.1``, ``-1``, ``-2``, ``-3.5``):
  torch computes them; ours raises ``ValueError`` (docs/failure-modes.md); the test checks that instead.
* ``error_if_nonfinite=True`` is ``nonfinite="error"``, with our message.
* The exhausted-generator warning says the same thing in our words.
* ``foreach``: ours has one implementation; each case checks ours against
  torch's, with ``foreach=False`` and ``foreach=True``.

The error_if_nonfinite case table (which norm types give a non-finite norm
for which gradients) is cross-checked against torch's own clip in every case,
so the port cannot drift from what torch does. Its float64 2e200 cases are
what issue 19 item 1 fixed: ours returned ``inf`` for ``p=1`` and ``inf``
(a float32 norm) where torch's is finite.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from torch import nn

from ppclip_func import clip_grad_norm_, clip_grads_with_norm, global_grad_norm

FOREACH = [False, True]
INF = math.inf


# --- test_clip_grad_norm ---------------------------------------------------------------------


def _norm_of(params: list[torch.Tensor], norm_type: float) -> float:
    """The norm of the current gradients, computed the obvious way (torch's test: ``compute_norm``)."""
    grads = [p.grad.detach().double().abs().flatten() for p in params]
    if norm_type == INF:
        return float(max(g.max() for g in grads))
    return float(sum((g**norm_type).sum() for g in grads) ** (1.0 / norm_type))


def _linear_with_grads(weight_grad: torch.Tensor, bias_grad: torch.Tensor) -> list[nn.Parameter]:
    layer = nn.Linear(10, 10)
    layer.weight.grad = weight_grad.clone().view_as(layer.weight)
    layer.bias.grad = bias_grad.clone().view_as(layer.bias)
    return list(layer.parameters())


def _assert_uniform_scale(params: list[nn.Parameter], originals: list[torch.Tensor]) -> float:
    """Every element was multiplied by the same factor (torch's test: ``compare_scaling``); returns it."""
    scale = torch.cat([(p.grad / g).flatten() for p, g in zip(params, originals)])
    # torch's assertEqual(scale.std(), 0) at float32's default tolerance: products are rounded.
    assert float(scale.std()) == pytest.approx(0.0, abs=1e-5), "the gradients were not all scaled by one factor"
    return float(scale[0])


def _close(a: float, b: float) -> None:
    # torch's assertEqual defaults for float32 results.
    assert a == pytest.approx(b, rel=1.3e-6, abs=1e-5), (a, b)


def _clipped_in_place(
    grads: tuple[torch.Tensor, torch.Tensor], max_norm: float, norm_type: float
) -> tuple[list, float]:
    """Our in-place clip of a Linear holding ``grads``: its parameters, and the norm before, which the clip returned."""
    params = _linear_with_grads(*grads)
    before = _norm_of(params, norm_type)
    _close(float(clip_grad_norm_(params, None, max_norm, norm_type)), before)
    return params, before


@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize("norm_type", [0.5, 1.5, 2.0, 4.0, INF])
def test_clip_grad_norm(norm_type, foreach):
    max_norm = 2.0
    big = (torch.arange(1.0, 101).view(10, 10), torch.ones(10) / 1000)

    # In place, like torch.nn.utils.clip_grad_norm_: the norm before, then max_norm after.
    params, before = _clipped_in_place(big, max_norm, norm_type)
    _close(_norm_of(params, norm_type), max_norm)
    assert _norm_of(params, norm_type) <= before
    _assert_uniform_scale(params, list(big))
    reference = _linear_with_grads(*big)
    torch.nn.utils.clip_grad_norm_(reference, max_norm, norm_type, foreach=foreach)
    for p, q in zip(params, reference):
        torch.testing.assert_close(p.grad, q.grad)

    # The decomposed API (torch: get_total_norm, then clip_grads_with_norm_; ours is pure).
    params = _linear_with_grads(*big)
    before = _norm_of(params, norm_type)
    total = global_grad_norm([p.grad for p in params], None, norm_type)
    for p, g in zip(params, clip_grads_with_norm([p.grad for p in params], max_norm, total)):
        p.grad = g
    _close(float(total), before)
    _close(_norm_of(params, norm_type), max_norm)
    _assert_uniform_scale(params, list(big))

    # Small gradients are left unchanged.
    small = (torch.rand(10, 10, generator=torch.Generator().manual_seed(0)) / 10000, torch.ones(10) / 500)
    params, before = _clipped_in_place(small, max_norm, norm_type)
    _close(_norm_of(params, norm_type), before)
    assert _norm_of(params, norm_type) <= max_norm
    assert _assert_uniform_scale(params, list(small)) == 1.0

    # A single tensor is accepted, and clipped as a list of one.
    p1, p2 = nn.Parameter(torch.randn(10, 10)), nn.Parameter(torch.randn(10, 10))
    p1.grad = big[0].clone()
    p2.grad = big[0].clone()
    clip_grad_norm_(p1, None, max_norm, norm_type)
    clip_grad_norm_([p2], None, max_norm, norm_type)
    assert torch.equal(p1.grad, p2.grad)

    # An exhausted generator warns once (torch: "`parameters` is an empty generator, no gradient
    # clipping will occur."; ours says the same in its words).
    generator = nn.Linear(10, 10).parameters()
    for _ in generator:
        pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clip_grad_norm_(generator, None, max_norm, norm_type)
    assert len(caught) == 1
    assert "empty iterator" in str(caught[0].message) and "will be clipped" in str(caught[0].message)


# --- test_clip_grad_norm_error_if_nonfinite --------------------------------------------------

NORMS_POS = [0.1, 1.0, 2.0, 3.5, INF]
NORMS_NEG = [-0.1, -1.0, -2.0, -3.5]  # torch computes these; ours rejects them (module docstring)
NORMS_EXCEPT_0 = NORMS_POS + NORMS_NEG
NORMS_ALL = [*NORMS_EXCEPT_0, 0.0]

# (one element only?, a finite parameter first?, scalars, norms giving a non-finite total, finite ones)
CASES = [
    # an infinite gradient
    (False, False, [INF, -INF], NORMS_EXCEPT_0, [0.0]),
    (False, True, [INF, -INF], NORMS_POS, [*NORMS_NEG, 0.0]),
    (True, False, [INF, -INF], NORMS_POS, [*NORMS_NEG, 0.0]),
    (True, True, [INF, -INF], NORMS_POS, [*NORMS_NEG, 0.0]),
    # a NaN gradient
    (False, False, [math.nan], NORMS_EXCEPT_0, [0.0]),
    (False, True, [math.nan], NORMS_EXCEPT_0, [0.0]),
    (True, False, [math.nan], NORMS_EXCEPT_0, [0.0]),
    (True, True, [math.nan], NORMS_EXCEPT_0, [0.0]),
    # large but finite in every norm
    (False, False, [2e22, -2e22], [], NORMS_ALL),
    (False, True, [2e22, -2e22], [], NORMS_ALL),
    (True, False, [2e22, -2e22], [], NORMS_ALL),
    (True, True, [2e22, -2e22], [], NORMS_ALL),
    # float64 gradients that overflow for some norm orders only
    (False, False, [2e200, -2e200], [3.5, 2.0, -2.0, -3.5], [INF, 1.0, 0.1, 0.0, -1.0, -0.1]),
    (False, True, [2e200, -2e200], [3.5, 2.0], [*NORMS_NEG, INF, 1.0, 0.1, 0.0]),
    (True, False, [2e200, -2e200], [3.5, 2.0], [*NORMS_NEG, INF, 1.0, 0.1, 0.0]),
    (True, True, [2e200, -2e200], [3.5, 2.0], [-2.0, -3.5, INF, 1.0, 0.1, 0.0, -1.0, -0.1]),
]


def _float64_params(scalar: float, one_element: bool, finite_first: bool) -> list[nn.Parameter]:
    """torch's ``gen_parameters``: a float64 parameter of 10 whose gradient is ``scalar`` (everywhere,
    or at one element, 0 elsewhere), after an optional parameter with a gradient of 1."""
    param = nn.Parameter(torch.ones(10, dtype=torch.float64))
    (param[1] if one_element else param).mul(scalar).sum().backward()
    if not finite_first:
        return [param]
    first = nn.Parameter(torch.ones(1, dtype=torch.float64))
    first.mul(1).sum().backward()
    return [first, param]


def _cases() -> list[tuple]:
    out = []
    for one_element, finite_first, scalars, nonfinite, finite in CASES:
        for norm_type, scalar in itertools.product(nonfinite, scalars):
            out.append((norm_type, scalar, one_element, finite_first, True))
        for norm_type, scalar in itertools.product(finite, scalars):
            out.append((norm_type, scalar, one_element, finite_first, False))
    return out


@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize(("norm_type", "scalar", "one_element", "finite_first", "expect_nonfinite"), _cases())
def test_clip_grad_norm_error_if_nonfinite(norm_type, scalar, one_element, finite_first, expect_nonfinite, foreach):
    # The table agrees with torch itself.
    reference = _float64_params(scalar, one_element, finite_first)
    torch_total = torch.nn.utils.clip_grad_norm_(reference, 1.0, norm_type, foreach=foreach)
    assert math.isfinite(float(torch_total)) != expect_nonfinite, "the case table disagrees with torch"

    params = _float64_params(scalar, one_element, finite_first)
    before = [p.grad.clone() for p in params]
    if norm_type < 0:  # documented difference: only p > 0, 0, inf and -inf are norms here
        with pytest.raises(ValueError, match="norm_type must be"):
            clip_grad_norm_(params, None, 1.0, norm_type, nonfinite="error")
        return
    if expect_nonfinite:
        # error_if_nonfinite=True: raises, and no gradient changes.
        with pytest.raises(RuntimeError, match=rf"non-finite \(\S+, norm_type={norm_type}\)"):
            clip_grad_norm_(params, None, 1.0, norm_type, nonfinite="error")
        for p, b in zip(params, before):
            torch.testing.assert_close(p.grad, b, equal_nan=True, rtol=0.0, atol=0.0)
    else:
        total = clip_grad_norm_(params, None, 1.0, norm_type, nonfinite="error")
        assert math.isfinite(float(total))
        if norm_type != 0.0:  # documented difference: torch counts parameters, ours elements
            assert float(total) == pytest.approx(float(torch_total), rel=1e-12)
            for p, q in zip(params, reference):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0.0)
    # error_if_nonfinite=False (nonfinite="propagate"): never raises, norm as torch's.
    params = _float64_params(scalar, one_element, finite_first)
    total = clip_grad_norm_(params, None, 1.0, norm_type)
    assert math.isfinite(float(total)) != expect_nonfinite


# --- mixed dtypes --------------------------------------------------------------------------


@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize("norm_type", [0.5, 2.0, 4.0, INF])
def test_clip_grad_norm_of_float32_and_float64_parameters_together(norm_type, foreach):
    # torch's foreach path groups by dtype; its total is float64 here. Ours: float64 too, and each
    # leaf scaled by its own dtype's coefficient.
    g = torch.Generator().manual_seed(1)
    grads = [
        torch.randn(7, 3, generator=g),
        torch.randn(5, generator=g, dtype=torch.float64),
        torch.randn(4, generator=g),
    ]

    def params() -> list[nn.Parameter]:
        out = [nn.Parameter(torch.zeros_like(x)) for x in grads]
        for p, x in zip(out, grads):
            p.grad = x.clone()
        return out

    ours, theirs = params(), params()
    total = clip_grad_norm_(ours, None, 0.5, norm_type)
    torch_total = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type, foreach=foreach)
    assert total.dtype == torch_total.dtype == torch.float64
    assert float(total) == pytest.approx(float(torch_total), rel=1e-7)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-7, atol=0.0)
