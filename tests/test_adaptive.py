"""The adaptive threshold and step skipping: the spec, against a float64 loop written the obvious way.

``reference_run`` is the whole rule as a Python loop over steps, in float64
Python numbers, written from ZClip's definition (Kumar et al.,
arXiv:2504.02507): warm-up (the mean and population variance of the raw
norms, from a list of them, as ZClip buffers them; clip at ``max_norm``),
then, in ``"zscore"`` or ``"percentile"`` mode, a spike clipped to its target
and taken into exponentially weighted statistics at that target
(``var = alpha * var + (1 - alpha) * (v - new_mean)**2``), ``max_norm``
capping every step; skipped and non-finite steps leave the statistics alone.
The device state machine must follow it step by step, for hand-picked and for
hypothesis-generated norm sequences and options; the public functions must
clip to the threshold it gives; a compiled step must trace once, with one
collective, for 100 steps of changing norms; and a skipped AdamW step must
leave parameters and optimizer state bitwise unchanged.
(``tests/test_zclip_reference.py`` runs the official ZClip package itself.)
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from demo.optim import AdamWConfig, FunctionalAdamW
from ppclip_func import (
    ClipState,
    ParamIndex,
    adaptive_clip_grad_norm,
    adaptive_clip_grad_norm_,
    clip_grad_norm_,
    init_clip_state,
    select_update,
    skip_update_,
)
from ppclip_func._clip.adaptive import Rule, adapt
from tests._fake_pg import fake_world
from tests._reference import reference_norm
from tests.test_compile_fake_pg import CaptureBackend, assert_one_graph_one_collective


@dataclasses.dataclass
class Step:
    threshold: float
    zscore: float
    skip: bool
    count: int
    mean: float
    var: float
    near_tie: bool = False  # a decision within rounding of its boundary: the two runs may fall either way
    zscore_tol: float = 0.0  # how far rounding in the statistics may move the z-score


def _near(a: float, b: float, err: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b)) + err


def reference_run(
    norms: list[float],
    *,
    max_norm: float | None,
    z: float | None,
    alpha: float,
    warmup: int,
    skip_z: float | None,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    zscore_eps: float = 1e-6,
    freeze_on_spike: bool = False,
) -> list[Step]:
    count, mean, var, out = 0, 0.0, 0.0, []
    warm: list[float] = []  # the warm-up norms taken so far
    cap = math.inf if max_norm is None else max_norm
    for x in norms:
        warming = count < warmup
        std = math.sqrt(var)
        zscore = math.nan if count < 2 else (x - mean) / (std + zscore_eps)
        # The warm-up statistics here (two passes over the norms, as ZClip computes them) and on the device
        # (one norm at a time) differ by rounding: a few ulps of the mean in the std and the mean, which the
        # z-score divides by std + zscore_eps, a tiny number when the norms were all about equal.
        std_err, mean_err = 1e-12 * std + 16 * math.ulp(abs(mean)), 4 * math.ulp(abs(mean))
        zscore_err = (abs(zscore) * std_err + mean_err) / (std + zscore_eps) if math.isfinite(zscore) else 0.0
        spike, target, let_through, tie = False, x, math.inf, False
        if not warming and z is not None:
            if mode == "percentile":
                let_through = mean + z * std
                spike, target, tie = x > let_through, let_through, _near(x, let_through, z * std_err + mean_err)
            else:
                let_through = mean + z * (std + zscore_eps)
                spike, tie = zscore > z, _near(zscore, z, zscore_err)
                if spike:
                    target = mean if clip_option == "mean" else (mean + z * std / (zscore / z)) * clip_factor
        threshold = cap if warming else min(target if spike else let_through, cap)
        skip = not math.isfinite(x) or (skip_z is not None and not warming and zscore > skip_z)
        tie = tie or (skip_z is not None and not warming and _near(zscore, skip_z, zscore_err))
        if not skip and not (freeze_on_spike and spike):
            v = target if spike else x
            count += 1
            if warming:
                warm.append(v)
                mean = sum(warm) / len(warm)
                var = sum((w - mean) ** 2 for w in warm) / len(warm)
            else:
                mean = alpha * mean + (1 - alpha) * v
                var = alpha * var + (1 - alpha) * (v - mean) ** 2
        out.append(Step(threshold, zscore, skip, count, mean, var, tie, zscore_err))
    return out


def _rule(**opts) -> Rule:
    full = dict(mode="zscore", clip_option="adaptive_scaling", clip_factor=1.0, zscore_eps=1e-6, freeze_on_spike=False)
    return Rule(**(full | opts))


def device_run(norms: list[float], dtype: torch.dtype = torch.float64, **opts) -> list[Step]:
    """The device state machine alone, fed the norms as 0-dim tensors."""
    state = init_clip_state(dtype=dtype)
    rule = _rule(**opts)
    out = []
    for x in norms:
        threshold, zscore, skip, state = adapt(torch.tensor(x, dtype=dtype), state, rule)
        out.append(
            Step(float(threshold), float(zscore), bool(skip), int(state.count), float(state.mean), float(state.var))
        )
    return out


def assert_runs_match(got: list[Step], want: list[Step], rel: float) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.skip == w.skip and g.count == w.count, (i, g, w)
        for field in ("threshold", "mean", "var", "zscore"):
            a, b = getattr(g, field), getattr(w, field)
            if math.isnan(b) or math.isinf(b):
                assert a == b or (math.isnan(a) and math.isnan(b)), (i, field, a, b)
            else:
                tol = rel * max(abs(b), 1e-12) + (w.zscore_tol if field == "zscore" else 0.0)
                assert abs(a - b) <= tol, (i, field, a, b)


DEFAULTS = dict(max_norm=1.0, z=2.5, alpha=0.97, warmup=25, skip_z=None)
MODES = [dict(mode="zscore"), dict(mode="zscore", clip_option="mean"), dict(mode="percentile")]
MODE_IDS = ["zscore", "zscore_mean", "percentile"]


# --- the state machine against the loop ----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_run_with_a_spike_a_nan_and_an_inf_follows_the_reference(mode):
    g = torch.Generator().manual_seed(0)
    norms = (1.0 + 0.2 * torch.rand(80, generator=g, dtype=torch.float64)).tolist()
    norms[40] = 50.0  # a spike: skipped (skip_z)
    norms[45] = 1.6  # a smaller one: clipped, and taken in at its clip target, not at 1.6
    norms[50] = math.nan
    norms[60] = math.inf
    opts = dict(DEFAULTS, max_norm=None, warmup=10, skip_z=100.0, **mode)
    want = reference_run(norms, **opts)
    assert_runs_match(device_run(norms, **opts), want, rel=1e-12)
    assert want[40].skip and want[50].skip and want[60].skip and not want[45].skip
    assert want[41].threshold < 1.5, "a skipped spike does not raise the threshold"
    assert want[45].threshold < 1.5 and want[46].threshold < 1.5, "nor does a clipped one"


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_clipped_spike_raises_the_threshold_by_little(mode):
    norms = [1.0, 1.1, 0.9] * 10 + [40.0, 1.0]
    opts = dict(DEFAULTS, max_norm=None, warmup=10, **mode)
    want = reference_run(norms, **opts)
    got = device_run(norms, **opts)
    assert_runs_match(got, want, rel=1e-12)
    before, after = got[-3].threshold, got[-1].threshold
    assert not got[-2].skip and got[-2].threshold < 1.5, got[-2]
    assert after - before < 0.2 * before, (before, after)


def test_in_zscore_mode_the_larger_the_spike_the_lower_its_clip_target():
    base = [1.0, 1.1, 0.9] * 10
    targets = [
        device_run([*base, spike], **dict(DEFAULTS, max_norm=None, warmup=10))[-1].threshold for spike in (2, 5, 50)
    ]
    assert targets[0] > targets[1] > targets[2], targets
    mean = device_run(base, **dict(DEFAULTS, max_norm=None, warmup=10))[-1].mean
    assert all(t > mean for t in targets), (targets, mean)


def test_max_norm_caps_every_step_but_not_the_statistics():
    norms = [2.0, 2.2, 1.8] * 10
    opts = dict(DEFAULTS, warmup=10)
    capped, free = device_run(norms, **opts), device_run(norms, **dict(opts, max_norm=None))
    assert [s.threshold for s in capped] == [1.0] * len(norms)
    assert all(s.threshold > 2.0 for s in free[10:]), "unclipped, the rule lets these norms through"
    assert [(s.mean, s.var) for s in capped] == [(s.mean, s.var) for s in free]


def test_freeze_on_spike_leaves_the_statistics_at_a_spike():
    norms = [1.0, 1.1, 0.9] * 10 + [5.0, 1.0]
    opts = dict(DEFAULTS, max_norm=None, warmup=10)
    frozen, moving = device_run(norms, **opts, freeze_on_spike=True), device_run(norms, **opts)
    assert frozen[-2].threshold == moving[-2].threshold < 5.0, "the spike is clipped either way"
    assert (frozen[-2].count, frozen[-2].mean) == (frozen[-3].count, frozen[-3].mean)
    assert moving[-2].count == moving[-3].count + 1
    assert_runs_match(frozen, reference_run(norms, **opts, freeze_on_spike=True), rel=1e-12)


def test_a_nan_norm_is_a_step_that_never_happened():
    g = torch.Generator().manual_seed(3)
    norms = (1.0 + 0.2 * torch.rand(60, generator=g, dtype=torch.float64)).tolist()
    with_nans = [*norms[:5], math.nan, *norms[5:40], math.nan, *norms[40:]]
    opts = dict(DEFAULTS, max_norm=None, warmup=10)
    got, want = device_run(with_nans, **opts), device_run(norms, **opts)
    assert got[5].skip and got[41].skip
    del got[41], got[5]
    assert_runs_match(got, want, rel=0.0)  # bit for bit


def test_fixed_threshold_still_tracks_the_statistics():
    norms = [2.0, 4.0, 2.0, 4.0, 100.0]
    opts = dict(DEFAULTS, z=None, warmup=2, skip_z=3.0)
    got = device_run(norms, **opts)
    assert [s.threshold for s in got] == [1.0] * 5
    assert got[-1].skip and not any(s.skip for s in got[:-1])
    assert_runs_match(got, reference_run(norms, **opts), rel=1e-12)


norm_values = st.one_of(
    st.floats(min_value=1e-3, max_value=1e3, allow_nan=False),
    st.sampled_from([math.nan, math.inf, 1e4, 0.0]),
)


@settings(max_examples=200, deadline=None)
@given(
    norms=st.lists(norm_values, min_size=1, max_size=60),
    max_norm=st.one_of(st.none(), st.floats(min_value=0.1, max_value=100.0)),
    z=st.one_of(st.none(), st.floats(min_value=0.5, max_value=4.0)),
    alpha=st.floats(min_value=0.5, max_value=0.999),
    warmup=st.integers(min_value=2, max_value=12),
    skip_z=st.one_of(st.none(), st.floats(min_value=2.0, max_value=10.0)),
    mode=st.sampled_from(["zscore", "percentile"]),
    clip_option=st.sampled_from(["adaptive_scaling", "mean"]),
    clip_factor=st.floats(min_value=0.5, max_value=1.5),
    zscore_eps=st.sampled_from([1e-6, 1e-3]),
    freeze_on_spike=st.booleans(),
)
def test_state_machine_matches_the_reference_for_any_norm_sequence(
    norms, max_norm, z, alpha, warmup, skip_z, mode, clip_option, clip_factor, zscore_eps, freeze_on_spike
):
    opts = dict(max_norm=max_norm, z=z, alpha=alpha, warmup=warmup, skip_z=skip_z, mode=mode)
    opts |= dict(
        clip_option=clip_option, clip_factor=clip_factor, zscore_eps=zscore_eps, freeze_on_spike=freeze_on_spike
    )
    want = reference_run(norms, **opts)
    # A decision within rounding of its boundary may fall either way; the runs would part there.
    ties = [i for i, s in enumerate(want) if s.near_tie]
    got = device_run(norms, **opts)
    end = ties[0] if ties else len(want)
    assert_runs_match(got[:end], want[:end], rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    norms=st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=3, max_size=40),
    skip_z=st.floats(2, 6),
    mode=st.sampled_from(["zscore", "percentile"]),
)
def test_a_skipped_step_leaves_the_state_bitwise_unchanged(norms, skip_z, mode):
    state = init_clip_state()
    rule = _rule(max_norm=1.0, z=2.5, alpha=0.9, warmup=2, skip_z=skip_z, mode=mode)
    for x in [*norms, 1e9]:
        _, _, skip, new = adapt(torch.tensor(x), state, rule)
        if bool(skip):
            assert all(torch.equal(a, b) for a, b in zip(new, state))
        else:
            assert int(new.count) == int(state.count) + 1
        state = new


# --- the public functions ------------------------------------------------------------------------


def _grads(step: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 8, generator=g) * scale, "b": torch.randn(8, generator=g) * scale}


@pytest.mark.parametrize("max_norm", [None, 23.0], ids=["no_cap", "cap"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_clips_to_the_reference_threshold_pure_and_in_place(mode, max_norm):
    scales = [1.0] * 12 + [30.0] + [1.0] * 3 + [1.15] + [1.0] * 3  # norms about 22.8: skip at 12, clip at 16
    opts = dict(max_norm=max_norm, z=2.0, alpha=0.9, warmup=6, skip_z=100.0, **mode)
    norms = [reference_norm(_grads(i, s).values(), 2.0) for i, s in enumerate(scales)]
    want = reference_run(norms, **opts)
    state_pure = state_inplace = init_clip_state()
    for i, s in enumerate(scales):
        grads = _grads(i, s)
        clipped, stats = adaptive_clip_grad_norm(grads, None, state_pure, **opts)
        params = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in grads.items()}
        for k, p in params.items():
            p.grad = grads[k].clone()
        stats_inplace = adaptive_clip_grad_norm_(params, None, state_inplace, **opts)
        assert float(stats.threshold) == pytest.approx(want[i].threshold, rel=1e-5)  # inf in warm-up without a cap
        assert bool(stats.skip) == want[i].skip and int(stats.state.count) == want[i].count
        coef = min(want[i].threshold / (norms[i] + 1e-6), 1.0)
        for k in grads:
            want_k = grads[k].double() * coef
            torch.testing.assert_close(clipped[k].double(), want_k, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(params[k].grad.double(), want_k, rtol=1e-5, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(stats.state, stats_inplace.state))
        state_pure, state_inplace = stats.state, stats_inplace.state
    assert want[12].skip and not want[11].skip and not want[16].skip
    assert want[16].threshold < norms[16], "the smaller spike is clipped"
    if max_norm is not None:
        assert sum(s.threshold == max_norm < x for s, x in zip(want, norms)) >= 3, "the cap clipped some steps"


def test_with_a_fixed_threshold_and_no_spike_it_is_the_plain_clip():
    grads = _grads(0, 3.0)
    params = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in grads.items()}
    plain = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in grads.items()}
    for k in grads:
        params[k].grad, plain[k].grad = grads[k].clone(), grads[k].clone()
    stats = adaptive_clip_grad_norm_(params, None, init_clip_state(), max_norm=2.0, z=None)
    total = clip_grad_norm_(plain, None, 2.0)
    assert torch.equal(stats.total_norm, total)
    assert all(torch.equal(params[k].grad, plain[k].grad) for k in grads)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(state=(torch.tensor(0), torch.tensor(0.0), torch.tensor(0.0))), "ClipState"),
        (dict(alpha=1.0), "alpha"),
        (dict(warmup=1), "warmup"),
        (dict(z=-1.0), "z must"),
        (dict(skip_z=0), "skip_z"),
        (dict(max_norm=-1.0), "max_norm"),
        (dict(mode="median"), "mode"),
        (dict(clip_option="max"), "clip_option"),
        (dict(clip_factor=0.0), "clip_factor"),
        (dict(zscore_eps=-1e-6), "zscore_eps"),
        (dict(freeze_on_spike=1), "freeze_on_spike"),
    ],
)
def test_bad_options_raise(bad, match):
    kwargs = dict(state=init_clip_state()) | bad
    state = kwargs.pop("state")
    with pytest.raises((TypeError, ValueError), match=match):
        adaptive_clip_grad_norm(_grads(0), None, state, **kwargs)


# --- compiled: one graph, one collective, no recompiles ------------------------------------------


def test_hundred_compiled_steps_with_changing_norms_and_parameter_norms_trace_once_with_one_collective():
    torch._dynamo.reset()
    with fake_world(8, rank=3):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        dp = mesh["dp"]  # one mesh object for every step, as a trainer's parameters keep theirs
        backend = CaptureBackend()

        # What param_norm_index would agree on in a real run (a fake world's all_gather_object moves no data).
        index = ParamIndex(names=("w", "b"), local_slots=(0, 1))

        def step(grads, state: ClipState):
            return adaptive_clip_grad_norm(grads, mesh, state, max_norm=None, warmup=5, skip_z=6.0, param_norms=index)

        compiled = torch.compile(step, backend=backend, fullgraph=True)
        state_c = state_e = init_clip_state()
        thresholds = set()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(100):
                local = _grads(i, 1.0 + (i % 7))
                grads = {k: DTensor.from_local(v, dp, [Shard(0)], run_check=False) for k, v in local.items()}
                (clipped, stats), (want_clipped, want) = compiled(grads, state_c), step(grads, state_e)
                torch.testing.assert_close(stats.threshold, want.threshold, rtol=1e-6, atol=0)
                assert torch.equal(stats.skip, want.skip) and torch.equal(stats.state.count, want.state.count)
                torch.testing.assert_close(clipped["w"].to_local(), want_clipped["w"].to_local(), rtol=1e-6, atol=0)
                torch.testing.assert_close(stats.param_norms, want.param_norms, rtol=1e-6, atol=0)
                thresholds.add(float(stats.threshold))
                state_c, state_e = stats.state, want.state
        assert_one_graph_one_collective(backend)
        assert len(thresholds) > 50, "the threshold adapted from step to step"
    torch._dynamo.reset()


# --- skipping an optimizer step ------------------------------------------------------------------


def _adamw_setup(seed: int = 0):
    torch.manual_seed(seed)
    params = [torch.randn(16, 4), torch.randn(4)]
    return params, FunctionalAdamW(params, AdamWConfig(lr=1e-2, weight_decay=0.1))


def _snapshot(opt: FunctionalAdamW) -> list[torch.Tensor]:
    return [t.clone() for t in [*opt.params, *opt.exp_avgs, *opt.exp_avg_sqs, *opt.steps]]


def _state_tensors(opt: FunctionalAdamW) -> list[torch.Tensor]:
    return [*opt.params, *opt.exp_avgs, *opt.exp_avg_sqs, *opt.steps]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_skipped_adamw_step_leaves_parameters_and_state_bitwise_unchanged(compiled):
    torch._dynamo.reset()
    params, opt = _adamw_setup()
    backend = CaptureBackend()

    def step(grads: list[torch.Tensor], state: ClipState):
        clipped, stats = adaptive_clip_grad_norm(grads, None, state, warmup=3, skip_z=20.0)
        skip_update_(stats.skip, _state_tensors(opt), lambda: opt.step(clipped))
        return stats

    run = torch.compile(step, backend=backend, fullgraph=True) if compiled else step
    state = init_clip_state()
    g = torch.Generator().manual_seed(1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(12):
            scale = 1e4 if i == 8 else (math.nan if i == 10 else 1.0)
            grads = [torch.randn(p.shape, generator=g) * scale for p in params]
            before = _snapshot(opt)
            stats = run(grads, state)
            after = _state_tensors(opt)
            if i in (8, 10):
                assert bool(stats.skip)
                assert all(torch.equal(a, b) for a, b in zip(after, before)), f"step {i} moved something"
            else:
                assert not bool(stats.skip)
                assert not torch.equal(after[0], before[0]) and float(after[-1]) == float(before[-1]) + 1
            state = stats.state
    if compiled:
        assert backend.frames == 1
    torch._dynamo.reset()


def test_nonfinite_zero_moves_adamw_where_skipping_does_not():
    params, opt = _adamw_setup()
    opt.step([torch.ones_like(p) for p in params])  # some moments to decay
    before = _snapshot(opt)
    grads = [torch.full_like(p, math.nan) for p in params]
    from ppclip_func import clip_grad_norm

    zeroed, _ = clip_grad_norm(grads, None, 1.0, nonfinite="zero")
    opt.step(zeroed)
    moved = [not torch.equal(a, b) for a, b in zip(_state_tensors(opt), before)]
    assert all(moved), "zero grads still decay the moments, count a step and decay the weights"


def test_select_update_keeps_old_values_bitwise_even_against_nan():
    old = {"w": torch.randn(3), "step": torch.tensor(4.0), "name": "adamw"}
    new = {"w": torch.full((3,), math.nan), "step": torch.tensor(5.0), "name": "adamw"}
    kept = select_update(torch.tensor(True), new, old)
    assert torch.equal(kept["w"], old["w"]) and torch.equal(kept["step"], old["step"]) and kept["name"] == "adamw"
    taken = select_update(torch.tensor(False), new, old)
    assert torch.isnan(taken["w"]).all() and float(taken["step"]) == 5.0


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, -math.inf])
def test_a_nan_gradient_makes_its_parameter_norm_and_the_total_nan_and_no_other(norm_type):
    from ppclip_func import param_norm_index

    grads = {"a": torch.tensor([1.0, math.nan]), "b": torch.tensor([2.0, -3.0])}
    index = param_norm_index(grads, None)
    _, stats = adaptive_clip_grad_norm(grads, None, init_clip_state(), norm_type, param_norms=index)
    norms = index.named(stats.param_norms)
    assert math.isnan(float(stats.total_norm)) and math.isnan(float(norms["a"]))
    assert float(norms["b"]) == pytest.approx(reference_norm([grads["b"]], norm_type), rel=1e-6)
    assert bool(stats.skip), "a non-finite norm is a skipped step"
