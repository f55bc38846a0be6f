"""The adaptive threshold and step skipping: the spec, against a float64 loop written the obvious way.

``reference_run`` is the whole algorithm as a Python loop over steps, in
float64 Python numbers: warm-up (plain mean and variance of the raw norms,
clip at ``max_norm``), then ``mean + z * std`` with exponentially weighted
statistics updated by the norm after clipping; skipped and non-finite steps
leave the statistics alone. The device state machine must follow it step by
step, for hand-picked and for hypothesis-generated norm sequences; the public
functions must clip to the threshold it gives; a compiled step must trace
once, with one collective, for 100 steps of changing norms; and a skipped
AdamW step must leave parameters and optimizer state bitwise unchanged.
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
from ppclip_func._adaptive import threshold_and_skip, update_state
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


def reference_run(
    norms: list[float], *, max_norm: float, z: float | None, alpha: float, warmup: int, skip_z: float | None
) -> list[Step]:
    count, mean, var, out = 0, 0.0, 0.0, []
    for x in norms:
        std = math.sqrt(max(var, 0.0))
        warming = count < warmup
        threshold = max_norm if (z is None or warming) else mean + z * std
        if count < 2:
            zscore = math.nan
        elif std == 0:
            zscore = math.nan if x == mean or math.isnan(x) else math.copysign(math.inf, x - mean)
        else:
            zscore = (x - mean) / std
        skip = not math.isfinite(x) or (skip_z is not None and not warming and zscore > skip_z)
        if not skip:
            taken = x if warming else min(x, threshold)
            d = taken - mean
            if warming:
                count += 1
                mean += d / count
                var += (d * (taken - mean) - var) / count
            else:
                count += 1
                mean += (1 - alpha) * d
                var = alpha * (var + (1 - alpha) * d * d)
        out.append(Step(threshold, zscore, skip, count, mean, var))
    return out


def device_run(norms: list[float], dtype: torch.dtype = torch.float64, **opts) -> list[Step]:
    """The device state machine alone, fed the norms as 0-dim tensors."""
    state = init_clip_state(dtype=dtype)
    out = []
    for x in norms:
        total = torch.tensor(x, dtype=dtype)
        threshold, zscore, skip = threshold_and_skip(
            total, state, max_norm=opts["max_norm"], z=opts["z"], skip_z=opts["skip_z"], warmup=opts["warmup"]
        )
        state = update_state(state, total, threshold, skip, alpha=opts["alpha"], warmup=opts["warmup"])
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
                assert abs(a - b) <= rel * max(abs(b), 1e-12), (i, field, a, b)


DEFAULTS = dict(max_norm=1.0, z=2.5, alpha=0.97, warmup=25, skip_z=None)


# --- the state machine against the loop ----------------------------------------------------------


def test_a_run_with_a_spike_a_nan_and_an_inf_follows_the_reference():
    g = torch.Generator().manual_seed(0)
    norms = (1.0 + 0.2 * torch.rand(80, generator=g, dtype=torch.float64)).tolist()
    norms[40] = 50.0  # a spike: clipped, and taken in at the threshold, not at 50
    norms[50] = math.nan
    norms[60] = math.inf
    opts = dict(DEFAULTS, warmup=10, skip_z=8.0)
    want = reference_run(norms, **opts)
    assert_runs_match(device_run(norms, **opts), want, rel=1e-12)
    assert want[40].skip and want[50].skip and want[60].skip
    assert want[41].threshold < 1.5, "a skipped spike does not raise the threshold"


def test_a_clipped_spike_raises_the_threshold_by_little():
    norms = [1.0, 1.1, 0.9] * 10 + [40.0, 1.0]
    opts = dict(DEFAULTS, warmup=10)
    want = reference_run(norms, **opts)
    got = device_run(norms, **opts)
    assert_runs_match(got, want, rel=1e-12)
    before, after = got[-2].threshold, got[-1].threshold
    assert not got[-2].skip and after - before < 0.2 * before, (before, after)


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


@settings(max_examples=150, deadline=None)
@given(
    norms=st.lists(norm_values, min_size=1, max_size=60),
    z=st.one_of(st.none(), st.floats(min_value=0.5, max_value=4.0)),
    alpha=st.floats(min_value=0.5, max_value=0.999),
    warmup=st.integers(min_value=2, max_value=12),
    skip_z=st.one_of(st.none(), st.floats(min_value=2.0, max_value=10.0)),
)
def test_state_machine_matches_the_reference_for_any_norm_sequence(norms, z, alpha, warmup, skip_z):
    opts = dict(max_norm=1.0, z=z, alpha=alpha, warmup=warmup, skip_z=skip_z)
    want = reference_run(norms, **opts)
    # A z-score within rounding of skip_z may fall either way; the runs would part there.
    for s in want:
        if skip_z is not None and math.isfinite(s.zscore) and abs(s.zscore - skip_z) < 1e-9 * max(1, abs(s.zscore)):
            return
    assert_runs_match(device_run(norms, **opts), want, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(norms=st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=3, max_size=40), skip_z=st.floats(2, 6))
def test_a_skipped_step_leaves_the_state_bitwise_unchanged(norms, skip_z):
    state = init_clip_state()
    for x in [*norms, 1e9]:
        total = torch.tensor(x)
        threshold, _, skip = threshold_and_skip(total, state, max_norm=1.0, z=2.5, skip_z=skip_z, warmup=2)
        new = update_state(state, total, threshold, skip, alpha=0.9, warmup=2)
        if bool(skip):
            assert all(torch.equal(a, b) for a, b in zip(new, state))
        else:
            assert int(new.count) == int(state.count) + 1
        state = new


# --- the public functions ------------------------------------------------------------------------


def _grads(step: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 8, generator=g) * scale, "b": torch.randn(8, generator=g) * scale}


def test_clips_to_the_reference_threshold_pure_and_in_place():
    scales = [1.0] * 12 + [30.0] + [1.0] * 5
    opts = dict(max_norm=5.0, z=2.0, alpha=0.9, warmup=6, skip_z=10.0)
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
        assert abs(float(stats.threshold) - want[i].threshold) <= 1e-5 * want[i].threshold
        assert bool(stats.skip) == want[i].skip and int(stats.state.count) == want[i].count
        coef = min(want[i].threshold / (norms[i] + 1e-6), 1.0)
        for k in grads:
            want_k = grads[k].double() * coef
            torch.testing.assert_close(clipped[k].double(), want_k, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(params[k].grad.double(), want_k, rtol=1e-5, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(stats.state, stats_inplace.state))
        state_pure, state_inplace = stats.state, stats_inplace.state
    assert want[12].skip and not want[11].skip


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
            return adaptive_clip_grad_norm(grads, mesh, state, warmup=5, skip_z=6.0, param_norms=index)

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
