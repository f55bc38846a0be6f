"""Does it help: the clip rules compared on a real training run (``make bench-quality``; not in ``python -m bench``).

A byte-level decoder-only transformer (``bench/_quality_model.py``: 4
layers, width 128, 4 heads, context 128, 0.88 M parameters) trained from
scratch on the standard library's own top-level modules, read from the
interpreter's installation (4.7 MB on Python 3.11; size and SHA-256 in the
JSON), every tenth file held out. Why this size: it is the issue's probe,
a step takes 0.16 s on one idle core (0.2-0.33 s while other jobs share the
2 cores), so 400-step runs, two one-thread runs at a time, fit the study
in about 45 minutes; 0.9 M parameters over 4.0 MB of training bytes is far
from memorising them. Batch 16, 400 steps (2048 tokens a step, 0.8 M
tokens, about a fifth of an epoch), AdamW (betas 0.9 and 0.95, eps 1e-8,
weight decay 0.1 on the matrices and embeddings), a linear warm-up over 5 %
of the steps then cosine decay to 0.1 of the peak, the same for every
rule. For a seed, every rule starts from the same weights and sees the
same batches in the same order; fp32, one thread a run.

The rules, each through the package's public API on one process
(``mesh=None``), defaults as shipped unless said:

* ``none``: no clipping (the norm is measured, outside the timed step);
* ``fixed``: ``clip_grad_norm_(..., max_norm=1.0)``;
* ``zclip``: ``adaptive_clip_grad_norm_`` with its defaults, ZClip's
  (z 2.5, alpha 0.97, warm-up 25, cap ``max_norm=1.0``);
* ``zclip_skip``: the same with ``skip_z=6.0`` (the spike demo's), the
  update applied through ``skip_update_`` (parameters and AdamW state put
  back on a skipped step);
* ``adagc``: ``adagc_clip_grad_norm_`` with ``param_norm_index`` and its
  defaults (``max_norm=1.0``, relative 1.04, beta 0.99, warm-up 100);
* ``zclip_pkg``: the official ``zclip==1.0.0``, ``ZClip()`` with its
  defaults, ``zclip.step(model)`` after backward as its README does. In the
  same run our adaptive clip is computed beside it, pure
  (``adaptive_clip_grad_norm`` on the same grads, its result not applied),
  so the two decisions are compared step by step on the same gradients;
* the joint loss + norm skip (skip a step when both the loss and the norm
  spike) does not exist in the package yet: not run, listed as such.

Where ZClip and ours are not defined alike, by design: a non-finite norm
(ZClip takes it into its statistics, which stay NaN; ours skip the step
and keep them), and ``zclip_skip`` (ZClip's ``skip_update_on_spike`` only
freezes its statistics; it never skips an optimizer step, so it has no
counterpart there).

What is reported, by these rules, fixed before the full study was run:

* held-out loss (nats a byte, 24 fixed windows of the held-out files) at
  the end, and its mean over the run's evaluations (every 25 steps, step 0
  left out);
* loss spikes: a step, after the first 20, whose training loss is above
  1.3 times the median of the 20 training losses before it (or is not
  finite), bad batches left out of both; a spike event is a run of
  consecutive spike steps, counted once;
* divergence: a non-finite training loss (the run stops there), or a final
  held-out loss at or above the held-out loss at step 0;
* steps clipped (the total norm above the threshold the rule used; for
  AdaGC, any parameter's coefficient below 1) and steps skipped;
* wall time per step (forward, backward, clip, optimizer step) against
  ``none``'s, run by run with the same learning rate and seed, and the
  clip call alone, in ms: two runs share the 2 cores, so these are
  rough;
* ZClip against the package: steps where the two decisions (clip or not)
  differ, the largest relative difference of the threshold where both
  clip; the final held-out loss of ``zclip`` and ``zclip_pkg`` against the
  spread over seeds.

Summaries are medians over the seeds (3, seeds 0, 1, 2), with the min-max.

The search (``--search``; ``make bench-quality`` runs it first, its runs
and choice in the JSON): the issue's probe (5 % warm-up, 300 steps) found no
spike up to a peak rate of 1e-1. The search trains ``none`` only (no clip
rule is looked at), seed 0, 400 steps, rates {1e-2, 3e-2, 1e-1, 3e-1}, in
stages: (A) 5 % warm-up, (B) no warm-up, and, only where A and B show no
instability, (C) 5 % warm-up with bad data: at steps 100, 150, 200, 250 and
300 the batch is replaced by 16 windows of uniformly random bytes (binary
junk such as a crawl lets into a corpus; seeded, the same for every rule of
a seed; the clean batch of that step is dropped, so the data order is
otherwise the same). A bad batch's own loss is the junk's, so the spike rule
counts clean steps only (and its running median is of clean steps). Rule:
the study takes the first stage under which ``none`` is unstable (one spike
event or more, or divergence) at some rate of the grid; with ``r`` the
lowest such rate, its rates are the grid's rate below ``r``, ``r`` and the
rate above (the three lowest or highest at an end of the grid); the
picture and the package's runs are at ``r``. If no stage gives instability, the study runs
stage C's setting at the three highest rates and says that none was found.
Stages A and B, as run: no spike and no divergence at any rate
(held-out 2.51, 2.69, 2.82, 3.12 with warm-up, 2.57, 2.79, 2.89, 2.98
without), so the rates where the rules differ, if anywhere, are in stage
C. Stage C, as run: ``none`` spiked at every rate (1, 1, 3 and 6 spike
events at 1e-2, 3e-2, 1e-1, 3e-1), so ``r`` = 1e-2 and the study's rates
are 1e-2, 3e-2 and 1e-1. To keep the study near 45 minutes, ``zclip_pkg`` runs at ``r`` only (3
seeds; at every rate it would add 6 runs).

    python -m bench.quality_study            # search, then the study: bench/results/quality.{json,png}
    python -m bench.quality_study --search   # the search alone
    python -m bench.quality_study --quick    # one rate, one seed, a smaller model: under a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

from bench import _report
from bench._quality_model import Corpus, ModelConfig, TinyGPT, load_corpus, windows
from bench._timing import machine

RULES = ("none", "fixed", "zclip", "zclip_skip", "adagc", "zclip_pkg")
NOT_AVAILABLE = {"joint_loss_norm_skip": "not in the package yet: not run"}
SEARCH_WARMUPS = (0.05, 0.0)
SEARCH_LRS = (1e-2, 3e-2, 1e-1, 3e-1)
SEEDS = (0, 1, 2)
SKIP_Z = 6.0
FIXED_MAX_NORM = 1.0
SPIKE_WINDOW = 20
SPIKE_FACTOR = 1.3


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    steps: int = 400
    batch: int = 16
    warmup: float = 0.05  # fraction of the steps
    min_lr: float = 0.1  # of the peak, at the end of the cosine
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eval_every: int = 25
    eval_windows: int = 24
    # Where a batch of bad data replaces the step's batch, as fractions of the run (the search's stage C).
    bad_batches: tuple[float, ...] = ()

    def bad_steps(self) -> frozenset[int]:
        return frozenset(round(f * self.steps) for f in self.bad_batches)


BAD_BATCHES = (0.25, 0.375, 0.5, 0.625, 0.75)  # steps 100, 150, 200, 250, 300 of 400
QUICK = TrainConfig(
    model=ModelConfig(layers=2, width=64, heads=4, context=64), steps=150, batch=8, bad_batches=BAD_BATCHES
)


def lr_at(step: int, peak: float, cfg: TrainConfig) -> float:
    warm = round(cfg.warmup * cfg.steps)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm - 1)
    return peak * (cfg.min_lr + (1 - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


_CORPUS: Corpus | None = None


def _corpus() -> Corpus:
    global _CORPUS
    if _CORPUS is None:
        _CORPUS = load_corpus()
    return _CORPUS


def _recording_zclip():
    from zclip import ZClip

    class RecordingZClip(ZClip):
        """ZClip as shipped; it also keeps what each step clipped to (as tests/test_zclip_reference.py)."""

        def step(self, model):
            self.clipped_to = self.max_grad_norm if not self.initialized else None
            return super().step(model)

        def _apply_clipping(self, model, clip_val, total_norm):
            self.clipped_to = super()._apply_clipping(model, clip_val, total_norm)
            return self.clipped_to

    return RecordingZClip()


def _optimizer(model: TinyGPT, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.0, betas=cfg.betas, eps=1e-8)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def train(rule: str, lr: float, seed: int, cfg: TrainConfig) -> dict[str, Any]:
    """One run of ``rule`` at peak ``lr``; every per-step record and the run's summary."""
    import ppclip_func as pc

    corpus = _corpus()
    ctx = cfg.model.context
    torch.manual_seed(seed)
    model = TinyGPT(cfg.model)
    named = dict(model.named_parameters())
    params = list(named.values())
    opt = _optimizer(model, cfg)
    data = torch.Generator().manual_seed(10_000 + seed)
    eval_starts = torch.linspace(0, len(corpus.heldout) - ctx - 2, cfg.eval_windows).long()
    eval_batch = windows(corpus.heldout, eval_starts, ctx)

    clip_state = pc.init_clip_state()
    index = pc.param_norm_index(named, None) if rule == "adagc" else None
    adagc_state = pc.init_adagc_state(index) if index is not None else None
    zc = _recording_zclip() if rule == "zclip_pkg" else None
    agree = {"steps": 0, "disagree": 0, "both_clipped": 0, "threshold_rel": 0.0, "norm_rel": 0.0, "first": None}

    def heldout() -> float:
        with torch.no_grad():
            return float(model.loss(eval_batch))

    rec: dict[str, list] = {"loss": [], "norm": [], "clipped": [], "skipped": [], "step_s": [], "clip_s": []}
    evals = [(0, heldout())]
    stopped = None
    bad = cfg.bad_steps()
    for step in range(cfg.steps):
        starts = torch.randint(0, len(corpus.train) - ctx - 1, (cfg.batch,), generator=data)
        batch = windows(corpus.train, starts, ctx)
        if step in bad:  # junk: uniformly random bytes, the same for every rule of a seed; the clean batch is dropped
            junk = torch.Generator().manual_seed(20_000 + 1000 * seed + step)
            batch = torch.randint(0, 256, batch.shape, generator=junk, dtype=torch.uint8)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, cfg)
        t0 = time.perf_counter()
        loss = model.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        c0 = time.perf_counter()
        skip = None
        if rule == "none":
            norm = clipped = None
        elif rule == "fixed":
            norm = pc.clip_grad_norm_(named, None, max_norm=FIXED_MAX_NORM)
            clipped = norm > FIXED_MAX_NORM
        elif rule in ("zclip", "zclip_skip"):
            stats = pc.adaptive_clip_grad_norm_(
                named, None, clip_state, skip_z=SKIP_Z if rule == "zclip_skip" else None
            )
            clip_state, norm, skip = stats.state, stats.total_norm, stats.skip
            clipped = norm > stats.threshold
        elif rule == "adagc":
            stats = pc.adagc_clip_grad_norm_(named, None, adagc_state, index)
            adagc_state, norm, skip = stats.state, stats.total_norm, stats.skip
            clipped = (stats.coefficients < 1.0).any()
        elif rule == "zclip_pkg":
            # Ours beside it, pure, on the same grads: the decision it would make; nothing applied.
            _, ours = pc.adaptive_clip_grad_norm({n: p.grad for n, p in named.items()}, None, clip_state)
            clip_state = ours.state
            norm = zc.step(model)
            theirs = zc.clipped_to is not None and norm > zc.clipped_to
            mine = bool(ours.total_norm > ours.threshold)
            clipped = theirs
        else:
            raise ValueError(f"unknown rule {rule!r}")
        c1 = time.perf_counter()
        if skip is not None and rule == "zclip_skip":
            state = [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
            pc.skip_update_(skip, params + state, opt.step)
        else:
            opt.step()
        t1 = time.perf_counter()
        if rule == "none":
            with torch.no_grad():
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        loss_v, norm_v = float(loss.detach()), float(norm)
        if rule == "zclip_pkg":
            agree["steps"] += 1
            if mine != theirs:
                agree["disagree"] += 1
                agree["first"] = step if agree["first"] is None else agree["first"]
            if mine and theirs:
                agree["both_clipped"] += 1
                agree["threshold_rel"] = max(agree["threshold_rel"], _rel(float(ours.threshold), zc.clipped_to))
            agree["norm_rel"] = max(agree["norm_rel"], _rel(float(ours.total_norm), norm_v))
        rec["loss"].append(loss_v)
        rec["norm"].append(norm_v)
        rec["clipped"].append(bool(clipped) if clipped is not None else False)
        rec["skipped"].append(bool(skip) if skip is not None and rule == "zclip_skip" else False)
        rec["step_s"].append(t1 - t0)
        rec["clip_s"].append(c1 - c0)
        if not math.isfinite(loss_v):
            stopped = step
            break
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            evals.append((step + 1, heldout()))
    out = {"rule": rule, "lr": lr, "seed": seed, "warmup": cfg.warmup, "steps": cfg.steps, "stopped_at": stopped}
    out["bad_steps"] = sorted(bad)
    out.update(rec)
    out["evals"] = evals
    if rule == "zclip_pkg":
        out["agreement"] = agree
    out.update(summarize_run(out))
    return out


def spikes(losses: list[float], bad: frozenset[int] | set[int] = frozenset()) -> tuple[int, int]:
    """(spike steps, spike events) by the module's rule, on the clean steps (a bad batch's own loss is the junk's)."""
    steps = events = 0
    prev = False
    clean = [(t, v) for t, v in enumerate(losses) if t not in bad]
    for i in range(SPIKE_WINDOW, len(clean)):
        v = clean[i][1]
        ref = statistics.median(u for _, u in clean[i - SPIKE_WINDOW : i])
        spike = not math.isfinite(v) or v > SPIKE_FACTOR * ref
        steps += spike
        events += spike and not prev
        prev = spike
    return steps, events


def summarize_run(run: dict) -> dict:
    spike_steps, spike_events = spikes(run["loss"], set(run["bad_steps"]))
    first, final = run["evals"][0][1], run["evals"][-1][1]
    later = [v for s, v in run["evals"][1:]]
    diverged = run["stopped_at"] is not None or not math.isfinite(final) or final >= first
    return {
        "final_heldout": final if run["stopped_at"] is None else math.inf,
        "mean_heldout": statistics.fmean(later) if later and run["stopped_at"] is None else math.inf,
        "spike_steps": spike_steps,
        "spike_events": spike_events,
        "diverged": diverged,
        "clipped_steps": sum(run["clipped"]),
        "skipped_steps": sum(run["skipped"]),
        "step_ms": 1e3 * statistics.median(run["step_s"]),
        "clip_ms": 1e3 * statistics.median(run["clip_s"]),
    }


def _worker_init() -> None:
    torch.set_num_threads(1)


def _run_task(task: tuple[str, float, int, TrainConfig]) -> dict:
    return train(*task)


def run_all(tasks: list[tuple[str, float, int, TrainConfig]], workers: int, label: str) -> list[dict]:
    """Runs ``tasks`` on ``workers`` one-thread processes (in this one with ``workers=1``), showing progress."""
    results, t0 = [], time.perf_counter()

    def show(r: dict) -> None:
        results.append(r)
        done, el = len(results), time.perf_counter() - t0
        eta = el / done * (len(tasks) - done)
        print(
            f"[{label} {done}/{len(tasks)} {el / 60:.1f} min, ~{eta / 60:.1f} left] {r['rule']:<10} lr {r['lr']:g} "
            f"seed {r['seed']} warm-up {r['warmup']:.0%}: held-out {r['final_heldout']:.3f}, "
            f"spikes {r['spike_events']}, clipped {r['clipped_steps']}, skipped {r['skipped_steps']}, "
            f"{r['step_ms']:.0f} ms/step" + (" DIVERGED" if r["diverged"] else ""),
            flush=True,
        )

    if workers <= 1:
        _worker_init()
        for t in tasks:
            show(_run_task(t))
    else:
        with multiprocessing.get_context("spawn").Pool(workers, initializer=_worker_init) as pool:
            for r in pool.imap_unordered(_run_task, tasks):
                show(r)
    return results


def _choose(runs: list[dict], stages: list[float | str]) -> dict | None:
    """The module's rule: the first stage under which ``none`` is unstable at some rate; that rate, one below, one above."""
    unstable = lambda r: r["spike_events"] > 0 or r["diverged"]  # noqa: E731
    for stage in stages:
        bad = sorted(r["lr"] for r in runs if _stage(r) == stage and unstable(r))
        if bad:
            i = SEARCH_LRS.index(bad[0])
            lo = max(0, min(i - 1, len(SEARCH_LRS) - 3))
            return {"stage": stage, "lrs": list(SEARCH_LRS[lo : lo + 3]), "telling_lr": bad[0], "found": True}
    return None


def replace_warmup(cfg: TrainConfig, warmup: float) -> TrainConfig:
    return dataclasses.replace(cfg, warmup=warmup)


def _stage(r: dict) -> float | str:
    return "bad_data" if r.get("bad_steps") else r["warmup"]


def search(workers: int, cfg: TrainConfig, previous: dict | None = None) -> dict:
    """The stated search: ``none`` only, seed 0, stage by stage; the study's setting by the module's rule.

    ``previous``: a search already run (its stages A and B are not run again)."""
    if previous is None:
        tasks = [("none", lr, 0, dataclasses.replace(cfg, warmup=w)) for w in SEARCH_WARMUPS for lr in SEARCH_LRS]
        runs = run_all(tasks, workers, "search A-B")
    else:
        runs = [r for r in previous["runs"] if not r.get("bad_steps")]
    chosen = _choose(runs, list(SEARCH_WARMUPS))
    full = []
    if chosen is None:  # stage C: the same grid, 5 % warm-up, with batches of bad data
        tasks = [("none", lr, 0, dataclasses.replace(cfg, bad_batches=BAD_BATCHES)) for lr in SEARCH_LRS]
        full = run_all(tasks, workers, "search C")
        runs += full
        chosen = _choose(runs, ["bad_data"])
    if chosen is None:
        chosen = {"stage": "bad_data", "lrs": list(SEARCH_LRS[-3:]), "telling_lr": SEARCH_LRS[-1], "found": False}
    return {
        "grid": {"stages": [*SEARCH_WARMUPS, "bad_data"], "lrs": list(SEARCH_LRS), "rule": "none", "seed": 0},
        "runs": [_brief(r) for r in runs],
        "chosen": chosen,
        "_full": full,
    }


def _brief(r: dict) -> dict:
    keys = (
        "rule",
        "lr",
        "seed",
        "warmup",
        "bad_steps",
        "final_heldout",
        "mean_heldout",
        "spike_events",
        "spike_steps",
        "diverged",
    )
    return {k: r.get(k) for k in keys}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (rate, rule): medians over seeds, min-max, counts, time against ``none``."""
    rows = []
    by = {(r["lr"], r["rule"], r["seed"]): r for r in runs}
    for lr in sorted({r["lr"] for r in runs}):
        for rule in RULES:
            rs = [r for r in runs if r["lr"] == lr and r["rule"] == rule]
            if not rs:
                continue
            ratios = [
                r["step_ms"] / by[(lr, "none", r["seed"])]["step_ms"] for r in rs if (lr, "none", r["seed"]) in by
            ]
            finals = [r["final_heldout"] for r in rs]
            row = {
                "lr": lr,
                "rule": rule,
                "seeds": len(rs),
                "final_heldout": _median(finals),
                "final_min": min(finals),
                "final_max": max(finals),
                "mean_heldout": _median([r["mean_heldout"] for r in rs]),
                "spike_events": sum(r["spike_events"] for r in rs),
                "runs_with_spikes": sum(r["spike_events"] > 0 for r in rs),
                "diverged": sum(r["diverged"] for r in rs),
                "clipped_steps": _median([r["clipped_steps"] for r in rs]),
                "skipped_steps": _median([r["skipped_steps"] for r in rs]),
                "step_vs_none": _median(ratios),
                "clip_ms": _median([r["clip_ms"] for r in rs]),
            }
            if rule == "zclip_pkg":
                ag = [r["agreement"] for r in rs]
                row["zclip_agreement"] = {
                    "steps": sum(a["steps"] for a in ag),
                    "disagree": sum(a["disagree"] for a in ag),
                    "both_clipped": sum(a["both_clipped"] for a in ag),
                    "threshold_rel_max": max(a["threshold_rel"] for a in ag),
                    "norm_rel_max": max(a["norm_rel"] for a in ag),
                }
                row["zclip_runs_apart"] = [_runs_apart(by.get((lr, "zclip", r["seed"])), r) for r in rs]
            rows.append(row)
    return rows


def _runs_apart(ours: dict | None, theirs: dict) -> dict | None:
    """Where our ``zclip`` run and the package's run of the same seed part: the first step whose training
    loss differs by more than 1e-6 (relative), and the steps with the same clip decision before the first
    that differs (rounding in the two norms makes the runs drift apart; the decisions on the same
    gradients are compared in ``zclip_agreement``)."""
    if ours is None:
        return None
    a, b = ours["loss"], theirs["loss"]
    n = min(len(a), len(b))
    loss_apart = next((t for t in range(n) if _rel(a[t], b[t]) > 1e-6), None)
    same = next((t for t in range(n) if ours["clipped"][t] != theirs["clipped"][t]), n)
    return {"seed": theirs["seed"], "loss_apart_at": loss_apart, "same_decisions_first": same, "steps": n}


def table(rows: list[dict]) -> str:
    lines = [
        "| peak lr | rule | held-out end, median (min-max) | held-out over the run | spike events (runs) "
        "| diverged | clipped | skipped | step vs none | clip ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | `{r['rule']}` | {r['final_heldout']:.3f} ({r['final_min']:.3f}-{r['final_max']:.3f}) "
            f"| {r['mean_heldout']:.3f} | {r['spike_events']} ({r['runs_with_spikes']}/{r['seeds']}) "
            f"| {r['diverged']}/{r['seeds']} | {r['clipped_steps']:g} | {r['skipped_steps']:g} "
            f"| {r['step_vs_none']:.2f} | {r['clip_ms']:.2f} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], lr: float, cfg: TrainConfig, path: pathlib.Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture")
        return False
    fig, (ax_train, ax_held) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(RULES, ("black", "tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple")))
    for rule in RULES:
        rs = [r for r in runs if r["rule"] == rule and r["lr"] == lr]
        if not rs:
            continue
        n = cfg.steps
        curves = [r["loss"] + [math.nan] * (n - len(r["loss"])) for r in rs]
        per_step = list(zip(*curves))
        med = [statistics.median(v) for v in per_step]
        lo, hi = [min(v) for v in per_step], [max(v) for v in per_step]
        xs = range(1, n + 1)
        ax_train.plot(xs, med, color=colors[rule], lw=0.8, label=rule)
        ax_train.fill_between(xs, lo, hi, color=colors[rule], alpha=0.12, lw=0)
        steps = [s for s, _ in rs[0]["evals"]]
        held = [[v for _, v in r["evals"]] + [math.nan] * (len(steps) - len(r["evals"])) for r in rs]
        cols = list(zip(*held))
        ax_held.plot(steps, [statistics.median(c) for c in cols], color=colors[rule], marker=".", label=rule)
        ax_held.fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], color=colors[rule], alpha=0.12)
    ax_train.set(xlabel="step", ylabel="training loss (nats/byte)", title="training loss: median, min-max of seeds")
    ax_held.set(xlabel="step", ylabel="held-out loss (nats/byte)", title="held-out loss: median, min-max of seeds")
    for ax in (ax_train, ax_held):
        ax.set_ylim(1.5, 4.5)
        ax.grid(alpha=0.3)
    ax_held.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _report.save_figure(fig, path)
    return True


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one rate, one seed, a smaller model, every rule")
    p.add_argument("--search", action="store_true", help="the search alone")
    p.add_argument("--search-json", type=pathlib.Path, default=None, help="with --search: write its result here")
    p.add_argument(
        "--reuse-search",
        type=pathlib.Path,
        default=None,
        help="take the search's result from this JSON (--search-json)",
    )
    p.add_argument("--workers", type=int, default=None, help="one-thread runs at a time (default 2; --quick: 1)")
    p.add_argument("--out", type=pathlib.Path, default=_report.RESULTS, help="results folder")
    args = p.parse_args(argv)
    workers = args.workers or (1 if args.quick else 2)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"study": "quality", "quick": args.quick, "machine": machine(), "workers": workers}
    result["machine"]["torch_threads"] = 1
    result["machine"]["cpus"] = os.cpu_count()
    result["corpus"] = _corpus().meta
    result["not_available"] = NOT_AVAILABLE
    result["rules_fixed_in_advance"] = {
        "spike": f"a clean step after the first {SPIKE_WINDOW}: training loss > {SPIKE_FACTOR} x median of the "
        f"{SPIKE_WINDOW} clean steps before, or not finite; consecutive spike steps are one event",
        "diverged": "a non-finite training loss, or final held-out loss >= held-out loss at step 0",
        "clipped": "total norm above the rule's threshold; AdaGC: any coefficient below 1",
        "summaries": "median over seeds, min-max",
    }
    if args.quick:
        cfg, lrs, seeds = QUICK, [1e-1], (0,)
        result["search"] = None
        telling = lrs[0]
    else:
        cfg = TrainConfig()
        previous = json.loads(args.reuse_search.read_text())["search"] if args.reuse_search else None
        if previous is not None and any(r.get("bad_steps") for r in previous["runs"]):
            found = previous  # every stage already run
        else:
            found = search(workers, cfg, previous)
        found["reused_from"] = str(args.reuse_search) if args.reuse_search else None
        result["search"] = {k: v for k, v in found.items() if k != "_full"}
        print(f"search: {json.dumps(found['chosen'])}", flush=True)
        if args.search:
            result["seconds"] = time.perf_counter() - t0
            if args.search_json:
                args.search_json.write_text(json.dumps({**result, "search": found}, indent=1) + "\n")
                print(f"wrote {args.search_json}")
            return result
        stage = found["chosen"]["stage"]
        cfg = dataclasses.replace(cfg, bad_batches=BAD_BATCHES) if stage == "bad_data" else replace_warmup(cfg, stage)
        lrs, seeds, telling = found["chosen"]["lrs"], SEEDS, found["chosen"]["telling_lr"]
        reused = {(r["rule"], r["lr"], r["seed"]): r for r in found.get("_full", []) if _stage(r) == stage}
    # The package's runs at the telling rate only: all rates would add 6 runs (about 10 minutes) to the 45.
    tasks = [(rule, lr, s, cfg) for s in seeds for lr in lrs for rule in RULES if rule != "zclip_pkg" or lr == telling]
    runs = [] if args.quick else [reused[t[:3]] for t in tasks if t[:3] in reused]
    runs += run_all([t for t in tasks if args.quick or t[:3] not in reused], workers, "study")
    rows = aggregate(runs)
    result["config"] = dataclasses.asdict(cfg)
    result["config"]["parameters"] = sum(p.numel() for p in TinyGPT(cfg.model).parameters())
    result["rules"] = list(RULES)
    result["lrs"], result["seeds"], result["telling_lr"] = list(lrs), list(seeds), telling
    result["rows"] = rows
    result["table_md"] = table(rows)
    result["runs"] = runs
    result["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    path = _report.write_result(result, args.out)
    title = (
        f"byte-level GPT, {result['config']['parameters'] / 1e6:.2f} M params, stdlib source, peak lr {telling:g}, "
        f"warm-up {cfg.warmup:.0%}, {cfg.steps} steps, {len(seeds)} seed(s)"
    )
    plot(runs, telling, cfg, args.out / "quality.png", title)
    print(result["table_md"])
    print(f"wrote {path} in {result['seconds'] / 60:.1f} min")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
