"""The clip recorder: what it reads on the host later equals what a host-synced step reads, and it names a spike.

One process. A small model's gradients over 20 steps (a spike in one chosen
parameter at step SPIKE, a NaN at step NAN), clipped by the adaptive clip
with ``param_norms=index`` and ``skip_z``. The reference reads every value
on the host right after each step (``float``, ``bool``, ``tolist``); the
recorder reads nothing until the end. Every recorded field must equal the
reference's, and the anomalous steps must name the parameter spiked on
purpose. The 8-rank PP × FSDP2 × TP run of the same check is
``tests/test_demo_spike.py`` (the demo records its adaptive runs).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from ppclip_func import ClipRecorder, StepRecord, adaptive_clip_grad_norm_, init_clip_state, param_norm_index

STEPS = 20
SPIKE, NAN = 14, 17
SPIKED = "layers.1.mlp.w1"
CLIP = {"max_norm": 50.0, "warmup": 5, "skip_z": 12.0}
SHAPES = {
    "embed": (32, 8),
    "layers.0.attn.wq": (8, 8),
    "layers.0.mlp.w1": (16, 8),
    "layers.1.attn.wq": (8, 8),
    "layers.1.mlp.w1": (16, 8),
    "head": (8, 32),
}


def make_params() -> dict[str, torch.nn.Parameter]:
    return {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}


def set_grads(params: dict[str, torch.nn.Parameter], step: int, spike: str = SPIKED) -> None:
    """Noisy gradients of a steady size; ``spike``'s 30 times larger at SPIKE, a NaN in it at NAN."""
    gen = torch.Generator().manual_seed(step)
    for name, p in params.items():
        g = torch.randn(p.shape, generator=gen) * (1.0 + 0.05 * torch.rand((), generator=gen))
        if name == spike and step == SPIKE:
            g = g * 30.0
        if name == spike and step == NAN:
            g[0, 0] = math.nan
        p.grad = g


def run(recorder: ClipRecorder, params, index, step_fn=None) -> list[dict]:
    """Trains STEPS steps; returns what the host read right after each step (the reference)."""
    state = init_clip_state()
    reference = []
    for step in range(STEPS):
        set_grads(params, step)
        stats = adaptive_clip_grad_norm_(params, None, state, param_norms=index, **CLIP)
        state = stats.state
        recorder.record(stats)
        reference.append(
            {
                "total": float(stats.total_norm),
                "threshold": float(stats.threshold),
                "zscore": float(stats.zscore),
                "skipped": bool(stats.skip),
                "param_norms": dict(zip(index.names, stats.param_norms.tolist())),
            }
        )
    return reference


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.fixture(scope="module")
def recorded() -> tuple[list[StepRecord], list[dict]]:
    params = make_params()
    index = param_norm_index(params, None)
    recorder = ClipRecorder(index, top_k=2, warmup=5)
    reference = run(recorder, params, index)
    recorder.flush()
    return recorder.read(), reference


def test_every_record_equals_what_the_host_read_after_its_step(recorded):
    records, reference = recorded
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    for r, ref in zip(records, reference):
        for field in ("total", "threshold", "zscore"):
            assert same(getattr(r, field), ref[field]), (r.step, field, getattr(r, field), ref[field])
        assert r.skipped == ref["skipped"]
        assert list(r.param_norms) == list(ref["param_norms"])
        assert all(same(r.param_norms[n], v) for n, v in ref["param_norms"].items()), r.step
        want_coef = min(ref["threshold"] / (ref["total"] + 1e-6), 1.0)
        assert same(r.clip_coef, want_coef) or r.clip_coef == pytest.approx(want_coef, rel=1e-15), r.step
        assert r.clipped == (r.clip_coef < 1.0 and not r.skipped)


def test_the_spike_is_caught_and_the_parameter_spiked_on_purpose_is_named_first(recorded):
    records, _ = recorded
    at = records[SPIKE]
    assert at.anomalous, at
    assert at.spiked[0]["name"] == SPIKED, at.spiked
    assert at.spiked[0]["zscore"] > 10 * at.spiked[1]["zscore"], at.spiked
    assert at.spiked[0]["norm"] == at.param_norms[SPIKED]
    nan_step = records[NAN]
    assert nan_step.skipped and math.isnan(nan_step.total)
    # Every other step is ordinary: nothing named.
    ordinary = [r for i, r in enumerate(records) if i not in (SPIKE, NAN)]
    assert all(not r.anomalous and r.spiked == [] for r in ordinary), [r for r in ordinary if r.anomalous]


def test_another_spiked_parameter_is_named_instead():
    """Not a fixed answer: spike another parameter and it is the one named."""
    params = make_params()
    index = param_norm_index(params, None)
    recorder = ClipRecorder(index, top_k=1, warmup=5)
    state = init_clip_state()
    for step in range(SPIKE + 1):
        set_grads(params, step, spike="embed")
        stats = adaptive_clip_grad_norm_(params, None, state, param_norms=index, **CLIP)
        state = stats.state
        recorder.record(stats)
    recorder.flush()
    assert [s["name"] for s in recorder.read()[SPIKE].spiked] == ["embed"]


def test_metrics_are_flat_scalars_named_for_a_logger(recorded):
    records, _ = recorded
    metrics = records[3].metrics()
    assert metrics["grad_norm/total"] == records[3].total
    assert metrics[f"grad_norm/{SPIKED}"] == records[3].param_norms[SPIKED]
    assert {"grad_norm/threshold", "grad_norm/zscore", "grad_norm/clip_coef", "grad_norm/skipped"} <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())
    assert len(metrics) == 6 + len(SHAPES)


def test_read_appends_json_lines_and_returns_only_new_records(tmp_path):
    params = make_params()
    index = param_norm_index(params, None)
    path = tmp_path / "clip.jsonl"
    recorder = ClipRecorder(index, path=path)
    state = init_clip_state()
    got = []
    for step in range(6):
        set_grads(params, step)
        stats = adaptive_clip_grad_norm_(params, None, state, param_norms=index, **CLIP)
        state = stats.state
        recorder.record(stats)
        recorder.flush()
        got.append([r.step for r in recorder.read()])
    assert got == [[1], [2], [3], [4], [5], [6]]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 7))
    assert set(lines[0]) == {
        "step",
        "total",
        "threshold",
        "zscore",
        "clip_coef",
        "clipped",
        "skipped",
        "param_norms",
        "spiked",
    }
    assert list(lines[0]["param_norms"]) == list(index.names)


def test_a_plain_clip_records_its_norm_and_threshold():
    from ppclip_func import clip_grad_norm_

    w = torch.nn.Parameter(torch.zeros(4))
    recorder = ClipRecorder()
    for value in (0.1, 3.0):
        w.grad = torch.full((4,), value)
        recorder.record(clip_grad_norm_([w], None, 1.0), threshold=1.0)
    recorder.flush()
    small, large = recorder.read()
    assert (small.clipped, large.clipped) == (False, True)
    assert large.total == pytest.approx(6.0) and large.param_norms is None and large.spiked == []
    assert math.isnan(small.zscore)


def test_more_steps_than_the_ring_holds_between_reads_warns_and_keeps_the_last():
    recorder = ClipRecorder(capacity=4)
    recorder.read()
    for i in range(10):
        recorder.record(torch.tensor(float(i), dtype=torch.float64))
    recorder.flush()
    with pytest.warns(RuntimeWarning, match="6 steps were recorded and dropped"):
        records = recorder.read()
    assert [r.step for r in records] == [7, 8, 9, 10] and [r.total for r in records] == [6.0, 7.0, 8.0, 9.0]


def test_the_statistics_are_saved_and_restored_by_name():
    params = make_params()
    index = param_norm_index(params, None)
    recorder = ClipRecorder(index)
    state = init_clip_state()
    for step in range(8):
        set_grads(params, step)
        stats = adaptive_clip_grad_norm_(params, None, state, param_norms=index, **CLIP)
        state = stats.state
        recorder.record(stats)
    saved = recorder.state_dict()
    reversed_index = param_norm_index(dict(reversed(list(params.items()))), None)
    resumed = ClipRecorder(reversed_index)
    storage = resumed.stats.mean.data_ptr()
    resumed.load_state_dict(saved)
    assert resumed.stats.mean.data_ptr() == storage
    assert int(resumed.stats.count) == 8 and resumed.state_dict()["steps"] == 8
    for name in index.names:
        assert torch.equal(resumed.state_dict()["mean"][name], saved["mean"][name])
        assert torch.equal(resumed.state_dict()["var"][name], saved["var"][name])
    with pytest.raises(ValueError, match=r"missing \['embed'\]"):
        ClipRecorder(index).load_state_dict({**saved, "mean": {k: v for k, v in saved["mean"].items() if k != "embed"}})


def test_a_step_without_the_index_norms_is_refused_naming_param_norms():
    params = make_params()
    recorder = ClipRecorder(param_norm_index(params, None))
    for p in params.values():
        p.grad = torch.ones(p.shape)
    stats = adaptive_clip_grad_norm_(params, None, init_clip_state(), max_norm=1.0)
    with pytest.raises(ValueError, match="param_norms=index"):
        recorder.record(stats)


def test_a_compiled_step_records_what_the_eager_step_records():
    """The record inside a compiled step that returns nothing, against the same steps run eagerly."""

    def records(compiled: bool) -> list[StepRecord]:
        torch._dynamo.reset()
        params = make_params()
        index = param_norm_index(params, None)
        recorder = ClipRecorder(index, top_k=2, warmup=5)
        state = [init_clip_state()]

        def step() -> None:
            stats = adaptive_clip_grad_norm_(params, None, state[0], param_norms=index, **CLIP)
            state[0] = stats.state
            recorder.record(stats)

        fn = torch.compile(step, fullgraph=True) if compiled else step
        for i in range(STEPS):
            set_grads(params, i)
            fn()
        recorder.flush()
        torch._dynamo.reset()
        return recorder.read()

    want, got = records(False), records(True)
    for a, b in zip(got, want):
        assert (a.step, a.clipped, a.skipped, [s["name"] for s in a.spiked]) == (
            b.step, b.clipped, b.skipped, [s["name"] for s in b.spiked],
        )  # fmt: skip
        for x, y in [
            (a.total, b.total),
            (a.threshold, b.threshold),
            *zip(a.param_norms.values(), b.param_norms.values()),
        ]:
            assert same(x, y) or x == pytest.approx(y, rel=1e-6), (a.step, x, y)
