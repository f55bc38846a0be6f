"""The adaptive clip against ZClip itself: the official package, ``zclip==1.0.0`` (a pinned test dependency).

ZClip (Kumar et al., arXiv:2504.02507) runs its own ``ZClip.step(model)`` on
a real ``torch.nn`` model whose grads the test sets; ``adaptive_clip_grad_norm_``
runs on a second copy of the model holding the same grads, with ZClip's
options mapped to ours (``ZCLIP_NAMES``). Each run is 200 steps of drifting
norms with spikes (single, back to back, small and huge), in each mode
(``"zscore"`` with ``"adaptive_scaling"`` and with ``"mean"``,
``"percentile"``), with and without ZClip's cap ``max_grad_norm``, and with
``clip_factor`` and ``skip_update_on_spike``. At every step:

* the norm each clipped to agrees within 1e-6 (relative): ZClip's is what its
  ``_apply_clipping`` returns after warm-up and ``max_grad_norm`` during it;
  on a step ZClip does not clip, ours lets the norm through too;
* every clipped gradient agrees within 1e-6 (relative to the step's largest);
* after warm-up, ZClip's ``mean`` and ``var`` and our state agree within 1e-6.

That is with the statistics in float64, the default, as ZClip keeps them;
in float32 they agree within 1e-5.

Each run must also exercise what it names: spikes clipped by the rule, and,
with a cap, steps clipped by the cap. A NaN step is where the two part, on
purpose: ZClip's statistics are NaN from then on; ours skip the step, and the
run continues as ZClip's does on the same steps without it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from zclip import ZClip

from ppclip_func import adaptive_clip_grad_norm_, init_clip_state

STEPS = 200
TOL = 1e-6
# Statistics in float32 (init_clip_state(dtype=torch.float32)) drift from ZClip's float64 ones: measured 4e-6.
TOL_FP32_STATE = 1e-5
SPIKES = {60: 8.0, 61: 8.0, 110: 30.0, 150: 3.0, 175: 1000.0}

# ZClip's option -> ours.
ZCLIP_NAMES = {
    "alpha": "alpha",
    "z_thresh": "z",
    "max_grad_norm": "max_norm",
    "eps": "zscore_eps",
    "warmup_steps": "warmup",
    "mode": "mode",
    "clip_option": "clip_option",
    "clip_factor": "clip_factor",
    "skip_update_on_spike": "freeze_on_spike",
}

# ZClip's options for each run; ours are the same, renamed. {} is ZClip's defaults against ours.
RUNS = {
    "defaults": {},
    "zscore": dict(max_grad_norm=None),
    "zscore_mean": dict(clip_option="mean", max_grad_norm=None),
    "zscore_mean_capped": dict(clip_option="mean", max_grad_norm=1.0),
    "zscore_factor_frozen": dict(clip_factor=0.8, skip_update_on_spike=True, max_grad_norm=None),
    "percentile": dict(mode="percentile", max_grad_norm=None),
    "percentile_capped": dict(mode="percentile", max_grad_norm=1.0),
    "short_warmup": dict(alpha=0.9, z_thresh=2.0, warmup_steps=10, max_grad_norm=1.5, eps=1e-3),
}


def _ours(zclip_options: dict[str, Any]) -> dict[str, Any]:
    return {ZCLIP_NAMES[k]: v for k, v in zclip_options.items()}


class RecordingZClip(ZClip):
    """ZClip as shipped; it also keeps what each step clipped to and whether its spike rule fired."""

    def step(self, model: torch.nn.Module) -> float:
        self.clipped_to: float | None = self.max_grad_norm if not self.initialized else None
        self.spike = False
        return super().step(model)

    def _apply_clipping(self, model: torch.nn.Module, clip_val: float | None, total_norm: float) -> float:
        self.clipped_to = super()._apply_clipping(model, clip_val, total_norm)
        self.spike = clip_val is not None
        return self.clipped_to


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _norm_level(step: int) -> float:
    """About the step's global norm: drifting around 0.9, growing slowly, with SPIKES."""
    return 0.9 * (1 + 0.3 * math.sin(step / 7)) * (1 + step / 400) * SPIKES.get(step, 1.0)


def _set_grads(models: list[torch.nn.Module], step: int, nan: bool = False) -> None:
    g = torch.Generator().manual_seed(step)
    params = [list(m.parameters()) for m in models]
    numel = sum(p.numel() for p in params[0])
    for i, same in enumerate(zip(*params)):
        grad = torch.randn(same[0].shape, generator=g) * (_norm_level(step) / math.sqrt(numel))
        if nan and i == 0:
            grad.view(-1)[0] = math.nan
        for p in same:
            p.grad = grad.clone()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _compare_run(
    zclip_options: dict[str, Any], state_dtype: torch.dtype, nan_steps: frozenset[int] = frozenset()
) -> dict[str, Any]:
    """Runs ZClip on the steps not in ``nan_steps`` and ours on all; returns the largest differences seen."""
    ref_model, our_model = _model(), _model()
    zclip = RecordingZClip(**zclip_options)
    ours = _ours(zclip_options)
    warmup = zclip_options.get("warmup_steps", 25)
    state = init_clip_state(dtype=state_dtype)
    worst = {"threshold": 0.0, "grad": 0.0, "mean": 0.0, "var": 0.0}
    seen = {"spikes": 0, "capped": 0, "taken": 0}
    for step in range(STEPS):
        if step in nan_steps:
            _set_grads([our_model], step, nan=True)
            before = state
            stats = adaptive_clip_grad_norm_(our_model.parameters(), None, state, **ours)
            assert bool(stats.skip), f"step {step}: a NaN norm is a skipped step"
            assert all(torch.equal(a, b) for a, b in zip(stats.state, before)), f"step {step} moved the statistics"
            continue
        _set_grads([ref_model, our_model], step)
        total = zclip.step(ref_model)
        stats = adaptive_clip_grad_norm_(our_model.parameters(), None, state, **ours)
        state = stats.state
        assert _rel(float(stats.total_norm), total) <= TOL, (step, float(stats.total_norm), total)
        assert not bool(stats.skip), f"step {step}: skipped, and nothing asked for it"

        threshold = float(stats.threshold)
        if zclip.clipped_to is not None and total > zclip.clipped_to:  # ZClip clipped this step
            worst["threshold"] = max(worst["threshold"], _rel(threshold, zclip.clipped_to))
            seen["capped"] += zclip.initialized and not zclip.spike
        else:
            assert threshold >= total, f"step {step}: ZClip let {total} through, we clipped it to {threshold}"
        seen["spikes"] += zclip.spike

        for a, b in zip(our_model.parameters(), ref_model.parameters()):
            worst["grad"] = max(worst["grad"], float((a.grad - b.grad).abs().max() / b.grad.abs().max()))
        if zclip.initialized:
            assert int(state.count) >= warmup, f"step {step}: ZClip's warm-up is over, ours is not"
            worst["mean"] = max(worst["mean"], _rel(float(state.mean), zclip.mean))
            worst["var"] = max(worst["var"], _rel(float(state.var), zclip.var))
            seen["taken"] += 1
        else:
            assert int(state.count) < warmup, f"step {step}: our warm-up is over, ZClip's is not"
    return {"worst": worst, "seen": seen, "zclip": zclip}


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float64], ids=["state_fp32", "state_fp64"])
@pytest.mark.parametrize("run", list(RUNS), ids=list(RUNS))
def test_thresholds_clipped_grads_and_statistics_follow_zclip_step_by_step(run, state_dtype):
    zclip_options = RUNS[run]
    out = _compare_run(zclip_options, state_dtype)
    worst, seen = out["worst"], out["seen"]
    tol = TOL if state_dtype == torch.float64 else TOL_FP32_STATE
    assert all(v <= tol for v in worst.values()), worst
    warmup = zclip_options.get("warmup_steps", 25)
    assert seen["taken"] == STEPS - warmup + 1
    assert seen["spikes"] >= 4, f"the rule clipped {seen['spikes']} spikes: the run tests too little"
    if zclip_options.get("max_grad_norm", 1.0) is not None:
        assert seen["capped"] >= 10, f"the cap clipped {seen['capped']} steps after warm-up: too few to test it"


def test_a_nan_step_is_skipped_and_the_run_goes_on_as_zclip_without_it_where_zclip_stays_nan():
    nan_steps = frozenset({10, 120})  # one in warm-up, one after
    # ZClip on the steps without the NaNs is the reference for ours on the steps with them.
    ours = _compare_run({"max_grad_norm": None}, torch.float64, nan_steps)
    assert all(v <= TOL for v in ours["worst"].values()), ours["worst"]
    assert ours["seen"]["spikes"] >= 4

    # ZClip itself on the steps with the NaN after warm-up: NaN statistics for good, spikes no longer clipped.
    model, zclip, unclipped = _model(), RecordingZClip(max_grad_norm=None), []
    for step in range(STEPS):
        _set_grads([model], step, nan=step == 120)
        total = zclip.step(model)
        if step > 120 and step in SPIKES:
            unclipped.append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()) / total)
    assert math.isnan(zclip.mean) and math.isnan(zclip.var)
    assert unclipped and all(abs(r - 1) < 1e-5 for r in unclipped), unclipped
