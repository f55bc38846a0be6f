"""Non-finite norms: propagate like torch, zero the step branch-free, or raise — never a silent mess."""

from __future__ import annotations

import math

import pytest
import torch

from ppclip_func import clip_grad_norm, clip_grad_norm_, clip_grads_with_norm

BAD_VALUES = [math.inf, -math.inf, math.nan]


def _grads(bad: float | None):
    g = {"w": torch.randn(5, 4), "b": torch.randn(4), "none": None}
    if bad is not None:
        g["b"][2] = bad
    return g


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_propagate_matches_torch(bad):
    grads = _grads(bad)
    clipped, total = clip_grad_norm(grads, None, 1.0)
    params = [torch.zeros_like(grads[k], requires_grad=True) for k in ("w", "b")]
    for p, k in zip(params, ("w", "b")):
        p.grad = grads[k].clone()
    torch_total = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert not math.isfinite(float(total))
    assert math.isnan(float(total)) == math.isnan(float(torch_total))
    for p, k in zip(params, ("w", "b")):
        torch.testing.assert_close(clipped[k], p.grad, equal_nan=True)


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_zero_returns_all_zero_grads_and_reports_the_norm(bad, norm_type):
    grads = _grads(bad)
    clipped, total = clip_grad_norm(grads, None, 1.0, norm_type, nonfinite="zero")
    assert not math.isfinite(float(total)), "the returned norm still says what happened"
    for k in ("w", "b"):
        assert torch.equal(clipped[k], torch.zeros_like(grads[k])), k
    assert clipped["none"] is None
    # In place: the same, on p.grad.
    params = [torch.zeros_like(grads[k], requires_grad=True) for k in ("w", "b")]
    for p, k in zip(params, ("w", "b")):
        p.grad = grads[k].clone()
    total_ = clip_grad_norm_(params, None, 1.0, norm_type, nonfinite="zero")
    assert torch.equal(total_, total) or (math.isnan(float(total_)) and math.isnan(float(total)))
    for p in params:
        assert torch.equal(p.grad, torch.zeros_like(p.grad))


def test_zero_leaves_finite_grads_clipped_as_usual():
    grads = _grads(None)
    a, ta = clip_grad_norm(grads, None, 0.5, nonfinite="zero")
    b, tb = clip_grad_norm(grads, None, 0.5)
    assert torch.equal(ta, tb)
    for k in ("w", "b"):
        assert torch.equal(a[k], b[k])
    assert float(torch.linalg.vector_norm(torch.cat([a["w"].flatten(), a["b"]]))) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_error_raises_with_the_value_and_norm_type_and_scales_nothing(bad):
    grads = _grads(bad)
    before = {k: v.clone() for k, v in grads.items() if v is not None}
    with pytest.raises(RuntimeError, match=r"non-finite \((inf|nan)\S*, norm_type=2\.0\)"):
        clip_grad_norm(grads, None, 1.0, nonfinite="error")
    params = [torch.zeros_like(grads[k], requires_grad=True) for k in ("w", "b")]
    for p, k in zip(params, ("w", "b")):
        p.grad = grads[k].clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, None, 1.0, nonfinite="error")
    for p, k in zip(params, ("w", "b")):
        torch.testing.assert_close(p.grad, before[k], equal_nan=True)


def test_error_passes_finite_norms():
    _, total = clip_grad_norm(_grads(None), None, 1e9, nonfinite="error")
    assert math.isfinite(float(total))


def test_clip_grads_with_norm_applies_the_policy_to_the_given_norm():
    grads = [torch.ones(3)]
    assert torch.equal(clip_grads_with_norm(grads, 1.0, torch.tensor(math.inf), nonfinite="zero")[0], torch.zeros(3))
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grads_with_norm(grads, 1.0, torch.tensor(math.nan), nonfinite="error")


def test_unknown_policy_is_a_value_error():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        clip_grad_norm(_grads(None), None, 1.0, nonfinite="skip")


def test_error_policy_fails_at_trace_time_under_compile():
    step = torch.compile(lambda g: clip_grad_norm(g, None, 1.0, nonfinite="error"), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"use nonfinite='zero' under torch\.compile"):
        step(_grads(None))


def test_zero_policy_compiles_without_a_graph_break():
    torch._dynamo.reset()
    step = torch.compile(lambda g: clip_grad_norm(g, None, 1.0, nonfinite="zero"), fullgraph=True, backend="eager")
    clipped, total = step(_grads(math.inf))
    assert math.isinf(float(total)) and torch.equal(clipped["w"], torch.zeros(5, 4))
    clipped, total = step(_grads(None))
    assert math.isfinite(float(total)) and float(clipped["w"].abs().max()) > 0


# --- nonfinite="abort": a stop that needs no host read, eager or compiled ------------------------

ABORTED = r"non-finite \(nonfinite='abort'\)"


def _seeded_grads(bad: float | None) -> dict:
    torch.manual_seed(0)
    return _grads(bad)


def _params(bad: float | None) -> list[torch.nn.Parameter]:
    grads = _seeded_grads(bad)
    params = [torch.nn.Parameter(torch.zeros_like(grads[k])) for k in ("w", "b")]
    for p, k in zip(params, ("w", "b")):
        p.grad = grads[k]
    return params


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_abort_raises_on_cpu_with_every_gradient_unscaled(bad, norm_type):
    params = _params(bad)
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match=ABORTED):
        clip_grad_norm_(params, None, 1.0, norm_type, nonfinite="abort")
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b, equal_nan=True, rtol=0.0, atol=0.0)
    with pytest.raises(RuntimeError, match=ABORTED):
        clip_grad_norm(_grads(bad), None, 1.0, norm_type, nonfinite="abort")
    with pytest.raises(RuntimeError, match=ABORTED):
        clip_grads_with_norm([torch.ones(3)], 1.0, torch.tensor(bad), nonfinite="abort")


def test_abort_on_a_finite_norm_is_propagate_bit_for_bit_and_reads_nothing_on_the_host():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    want, total = clip_grad_norm(_seeded_grads(None), None, 0.5)
    grads = _seeded_grads(None)
    with Ops() as ops:
        got, total_ = clip_grad_norm(grads, None, 0.5, nonfinite="abort")
    assert torch.equal(total_, total) and torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    assert "aten::_assert_async.msg" in ops.names
    assert not {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"} & set(ops.names), ops.names


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_abort_compiles_into_one_graph_that_stops_on_a_nonfinite_norm(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    params = _params(None)
    step = torch.compile(lambda: clip_grad_norm_(params, None, 1.0, nonfinite="abort"), backend=counter, fullgraph=True)
    want = _params(None)
    want_total = clip_grad_norm_(want, None, 1.0)
    total = step()
    assert_close = torch.testing.assert_close
    assert_close(total, want_total, rtol=1e-6, atol=0.0)
    for p, q in zip(params, want):
        assert_close(p.grad, q.grad, rtol=1e-6, atol=0.0)

    for bad in BAD_VALUES:
        for p, g in zip(params, _params(bad)):
            p.grad = g.grad
        with pytest.raises(RuntimeError, match=ABORTED):
            step()
    assert counter.frame_count == 1, "one graph, no graph break, no recompile"
    assert any(n.target is torch._assert_async for n in counter.graphs[0].graph.nodes)
