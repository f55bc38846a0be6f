"""The clip handed to the optimizer: equal to clip-then-step, and a skipped step moves nothing.

Each case runs the same model twice from the same start: once with the
clip applied to the gradients and then the optimizer's step (the reference:
``clip_grad_norm_`` then ``step()``), once with the clip handed to the
optimizer (``clip_grad_norm_in_optimizer`` then the same ``step()``). torch's
fused kernels divide by ``1 / coefficient`` where the reference multiplies by
the coefficient, so the two agree within a rounding (1e-6 relative); the
fallback scales in place exactly as the reference, so it agrees bit for bit.
A skipped step leaves parameters, moments and step counts bitwise unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ppclip_func import (
    adaptive_clip_grad_norm_,
    adaptive_clip_grad_norm_in_optimizer,
    clip_grad_norm_,
    clip_grad_norm_in_optimizer,
    init_clip_state,
)
from tests._torchtitan import needs_torchtitan
from tests.test_compile_fake_pg import CaptureBackend, aten_ops

FUSED = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
}
FALLBACK = {
    "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "SGD-for-loop": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=False),
}
OPTIMIZERS = {**FUSED, **FALLBACK}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _set_grads(model: torch.nn.Module, step: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * scale


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        tensors += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return tensors


# Gradient scales per step: clipped (norm ~ 10-30), not clipped (norm ~ 0.1), clipped again.
SCALES = (3.0, 0.01, 1.0, 5.0)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_handed_over_clip_equals_clip_then_step(name):
    make = OPTIMIZERS[name]
    ref_model, model = _model(), _model()
    ref_opt, opt = make(list(ref_model.parameters())), make(list(model.parameters()))
    for step, s in enumerate(SCALES):
        _set_grads(ref_model, step, s)
        _set_grads(model, step, s)
        want = clip_grad_norm_(ref_model.parameters(), None, 1.0)
        ref_opt.step()
        got = clip_grad_norm_in_optimizer(opt, model.parameters(), None, 1.0)
        opt.step()
        assert torch.equal(got, want)
        for a, b in zip(_state(model, opt), _state(ref_model, ref_opt)):
            if name in FALLBACK:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_after_a_handed_over_one_is_plain(name):
    """Nothing stale outlives the step it was handed to: the next step, without a clip, is a plain step."""
    make = OPTIMIZERS[name]
    ref_model, model = _model(), _model()
    ref_opt, opt = make(list(ref_model.parameters())), make(list(model.parameters()))
    for m in (ref_model, model):
        _set_grads(m, 0, 3.0)
    clip_grad_norm_(ref_model.parameters(), None, 1.0)
    ref_opt.step()
    clip_grad_norm_in_optimizer(opt, model.parameters(), None, 1.0)
    opt.step()
    assert not {"grad_scale", "found_inf", "step", "_ppclip_handed"} & set(opt.__dict__)
    assert not opt._optimizer_step_post_hooks
    for m, o in ((ref_model, ref_opt), (model, opt)):
        _set_grads(m, 1, 3.0)  # large, and not clipped this time
        o.step()
    for a, b in zip(_state(model, opt), _state(ref_model, ref_opt)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_nonfinite_norm_skips_the_step_bit_for_bit(name):
    make = OPTIMIZERS[name]
    model = _model()
    opt = make(list(model.parameters()))
    _set_grads(model, 0, 1.0)
    clip_grad_norm_in_optimizer(opt, model.parameters(), None, 1.0, nonfinite="skip")
    opt.step()  # a real step first, so the moments and step counts are not all zero
    before = [t.clone() for t in _state(model, opt)]
    _set_grads(model, 1, 1.0)
    next(model.parameters()).grad[0, 0] = float("nan")
    norm = clip_grad_norm_in_optimizer(opt, model.parameters(), None, 1.0, nonfinite="skip")
    assert norm.isnan()
    opt.step()
    after = _state(model, opt)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert torch.equal(a, b)


def test_fused_hand_over_leaves_the_gradients_to_the_step():
    """The clip itself writes no gradient for a fused optimizer; torch's CPU kernel writes the clipped ones back."""
    model = _model()
    opt = FUSED["AdamW"](list(model.parameters()))
    _set_grads(model, 0, 3.0)
    grads = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm_in_optimizer(opt, model.parameters(), None, 1.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    opt.step()
    coef = 1.0 / (norm + 1e-6)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g * coef, rtol=1e-6, atol=0)


def test_a_list_of_optimizers_fused_and_not_is_handled_one_by_one():
    ref_model, model = _model(), _model()

    def split(m: torch.nn.Module) -> tuple[list, list]:
        return list(m[0].parameters()), list(m[2].parameters())

    ref_a, ref_b = split(ref_model)
    a, b = split(model)
    ref_opts = [FUSED["AdamW"](ref_a), FALLBACK["SGD-for-loop"](ref_b)]
    opts = [FUSED["AdamW"](a), FALLBACK["SGD-for-loop"](b)]
    for step, s in enumerate(SCALES):
        _set_grads(ref_model, step, s)
        _set_grads(model, step, s)
        clip_grad_norm_(ref_model.parameters(), None, 1.0)
        for o in ref_opts:
            o.step()
        clip_grad_norm_in_optimizer(opts, model.parameters(), None, 1.0)
        for o in opts:
            o.step()
    for x, y in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@needs_torchtitan
def test_torchtitans_optimizers_container():
    """torchtitan's own OptimizersContainer: fused=True in each group, several optimizers behind one step()."""
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    def container(model: torch.nn.Module) -> OptimizersContainer:
        groups = [
            ParamGroupConfig(pattern=r"^0\.", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2}),
            ParamGroupConfig(pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-2, "fused": False}),
        ]
        return OptimizersContainer(
            OptimizersContainer.Config(param_groups=groups, implementation="fused"), model_parts=[model]
        )

    ref_model, model = _model(), _model()
    ref_opt, opt = container(ref_model), container(model)
    assert [o.param_groups[0]["fused"] for o in opt.optimizers] == [True, False]
    for step, s in enumerate(SCALES):
        _set_grads(ref_model, step, s)
        _set_grads(model, step, s)
        clip_grad_norm_(ref_model.parameters(), None, 1.0)
        ref_opt.step()
        clip_grad_norm_in_optimizer(opt, model.parameters(), None, 1.0)
        opt.step()
    for x, y in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    # Skipped through the container: both optimizers, fused and not, leave everything as it was.
    _set_grads(model, 9, 1.0)
    next(model.parameters()).grad.fill_(float("inf"))
    before = copy.deepcopy([_state(model, o) for o in opt.optimizers])
    clip_grad_norm_in_optimizer(opt, model.parameters(), None, 1.0, nonfinite="skip")
    opt.step()
    for o, old in zip(opt.optimizers, before):
        assert all(torch.equal(x, y) for x, y in zip(_state(model, o), old))


def test_bad_optimizer_and_policy_raise():
    model = _model()
    _set_grads(model, 0, 1.0)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        clip_grad_norm_in_optimizer(object(), model.parameters(), None, 1.0)
    with pytest.raises(ValueError, match="nonfinite"):
        clip_grad_norm_in_optimizer(
            FUSED["Adam"](list(model.parameters())), model.parameters(), None, 1.0, nonfinite="zero"
        )


def _spiky_scale(step: int) -> float:
    """Gradient scales of an 60-step run: a calm run with a spike every 13 steps after warm-up."""
    return 40.0 if step > 10 and step % 13 == 0 else 1.0 + 0.05 * (step % 4)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_adaptive_clip_handed_over_equals_adaptive_clip_then_step_or_skip(name):
    """Same thresholds, skip decisions and statistics as adaptive_clip_grad_norm_; the step applied or skipped alike."""
    make = OPTIMIZERS[name]
    ref_model, model = _model(), _model()
    ref_opt, opt = make(list(ref_model.parameters())), make(list(model.parameters()))
    ref_state = state = init_clip_state()
    options = {"warmup": 5, "skip_z": 8.0, "z": 2.5, "max_norm": 30.0}
    skipped = 0
    for step in range(60):
        _set_grads(ref_model, step, _spiky_scale(step))
        _set_grads(model, step, _spiky_scale(step))
        want = adaptive_clip_grad_norm_(ref_model.parameters(), None, ref_state, **options)
        if not bool(want.skip):
            ref_opt.step()
        ref_state = want.state
        got = adaptive_clip_grad_norm_in_optimizer(opt, model.parameters(), None, state, **options)
        opt.step()
        state = got.state
        for a, b in zip(
            (got.total_norm, got.threshold, got.skip, *got.state),
            (want.total_norm, want.threshold, want.skip, *want.state),
        ):
            assert torch.equal(a, b), step
        skipped += int(want.skip)
        for a, b in zip(_state(model, opt), _state(ref_model, ref_opt)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert skipped >= 2  # the spikes were skipped: the skip path was exercised


@pytest.mark.parametrize("name", ["AdamW", "AdamW-foreach"])
def test_under_torch_compile_the_hand_over_equals_eager(name):
    """A compiled trainer step (clip handed over, then step()) equals the eager one, skipped step included.

    The norm is traced and the hand-over runs at a graph break. A fused
    step is not traced (torch disables it), so it matches bit for bit; a
    foreach step is compiled by dynamo, so within its roundings.
    """
    make = OPTIMIZERS[name]
    eager_model, model = _model(), _model()
    eager_opt, opt = make(list(eager_model.parameters())), make(list(model.parameters()))

    def train_step(m: torch.nn.Module, o: torch.optim.Optimizer) -> torch.Tensor:
        norm = clip_grad_norm_in_optimizer(o, m.parameters(), None, 1.0, nonfinite="skip")
        o.step()
        return norm

    backend = CaptureBackend()  # runs as aot_eager
    compiled = torch.compile(train_step, backend=backend)
    before: list[torch.Tensor] = []
    for step in range(4):
        for m in (eager_model, model):
            _set_grads(m, step, 3.0)
            if step == 2:
                next(m.parameters()).grad[0, 0] = float("nan")
        want, got = train_step(eager_model, eager_opt), compiled(model, opt)
        assert torch.equal(got, want) or (got.isnan() and want.isnan())
        for a, b in zip(_state(model, opt), _state(eager_model, eager_opt)):
            if name in FUSED:
                assert torch.equal(a, b), step
            else:  # torch's compiled AdamW rounds apart from its eager one, by ~1e-7 absolute
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if step == 2:  # skipped: nothing moved since the step before
            assert all(torch.equal(a, b) for a, b in zip(_state(model, opt), before))
        before = [t.clone() for t in _state(model, opt)]
    traced = {op for gm in backend.aten for op in aten_ops(gm)}
    # On CPU the statistics are one op of ours in the graph (ppclip_func::cpu_statistic).
    assert "ppclip_func::cpu_statistic" in traced, "the norm is traced, not run eagerly"
    torch._dynamo.reset()
