"""AdaGC, per-parameter thresholds that follow each parameter's history: the spec, against a float64 loop.

``reference_run`` is the rule as a Python loop over steps, in float64, written
from the paper (Wang et al., arXiv:2502.11034) and the authors' PyTorch code
(github.com/lishuai-97/AdaGC, ``megatron-gpt2.patch``, class ``AdaGC``): for
the first ``warmup`` steps the global clip at ``max_norm`` and, per
parameter, the running minimum of the clipped norm (its first norm starts
it); then each parameter clipped to ``relative`` times its running value, which
takes in ``beta``-weighted the clipped norm. A parameter without a gradient
keeps its value; a step with a non-finite total norm moves nothing (ours: the
authors' code would take a NaN in). The device rule must follow the loop step
by step, for a run with spikes, a missing gradient and a NaN, and for
hypothesis-generated norm sequences and options; the public functions must
scale each gradient by its parameter's coefficient; a compiled step must trace
once, with one collective, over DTensor leaves; and the state must survive a
checkpoint by parameter name.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ppclip_func import (
    AdaGCStateful,
    ParamIndex,
    adagc_clip_grad_norm,
    adagc_clip_grad_norm_,
    init_adagc_state,
    param_norm_index,
)
from ppclip_func._clip.adagc import AdaGCRule, adagc_update
from tests._fake_pg import fake_world
from tests.test_compile_fake_pg import CaptureBackend, assert_one_graph_one_collective

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SHAPES = {"embed.weight": (8, 4), "layers.0.w": (16,), "layers.0.b": (4,), "head": (3, 3)}
NAMES = tuple(SHAPES)


def reference_run(
    steps: list[dict[str, torch.Tensor | None]],
    *,
    max_norm: float | None = 1.0,
    relative: float = 1.04,
    beta: float = 0.99,
    warmup: int = 100,
    eps: float = 1e-6,
) -> list[tuple[dict[str, torch.Tensor | None], dict[str, float], bool]]:
    """Per step: ``(clipped grads, gamma by name after the step, skipped)``, all in float64."""
    gamma: dict[str, float] = {}
    taken, out = 0, []
    for grads in steps:
        grads = {k: None if g is None else g.double() for k, g in grads.items()}
        norms = {k: float(g.norm()) for k, g in grads.items() if g is not None}
        total = math.sqrt(sum(v * v for v in norms.values()))
        if not math.isfinite(total):
            out.append((grads, dict(gamma), True))
            continue
        clipped = {}
        if taken < warmup:
            h = 1.0 if max_norm is None else min(max_norm / (total + eps), 1.0)
            for k, g in grads.items():
                clipped[k] = None if g is None else g * h
                if g is not None:
                    gamma[k] = min(gamma.get(k, math.inf), norms[k] * h)
        else:
            for k, g in grads.items():
                if g is None:
                    clipped[k] = None
                    continue
                prev = gamma.get(k, norms[k])  # a parameter seen for the first time starts at its norm
                if norms[k] > relative * prev:
                    clipped[k] = g * (relative * prev / (norms[k] + eps))
                    kept = relative * prev
                else:
                    clipped[k], kept = g, norms[k]
                gamma[k] = beta * prev + (1 - beta) * kept
        taken += 1
        out.append((clipped, dict(gamma), False))
    return out


def _grads(step: int, spikes: dict[tuple[int, str], float] | None = None) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(step)
    out: dict[str, torch.Tensor | None] = {}
    for k, shape in SHAPES.items():
        scale = (0.05 if k != "head" else 0.3) * (1 + 0.2 * math.sin(step / 4 + len(k)))
        out[k] = torch.randn(shape, generator=g) * scale * (spikes or {}).get((step, k), 1.0)
    return out


def _index() -> ParamIndex:
    return param_norm_index({k: torch.zeros(s) for k, s in SHAPES.items()}, None)


def _run_steps(n: int, spikes, missing, nan_step, **opts):
    """Steps of grads with spikes, a parameter without a gradient at some steps, and a NaN."""
    steps = []
    for i in range(n):
        grads = _grads(i, spikes)
        if i in missing:
            grads["layers.0.b"] = None
        if i == nan_step:
            grads["head"] = grads["head"].clone()
            grads["head"][0, 0] = math.nan
        steps.append(grads)
    return steps


def _assert_step(clipped, stats, want_clipped, want_gamma, want_skip, index, where):
    assert bool(stats.skip) == want_skip, where
    gamma = {k: float(v) for k, v in index.named(stats.state.gamma).items()}
    for k in NAMES:
        if k not in want_gamma:
            assert gamma[k] == math.inf, (where, k)
        else:
            assert math.isclose(gamma[k], want_gamma[k], rel_tol=1e-6), (where, k, gamma[k], want_gamma[k])
    if want_skip:
        return
    for k in NAMES:
        if want_clipped[k] is None:
            assert clipped[k] is None, (where, k)
        else:
            torch.testing.assert_close(clipped[k].double(), want_clipped[k], rtol=2e-6, atol=1e-9, msg=f"{where} {k}")


# --- the rule against the loop -------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [1.0, 0.2, None])
def test_a_run_with_spikes_a_missing_gradient_and_a_nan_follows_the_reference(max_norm):
    spikes = {(3, "head"): 30.0, (25, "head"): 8.0, (30, "layers.0.w"): 50.0, (31, "layers.0.w"): 1.2}
    opts = dict(max_norm=max_norm, relative=1.04, beta=0.9, warmup=10)
    steps = _run_steps(45, spikes, missing={2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 33}, nan_step=20, **opts)
    index = _index()
    state = init_adagc_state(index)
    clipped_steps = 0
    for i, (grads, (want_clipped, want_gamma, want_skip)) in enumerate(zip(steps, reference_run(steps, **opts))):
        clipped, stats = adagc_clip_grad_norm(grads, None, state, index, **opts)
        _assert_step(clipped, stats, want_clipped, want_gamma, want_skip, index, f"step {i}")
        clipped_steps += int((stats.coefficients < 1).any())
        state = stats.state
    assert int(state.count) == 44, "the NaN step was not counted"
    assert clipped_steps >= 4, "the run clipped something: the comparison could fail"


def test_in_place_is_the_pure_form():
    index = _index()
    opts = dict(warmup=3, beta=0.8)
    state_p = state_i = init_adagc_state(index)
    clipped_any = False
    for i in range(12):
        grads = _grads(i, {(8, "embed.weight"): 20.0, (2, "head"): 20.0})
        params = {k: torch.nn.Parameter(torch.zeros(s)) for k, s in SHAPES.items()}
        for k, p in params.items():
            p.grad = grads[k].clone()
        clipped, stats_p = adagc_clip_grad_norm(grads, None, state_p, index, **opts)
        stats_i = adagc_clip_grad_norm_(params, None, state_i, index, **opts)
        for k in NAMES:
            assert torch.equal(params[k].grad, clipped[k]), (i, k)
        assert torch.equal(stats_p.state.gamma, stats_i.state.gamma)
        state_p, state_i = stats_p.state, stats_i.state
        clipped_any |= bool((stats_p.coefficients < 1).any())
    assert clipped_any


def test_a_spike_in_one_parameter_clips_only_that_parameter():
    index = _index()
    state = init_adagc_state(index)
    for _ in range(20):  # steady gradients: no parameter's norm moves
        _, stats = adagc_clip_grad_norm(_grads(0), None, state, index, warmup=5)
        state = stats.state
    grads = _grads(0, {(0, "layers.0.w"): 100.0})
    clipped, stats = adagc_clip_grad_norm(grads, None, state, index, warmup=5)
    coef = index.named(stats.coefficients)
    assert float(coef["layers.0.w"]) < 0.05
    for k in ("embed.weight", "layers.0.b", "head"):
        assert torch.equal(clipped[k], grads[k]), f"{k} has no spike and is left alone"
    gamma_before = float(index.named(state.gamma)["layers.0.w"])
    torch.testing.assert_close(
        clipped["layers.0.w"].double().norm(), torch.tensor(1.04 * gamma_before, dtype=torch.float64), rtol=1e-6, atol=0
    )


def _device_run(
    norms: list[list[float]], totals: list[float], rule: AdaGCRule
) -> list[tuple[list[float], list[float], bool]]:
    state = init_adagc_state(ParamIndex(tuple(map(str, range(len(norms[0])))), ()))
    out = []
    for x, t in zip(norms, totals):
        coef, skip, state = adagc_update(
            torch.tensor(t, dtype=torch.float64), torch.tensor(x, dtype=torch.float64), state, rule
        )
        out.append((coef.tolist(), state.gamma.tolist(), bool(skip)))
    return out


def _loop_run(norms, totals, rule: AdaGCRule):
    """The loop above on norms alone (a gradient of norm x: [x]); coefficients from the clipped grads."""
    steps = [
        {str(j): (None if math.isnan(v) else torch.tensor([v], dtype=torch.float64)) for j, v in enumerate(x)}
        for x in norms
    ]
    out = []
    for x, (clipped, gamma, skip) in zip(norms, _reference_with_totals(steps, totals, rule)):
        coef = [
            math.nan if math.isnan(v) or skip else float(clipped[str(j)][0]) / v if v else math.nan
            for j, v in enumerate(x)
        ]
        out.append((coef, [gamma.get(str(j), math.inf) for j in range(len(x))], skip))
    return out


def _reference_with_totals(steps, totals, rule):
    # The loop computes its own total; hypothesis's norms are all finite and present, so totals match.
    return reference_run(
        steps, max_norm=rule.max_norm, relative=rule.relative, beta=rule.beta, warmup=rule.warmup, eps=rule.eps
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.floats(1e-3, 1e3), min_size=3, max_size=3), min_size=1, max_size=40),
    st.sampled_from([1.0, 1.04, 1.5]),
    st.sampled_from([0.0, 0.5, 0.99]),
    st.integers(0, 6),
    st.sampled_from([None, 0.5, 10.0]),
)
def test_the_rule_matches_the_loop_for_any_norm_sequence(norms, relative, beta, warmup, max_norm):
    totals = [math.sqrt(sum(v * v for v in x)) for x in norms]
    rule = AdaGCRule(max_norm, relative, beta, warmup, 1e-6)
    got, want = _device_run(norms, totals, rule), _loop_run(norms, totals, rule)
    for i, ((gc, gg, gs), (wc, wg, ws)) in enumerate(zip(got, want)):
        assert gs == ws, i
        for a, b in zip(gg, wg):
            assert a == b or math.isclose(a, b, rel_tol=1e-12), (i, gg, wg)
        for a, b, x in zip(gc, wc, norms[i]):
            if x > 1e-2:  # coefficients read back from a 1-element gradient: exact enough there
                assert math.isclose(a, b, rel_tol=1e-9), (i, gc, wc)


def test_a_nan_step_moves_nothing():
    index = _index()
    state = init_adagc_state(index)
    for i in range(6):
        state = adagc_clip_grad_norm(_grads(i), None, state, index, warmup=3)[1].state
    grads = _grads(6)
    grads["head"][0, 0] = math.inf
    _, stats = adagc_clip_grad_norm(grads, None, state, index, warmup=3)
    assert bool(stats.skip)
    assert torch.equal(stats.state.gamma, state.gamma) and torch.equal(stats.state.count, state.count)
    clipped, stats = adagc_clip_grad_norm(grads, None, state, index, warmup=3, nonfinite="zero")
    assert all(float(t.abs().sum()) == 0 for t in clipped.values())


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(relative=0.0), "relative must be > 0"),
        (dict(beta=1.0), r"beta must be in \[0, 1\)"),
        (dict(warmup=-1), "warmup must be an int >= 0"),
        (dict(max_norm=-1.0), "max_norm must be >= 0"),
    ],
)
def test_bad_options_raise(bad, match):
    index = _index()
    with pytest.raises(ValueError, match=match):
        adagc_clip_grad_norm(_grads(0), None, init_adagc_state(index), index, **bad)


def test_a_state_for_another_index_raises():
    index = _index()
    other = param_norm_index({"w": torch.zeros(2)}, None)
    with pytest.raises(ValueError, match="state has 1 parameters but the index 4"):
        adagc_clip_grad_norm(_grads(0), None, init_adagc_state(other), index)
    with pytest.raises(TypeError, match="index must be a ParamIndex"):
        adagc_clip_grad_norm(_grads(0), None, init_adagc_state(index), None)


# --- compiled: one graph, one collective, no recompiles ------------------------------------------


def test_hundred_compiled_steps_over_dtensor_leaves_trace_once_with_one_collective():
    torch._dynamo.reset()
    with fake_world(8, rank=3):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        dp = mesh["dp"]
        backend = CaptureBackend()
        # What param_norm_index would agree on in a real run (a fake world's all_gather_object moves no data).
        index = ParamIndex(names=("other_stage.w", *NAMES), local_slots=(1, 2, 3, 4))

        def step(grads, state):
            return adagc_clip_grad_norm(grads, mesh, state, index, warmup=5, beta=0.9)

        compiled = torch.compile(step, backend=backend, fullgraph=True)
        state_c = state_e = init_adagc_state(index)
        clipped_some = 0
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(100):
                local = _grads(i, {(i, "head"): 10.0} if i % 9 == 8 else None)
                grads = {k: DTensor.from_local(v, dp, [Shard(0)], run_check=False) for k, v in local.items()}
                (clipped, stats), (want_clipped, want) = compiled(grads, state_c), step(grads, state_e)
                torch.testing.assert_close(stats.coefficients, want.coefficients, rtol=1e-6, atol=0)
                torch.testing.assert_close(stats.state.gamma, want.state.gamma, rtol=1e-6, atol=0)
                for k in NAMES:
                    torch.testing.assert_close(clipped[k].to_local(), want_clipped[k].to_local(), rtol=1e-6, atol=0)
                clipped_some += int((want.coefficients[1:] < 1).any())
                state_c, state_e = stats.state, want.state
        assert_one_graph_one_collective(backend)
        assert clipped_some > 10, "per-parameter clips happened in the compiled run"
    torch._dynamo.reset()


# --- the state in a checkpoint, by parameter name ------------------------------------------------


def _run(index, steps, state, order=NAMES):
    out = []
    for i in steps:
        grads = _grads(i, {(15, "head"): 20.0})
        _, stats = adagc_clip_grad_norm({k: grads[k] for k in order}, None, state, index, warmup=5, beta=0.9)
        out.append(stats)
        state = stats.state
    return out, state


def test_a_resumed_run_is_the_run_that_never_stopped_even_with_the_parameters_in_another_order():
    index = _index()
    through, _ = _run(index, range(30), init_adagc_state(index))
    _, state = _run(index, range(12), init_adagc_state(index))
    clip = AdaGCStateful(index)
    clip.state = state
    reordered = tuple(reversed(NAMES))  # another stage split lists the names in another order
    index2 = param_norm_index({k: torch.zeros(SHAPES[k]) for k in reordered}, None)
    with tempfile.TemporaryDirectory() as folder:
        dcp.save({"clip": clip}, checkpoint_id=folder, no_dist=True)
        resumed = AdaGCStateful(index2)
        dcp.load({"clip": resumed}, checkpoint_id=folder, no_dist=True)
    assert int(resumed.state.count) == 12
    after, _ = _run(index2, range(12, 30), resumed.state, order=reordered)
    for want, got in zip(through[12:], after):
        assert all(torch.equal(index.named(want.state.gamma)[k], index2.named(got.state.gamma)[k]) for k in NAMES)
        w, g = index.named(want.coefficients), index2.named(got.coefficients)
        assert all(torch.equal(w[k], g[k]) for k in NAMES)
    fresh, _ = _run(index2, range(12, 30), init_adagc_state(index2), order=reordered)
    assert not torch.equal(fresh[-1].state.gamma, after[-1].state.gamma), "a fresh state differs: the test can fail"


def test_loading_a_state_dict_with_other_names_raises_naming_them():
    clip = AdaGCStateful(_index())
    saved = clip.state_dict()
    saved["gamma"]["renamed.w"] = saved["gamma"].pop("head")
    with pytest.raises(ValueError, match=r"missing \['head'\], unknown \['renamed.w'\]"):
        AdaGCStateful(_index()).load_state_dict(saved)
