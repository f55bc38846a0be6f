"""``python -m bench.quality_study --quick`` trains every clip rule on the standard library and reports it right.

The quick form is one peak rate (1e-1), one seed and a smaller model (2
layers, width 64, context 64, 150 steps), every rule of the full study,
one thread; about 15 s here. Its losses say nothing about which rule is
better; what must hold whatever they are is checked exactly: the JSON's
fields, finite losses that fall, clip and skip counts that follow from the
recorded norms and each rule's definition, and the official ZClip package
and our adaptive clip making the same decision at every step on the same
gradients.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import pytest

from tests._processes import WHOLE_COMMANDS, python, run_bounded

TIMEOUT_S = 300
RULES = ("none", "fixed", "zclip", "zclip_skip", "adagc", "zclip_pkg")

pytestmark = WHOLE_COMMANDS  # each test runs a whole command


@pytest.fixture(scope="module")
def quality(tmp_path_factory) -> tuple[dict, pathlib.Path]:
    out = tmp_path_factory.mktemp("quality")
    cmd = [python(), "-m", "bench.quality_study", "--quick", "--out", str(out)]
    code, log, leftovers = run_bounded(cmd, TIMEOUT_S)
    assert not leftovers, f"processes left behind: {leftovers}"
    assert code is not None, f"quality_study --quick did not finish within {TIMEOUT_S} s:\n{log[-4000:]}"
    assert code == 0, f"quality_study --quick exited with {code}:\n{log[-6000:]}"
    return json.loads((out / "quality.json").read_text()), out


def _runs(data: dict) -> dict[str, dict]:
    return {r["rule"]: r for r in data["runs"]}


def test_the_json_says_what_was_run_on_what(quality):
    data, out = quality
    assert data["study"] == "quality" and data["quick"] is True
    corpus = data["corpus"]
    assert len(corpus["sha256"]) == 64 and corpus["files"] > 50 and corpus["heldout_files"] > 5
    assert corpus["bytes"] > 1_000_000 and corpus["train_bytes"] > 5 * corpus["heldout_bytes"]
    assert data["rules"] == list(RULES)
    assert "joint_loss_norm_skip" in data["not_available"]
    assert set(data["rules_fixed_in_advance"]) >= {"spike", "diverged", "clipped"}
    assert data["config"]["parameters"] > 50_000
    assert sorted(_runs(data)) == sorted(RULES) and len(data["runs"]) == len(RULES)
    assert [(r["lr"], r["rule"]) for r in data["rows"]] == [(data["lrs"][0], rule) for rule in RULES]
    assert data["table_md"].count("\n") == len(RULES) + 1
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "quality.png").stat().st_size > 10_000


def test_every_run_trains_with_finite_losses_that_fall(quality):
    data, _ = quality
    steps = data["config"]["steps"]
    for r in data["runs"]:
        where = f"{r['rule']} lr {r['lr']}"
        assert r["stopped_at"] is None and not r["diverged"], where
        assert len(r["loss"]) == len(r["norm"]) == len(r["clipped"]) == len(r["skipped"]) == steps, where
        assert all(math.isfinite(v) for v in r["loss"] + r["norm"]), where
        held = [v for _, v in r["evals"]]
        assert all(math.isfinite(v) for v in held), where
        assert r["evals"][0][0] == 0 and r["evals"][-1][0] == steps, where
        assert abs(held[0] - math.log(256)) < 0.1, f"{where}: an untrained model's loss is about ln 256"
        assert r["final_heldout"] == held[-1] < held[0] - 1.0, f"{where}: the held-out loss did not fall"
        assert r["step_ms"] > 0 and r["clip_ms"] >= 0, where


def test_clip_and_skip_counts_follow_from_the_norms_and_each_rule(quality):
    data, _ = quality
    runs = _runs(data)
    for r in data["runs"]:
        assert r["clipped_steps"] == sum(r["clipped"]) and r["skipped_steps"] == sum(r["skipped"]), r["rule"]
        assert r["rule"] == "zclip_skip" or r["skipped_steps"] == 0, f"{r['rule']} skipped a step"
    assert runs["none"]["clipped_steps"] == 0
    fixed = runs["fixed"]
    assert fixed["clipped"] == [n > 1.0 for n in fixed["norm"]]
    assert 0 < fixed["clipped_steps"] < len(fixed["norm"]), "the fixed threshold must both clip and let through"
    # ZClip's warm-up (25 steps) and AdaGC's (100) are the global clip at max_norm=1.0.
    for rule, warmup in (("zclip", 25), ("zclip_skip", 25), ("zclip_pkg", 25), ("adagc", 100)):
        r = runs[rule]
        assert r["clipped"][:warmup] == [n > 1.0 for n in r["norm"][:warmup]], rule
    # A skipped step is a spike (z-score above 6 is above 2.5): clipped too.
    skip = runs["zclip_skip"]
    assert all(c for c, s in zip(skip["clipped"], skip["skipped"]) if s)
    # ZClip's threshold is capped at max_norm=1.0: whatever the fixed clip lets through after warm-up can be clipped,
    # but a norm above 1.0 is always clipped.
    for rule in ("zclip", "zclip_skip", "zclip_pkg"):
        r = runs[rule]
        assert all(c for n, c in zip(r["norm"], r["clipped"]) if n > 1.0 + 1e-6), rule
    # AdaGC clips per parameter after its warm-up: more steps than the global clip's norm alone would.
    assert runs["adagc"]["clipped_steps"] > sum(n > 1.0 for n in runs["adagc"]["norm"])


def test_the_official_zclip_and_ours_make_the_same_decision_at_every_step(quality):
    data, _ = quality
    row = next(r for r in data["rows"] if r["rule"] == "zclip_pkg")
    agreement = row["zclip_agreement"]
    assert agreement["steps"] == data["config"]["steps"]
    assert agreement["disagree"] == 0, agreement
    assert agreement["both_clipped"] >= 10, f"too few clipped steps to compare: {agreement}"
    assert agreement["threshold_rel_max"] < 1e-5 and agreement["norm_rel_max"] < 1e-5, agreement
    # The two separate runs start alike: the same decisions until rounding in the norms parts them.
    (apart,) = row["zclip_runs_apart"]
    assert apart["loss_apart_at"] is None or apart["loss_apart_at"] >= 2
    assert apart["same_decisions_first"] >= 25, apart
