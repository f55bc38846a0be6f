"""A gradient spike on the 8-rank PP × FSDP2 × TP model: a fixed threshold, an adaptive one, skipping, AdaGC.

Run on 8 CPU ranks (gloo); ``make demo-spike`` does exactly this::

    python -m demo.spike

The model, mesh and data of ``python -m demo`` (:mod:`demo.run`), trained
four times from the same seed on the same batches, with the optimizer step
(clip + AdamW) run eagerly. At one step (``--spike-step``) the loss of the
whole batch is multiplied by ``--spike-scale`` (1000), so that step's
gradient is 1000 times larger; with ``--spike-kind corrupt`` that batch's
targets are also replaced by random tokens, so the spike points in a
direction of its own. The three runs differ only in the clip:

* ``fixed``: ``clip_grad_norm_`` at ``--max-norm``;
* ``adaptive``: ``adaptive_clip_grad_norm_`` (ZClip: after a warm-up, a
  norm whose z-score against the norms so far passes ``z`` is clipped to a
  target near their mean; ``--max-norm`` caps every step);
* ``skip``: the same, with ``skip_z``: a step whose norm is that many
  standard deviations above the mean is not applied at all
  (``skip_update_`` around AdamW: parameters and optimizer state unchanged);
* ``adagc``: ``adagc_clip_grad_norm_`` (AdaGC, Wang et al. 2025: after the
  same warm-up at ``--max-norm``, each parameter clipped to 1.04 times the
  running average of its own clipped norm).

Rank 0 prints the losses side by side, the norm, each run's threshold and
skip decision, and, at the spike, the parameters whose gradient norm grew
the most (per-parameter norms of the whole model, from the clip's one
collective).

The two adaptive runs also record every step with a
:class:`~ppclip_func.ClipRecorder` (on the device, read on the host one step
later): ``--record-dir`` (default ``spike-record``) receives
``<run>.jsonl``, the host-synced values of the same steps as
``<run>.host.json`` (what ``tests/test_demo_spike.py`` compares the record
with), and, where matplotlib is installed, ``adaptive.png``: the heatmap of
every parameter's norm over the steps with the threshold, the clipped and
skipped steps and the parameters the recorder named at the spike
(``python -m ppclip_func.plot``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from demo.harness import RanksFailed
from demo.model import ModelConfig, build_model, loss_fn, split_stage
from demo.optim import AdamWConfig, FunctionalAdamW
from demo.parallel import Pipeline, apply_fsdp, apply_tp
from demo.run import BETAS, WEIGHT_DECAY, _quiet, model_and_data, on_demo_ranks

__all__ = ["main"]

MODES = ("fixed", "adaptive", "skip", "adagc")


def _train(mode: str, args: argparse.Namespace, cfg: ModelConfig, data: list, mesh, say) -> list[dict]:
    """One training run on this rank; returns per-step records (meaningful on rank 0)."""
    from ppclip_func import (
        ClipRecorder,
        adagc_clip_grad_norm_,
        adaptive_clip_grad_norm_,
        clip_grad_norm_,
        init_adagc_state,
        init_clip_state,
        param_norm_index,
        skip_update_,
    )

    pp_rank, dp_rank, _ = mesh.get_coordinate()
    model = split_stage(build_model(cfg, args.seed), pp_rank, args.pp)
    apply_tp(model, mesh["tp"])
    apply_fsdp(model, mesh["dp"])
    named = dict(model.named_parameters())
    params = list(named.values())
    adam = FunctionalAdamW(params, AdamWConfig(lr=args.lr, betas=BETAS, weight_decay=WEIGHT_DECAY))
    scale = [1.0]
    pipeline = Pipeline(
        [model], [pp_rank], args.pp, mesh["pp"], n_microbatches=args.microbatches,
        loss=lambda logits, targets: loss_fn(logits, targets) * scale[0],
    )  # fmt: skip
    index = param_norm_index(named, mesh)  # once: the names of every stage's parameters
    # Every rank records (the same all-reduced values); rank 0 reads them and writes the JSON lines.
    recording = mode in ("adaptive", "skip") and args.record_dir is not None
    path = f"{args.record_dir}/{mode}.jsonl" if recording and torch.distributed.get_rank() == 0 else None
    if path is not None:
        open(path, "w").close()
    recorder = ClipRecorder(index, top_k=3, warmup=args.warmup, path=path) if recording else None
    state = init_clip_state()
    adagc_state = init_adagc_state(index)
    per_dp = args.batch // args.dp
    records = []
    for step, (inputs, targets) in enumerate(data):
        scale[0] = args.spike_scale if step + 1 == args.spike_step else 1.0
        x, y = (t[dp_rank * per_dp : (dp_rank + 1) * per_dp] for t in (inputs, targets))
        losses: list[torch.Tensor] = []
        pipeline.step(x, y, losses)
        with torch.no_grad():
            if mode == "fixed":
                norm = clip_grad_norm_(params, mesh, args.max_norm)
                threshold, skip, param_norms = torch.tensor(args.max_norm), torch.tensor(False), None
                adam.step()
            elif mode == "adagc":
                ada = adagc_clip_grad_norm_(named, mesh, adagc_state, index, max_norm=args.max_norm, warmup=args.warmup)
                norm, skip, param_norms, adagc_state = ada.total_norm, ada.skip, ada.param_norms, ada.state
                threshold = ada.coefficients.nan_to_num(nan=1.0).min()  # the smallest coefficient, for the table
                adam.step()
            else:
                stats = adaptive_clip_grad_norm_(
                    named, mesh, state, max_norm=args.max_norm, warmup=args.warmup,
                    skip_z=args.skip_z if mode == "skip" else None, param_norms=index,
                )  # fmt: skip
                norm, threshold, skip, param_norms, state = (
                    stats.total_norm, stats.threshold, stats.skip, stats.param_norms, stats.state,
                )  # fmt: skip
                if recorder is not None:
                    recorder.record(stats)  # on the device: no host read in the step
                if mode == "skip":
                    optimizer_state = [*params, *adam.exp_avgs, *adam.exp_avg_sqs, *adam.steps]
                    skip_update_(skip, optimizer_state, adam.step)
                else:
                    adam.step()
        for p in params:
            p.grad = None
        # The loss lives on the last stage (unscaled, to compare runs); one small all-reduce to print it.
        loss = torch.zeros((), dtype=torch.float64)
        if pipeline.last:
            loss += torch.stack(losses).detach().mean().double() / scale[0] / (args.dp * args.tp)
        torch.distributed.all_reduce(loss)
        if recorder is not None:
            recorder.read()  # the steps recorded before this one (on a GPU, their copy is done by now)
            recorder.flush()  # this step's row on its way to the host
        # The table's values, read on the host right after the step: the reference for the record.
        records.append(
            {
                "loss": float(loss),
                "norm": float(norm),
                "threshold": float(threshold),
                "zscore": float(stats.zscore) if mode in ("adaptive", "skip") else None,
                "skip": bool(skip),
                "param_norms": None if param_norms is None else dict(zip(index.names, param_norms.tolist())),
            }
        )
        if step + 1 == args.spike_step:
            what = "smallest coefficient" if mode == "adagc" else "threshold"
            say(f"  {mode}: spike at step {step + 1}: norm {float(norm):.1f}, {what} {float(threshold):.3g}")
    if recorder is not None:
        recorder.read(wait=True)  # the last step's
    if path is not None:
        with open(f"{args.record_dir}/{mode}.host.json", "w") as f:
            json.dump(records, f)
    return records


def _rank(rank: int, world: int, args: argparse.Namespace, cfg: ModelConfig, data: list, t0: float) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh

    _quiet()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    mesh = init_device_mesh("cpu", (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    say(
        f"mesh (pp, dp, tp) = ({args.pp}, {args.dp}, {args.tp}) on {world} gloo ranks, up after {time.monotonic() - t0:.0f} s"
    )
    runs = {}
    for mode in MODES:
        start = time.monotonic()
        say(f"training with the {mode} clip ({args.steps} steps, eager optimizer step) ...")
        runs[mode] = _train(mode, args, cfg, data, mesh, say)
        say(f"  done in {time.monotonic() - start:.0f} s")
    return runs if rank == 0 else None


def _report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    what = "" if args.spike_kind == "scaled" else ", and its targets are random tokens"
    print(f"\nloss per step; the loss of step {args.spike_step} is multiplied by {args.spike_scale:g}{what}")
    print(
        f"{'step':>4}  {'norm':>9}  {'loss fixed':>10}  {'loss adaptive':>13}  {'loss skip':>9}  {'loss adagc':>10}  "
        f"{'thr fixed':>9}  {'thr adaptive':>12}  {'adagc coef':>10}  {'skipped':>7}"
    )
    fixed, adaptive, skip, adagc = (runs[m] for m in MODES)
    for i, (f, a, s, g) in enumerate(zip(fixed, adaptive, skip, adagc)):
        mark = "  <- spike" if i + 1 == args.spike_step else ""
        print(
            f"{i + 1:4d}  {f['norm']:9.3f}  {f['loss']:10.4f}  {a['loss']:13.4f}  {s['loss']:9.4f}  {g['loss']:10.4f}  "
            f"{f['threshold']:9.3f}  {a['threshold']:12.3f}  {g['threshold']:10.3g}  {'yes' if s['skip'] else '':>7}{mark}"
        )
    after = slice(args.spike_step, None)
    for mode in MODES:
        tail = [r["loss"] for r in runs[mode][after]]
        if tail:
            print(f"{mode:>8}: mean loss after the spike {sum(tail) / len(tail):.4f}, last {tail[-1]:.4f}")
    at, before = adaptive[args.spike_step - 1]["param_norms"], adaptive[args.spike_step - 2]["param_norms"]
    if at and before:
        growth = sorted(((at[k] / before[k], k) for k in at if before[k] > 0), reverse=True)[:3]
        shown = ", ".join(f"{k} x{g:.0f}" for g, k in growth)
        print(
            f"per-parameter norms (all {len(at)} parameters, every stage, on every rank): largest growth at the spike: {shown}"
        )


def _report_record(args: argparse.Namespace) -> None:
    """What the adaptive run's recorder named at the anomalous steps, and its picture."""
    from ppclip_func.plot import plot_record, read_jsonl

    path = f"{args.record_dir}/adaptive.jsonl"
    lines = read_jsonl(path)
    print(f"\nrecorded on the device, read one step later: {path} ({len(lines)} steps)")
    for line in lines:
        if line["spiked"]:
            named = ", ".join(f"{s['name']} (z {s['zscore']:.3g})" for s in line["spiked"])
            what = "skipped" if line["skipped"] else f"clipped to {line['threshold']:.3g}"
            print(f"  step {line['step']}: norm {line['total']:.3g}, {what}; named: {named}")
    try:
        picture = plot_record(
            lines, f"{args.record_dir}/adaptive.png", title="adaptive clip: gradient norms by parameter"
        )
    except ImportError as e:
        print(f"  no picture: {e}")
    else:
        print(f"  heatmap of every parameter's norm over the steps: {picture}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m demo.spike", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--spike-step", type=int, default=15, help="the step whose loss is scaled (default 15)")
    parser.add_argument("--spike-scale", type=float, default=1000.0)
    parser.add_argument(
        "--spike-kind",
        choices=("scaled", "corrupt"),
        default="scaled",
        help="scaled: a normal batch's loss x spike-scale (default); corrupt: random targets too",
    )
    parser.add_argument("--max-norm", type=float, default=1.0, help="fixed threshold, and adaptive warm-up (default 1)")
    parser.add_argument("--warmup", type=int, default=8, help="adaptive warm-up steps (default 8)")
    parser.add_argument(
        "--skip-z", type=float, default=6.0, help="skip a step this many std above the mean (default 6)"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--record-dir",
        default="spike-record",
        help="where the adaptive runs' records and heatmap go (default spike-record; '' for none)",
    )
    args = parser.parse_args(argv)
    args.record_dir = args.record_dir or None
    if args.record_dir is not None:
        os.makedirs(args.record_dir, exist_ok=True)
    # The model and mesh of `python -m demo`'s defaults.
    vars(args).update(pp=2, dp=2, tp=2, layers=2, dim=64, seq_len=32, batch=8, microbatches=4)
    if not args.warmup < args.spike_step <= args.steps:
        parser.error("--spike-step must come after the warm-up and within --steps")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the demonstration; returns the exit status (non-zero if a rank failed)."""
    t0 = time.monotonic()
    args = _parse(argv)
    cfg, data = model_and_data(args)
    if args.spike_kind == "corrupt":
        inputs, targets = data[args.spike_step - 1]
        noise = torch.randint(0, cfg.vocab, targets.shape, generator=torch.Generator().manual_seed(args.seed))
        data[args.spike_step - 1] = (inputs, noise)
    try:
        runs = on_demo_ranks(_rank, args, cfg, data, t0)
    except RanksFailed as e:
        print(f"the distributed run failed:\n{e}", file=sys.stderr)
        return 1
    _report(args, runs)
    if args.record_dir is not None:
        _report_record(args)
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
