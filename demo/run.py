"""Demo: train a small transformer over pipeline × FSDP2 × TP and check the global gradient norm.

Run on 8 CPU ranks (gloo); ``make demo`` does exactly this::

    python -m demo

The world mesh is ``("pp", "dp", "tp") = (2, 2, 2)`` by default, one gloo
rank per mesh point, started on this machine by :mod:`demo.harness` (hard
timeout, no process left behind). The transformer of :mod:`demo.model`
(token embedding, blocks of causal self-attention and a SwiGLU MLP, RMSNorm,
output head) is split into pipeline stages (``torch.distributed.pipelining``,
GPipe schedule), tensor-parallelized inside each stage
(``parallelize_module``: column/row-parallel linears, sequence-parallel
norms) and sharded with FSDP2 (``fully_shard``) over ``dp``. Every step runs
the pipeline forward/backward on a synthetic token stream, then the
optimizer step: ``ppclip_func.clip_grad_norm_`` (one all-reduce over the
world mesh) and AdamW, under ``torch.compile(fullgraph=True)`` unless
``--eager``.

Then this process trains the same model alone with plain torch (same seed,
init and data; ``torch.optim.AdamW``; the norm of all gradients
concatenated, by ``torch.linalg.vector_norm`` in float64) and prints the
per-step norms side by side, next to the norm torch computes on each
pipeline stage alone (what ``torch.nn.utils.clip_grad_norm_`` would clip by
there). The demo exits non-zero if the distributed and single-process norms
differ by more than ``--rtol`` (1e-6) at any step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from demo.harness import RanksFailed, run_ranks
from demo.model import ModelConfig, build_model, loss_fn, split_stage, token_batches
from demo.optim import AdamWConfig, FunctionalAdamW
from demo.parallel import Pipeline, apply_fsdp, apply_tp

__all__ = ["main"]

N_HEADS = 4
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


@dataclasses.dataclass
class StepLog:
    """What rank 0 prints for one step of the distributed run."""

    loss: float
    norm: float
    coef: float
    seconds: float
    stage_norms: list[float]


def _quiet() -> None:
    """Silences the torch warnings this demo triggers and understands; every other warning still shows."""
    import torch._functorch.config
    import torch._inductor.config

    # The last stage returns its logits as a view (DTensor.to_local of the Replicate output of the
    # ColwiseParallel head); the pipeline schedule never modifies a stage output in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # torch's own per-stage norm below: full_tensor() of a norm Partial over (dp, tp) runs two sequential
    # all-reduces, and DTensor says so. That is the baseline's cost, shown on purpose.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # AOTAutograd's on-disk cache: it cannot pickle the DeviceMesh in this step anyway (and warns), and it
    # keys DTensor inputs by global shape, so ranks with uneven shards could load each other's kernels.
    torch._functorch.config.enable_autograd_cache = False
    # Every rank compiles at once: a pool of compile workers per rank would only oversubscribe the cores.
    torch._inductor.config.compile_threads = 1


@contextlib.contextmanager
def _ticking(say: Callable[..., None], every: float = 20.0) -> Iterator[None]:
    """Says how long the body has been running every ``every`` seconds, so a long wait shows it is alive."""
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(every):
            say(f"  ... {time.monotonic() - start:.0f} s", flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _torch_stage_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm ``torch.nn.utils.clip_grad_norm_`` computes on this stage: ``get_total_norm``, made whole."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _rank(rank: int, world: int, args: argparse.Namespace, cfg: ModelConfig, data: list, t0: float) -> list | None:
    """Trains on this rank; returns the step logs on rank 0 (``None`` elsewhere)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from ppclip_func import clip_grad_norm_, global_grad_norm

    _quiet()
    say = print if rank == 0 else lambda *a, **k: None
    mesh = init_device_mesh("cpu", (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, _ = mesh.get_coordinate()

    model = split_stage(build_model(cfg, args.seed), pp_rank, args.pp)
    if args.tp > 1:
        apply_tp(model, mesh["tp"])
    if args.dp > 1:
        apply_fsdp(model, mesh["dp"])
    params = list(model.parameters())
    adam = FunctionalAdamW(params, AdamWConfig(lr=args.lr, betas=BETAS, weight_decay=WEIGHT_DECAY))
    pipeline = Pipeline([model], [pp_rank], args.pp, mesh["pp"], n_microbatches=args.microbatches)

    def optimizer_step() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            # partial="reduce": without FSDP (--dp 1), the sequence-parallel norm weights' grads stay Partial
            # over tp and need reducing first; with FSDP2 there are none and it changes nothing.
            total = clip_grad_norm_(params, mesh, args.max_norm, args.norm_type, partial="reduce")
            adam.step()
            return total, torch.clamp(args.max_norm / (total + 1e-6), max=1.0)

    step_fn = optimizer_step if args.eager else torch.compile(optimizer_step, fullgraph=True, backend=args.backend)
    n_params = sum(p.numel() for p in build_model(cfg, args.seed).parameters())
    mode = "eager" if args.eager else f"compiled ({args.backend}, fullgraph)"
    say(
        f"mesh (pp, dp, tp) = ({args.pp}, {args.dp}, {args.tp}) on {world} gloo ranks, up after "
        f"{time.monotonic() - t0:.0f} s; {n_params:,} params; optimizer step (clip + AdamW) {mode}",
        flush=True,
    )
    per_dp = args.batch // args.dp
    logs: list[StepLog] = []
    for step, (inputs, targets) in enumerate(data):
        t_start = time.perf_counter()
        x, y = (t[dp_rank * per_dp : (dp_rank + 1) * per_dp] for t in (inputs, targets))
        losses: list[torch.Tensor] = []
        pipeline.step(x, y, losses)
        t_backward = time.perf_counter()

        # Not part of the step: what torch alone reports on this stage, and (once) the collective counts.
        grads = [p.grad for p in params]
        if step == 0:
            # The first sight of these options on this mesh also checks, once, that every rank passes the
            # same ones (one small extra all-gather, never again): call once first, then count a step's.
            global_grad_norm(grads, mesh, args.norm_type, partial="reduce")
            with CommDebugMode() as ours_comm:
                global_grad_norm(grads, mesh, args.norm_type, partial="reduce")
            with CommDebugMode() as torch_comm:
                _torch_stage_norm(grads, args.norm_type)
        stage_norm = _torch_stage_norm(grads, args.norm_type)

        t_optimizer = time.perf_counter()
        if step == 0 and not args.eager:
            say(
                f"step 1: compiling the optimizer step with {args.backend} on every rank "
                f"(first step only; the longest wait of the demo) ...",
                flush=True,
            )
            with _ticking(say) if rank == 0 else contextlib.nullcontext():
                total, coef = step_fn()
            say(f"  compiled on every rank: {time.perf_counter() - t_optimizer:.0f} s", flush=True)
        else:
            total, coef = step_fn()
        norm, coef = float(total), float(coef)
        seconds = (t_backward - t_start) + (time.perf_counter() - t_optimizer)
        for p in params:
            p.grad = None

        # For printing on rank 0: the loss lives on the last stage, each stage norm on its stage.
        stats = torch.zeros(1 + args.pp, dtype=torch.float64)
        if pipeline.last:
            stats[0] = torch.stack(losses).detach().mean().double() / (args.dp * args.tp)
        stats[1 + pp_rank] = stage_norm.double() / (args.dp * args.tp)
        dist.all_reduce(stats)
        logs.append(StepLog(float(stats[0]), norm, coef, seconds, stats[1:].tolist()))
        if step == 0:
            say(
                f"collectives (CommDebugMode): ppclip_func {ours_comm.get_total_counts()} for the whole model "
                f"per step (its first call also checks once that all ranks pass the same options); "
                f"torch get_total_norm().full_tensor() {torch_comm.get_total_counts()} for one stage",
                flush=True,
            )
        say(
            f"step {step + 1:3d}  loss {logs[-1].loss:6.3f}  norm {norm:8.5f}  clip {coef:6.4f}  "
            f"{seconds * 1e3:6.0f} ms" + ("  (incl. compile)" if step == 0 and not args.eager else ""),
            flush=True,
        )
    return logs if rank == 0 else None


def _single_process(args: argparse.Namespace, cfg: ModelConfig, data: list) -> list[float]:
    """The same training in one process with plain torch; returns the norm of each step.

    Nothing from ppclip_func: the whole model, ``torch.optim.AdamW``, and the
    norm of all gradients concatenated, by ``torch.linalg.vector_norm`` in
    float64.
    """
    model = build_model(cfg, args.seed)
    params = list(model.parameters())
    opt = AdamWConfig(lr=args.lr, betas=BETAS, weight_decay=WEIGHT_DECAY).torch_optimizer(params)
    norms = []
    for inputs, targets in data:
        loss_fn(model(inputs), targets).backward()
        flat = torch.cat([p.grad.double().reshape(-1) for p in params])
        total = torch.linalg.vector_norm(flat, args.norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, args.max_norm, total)
        opt.step()
        opt.zero_grad(set_to_none=True)
        norms.append(float(total))
    return norms


def _relative_difference(a: float, b: float) -> float:
    if a == b:  # also 0 == 0 and inf == inf
        return 0.0
    return abs(a - b) / abs(b) if math.isfinite(b) and b != 0 else math.inf


def _report(args: argparse.Namespace, logs: list[StepLog], ref: list[float]) -> bool:
    """Prints the per-step norms side by side; returns whether they agree within ``--rtol``."""
    stages = "".join(f"  {'torch stage ' + str(s):>13}" for s in range(args.pp))
    print(
        f"\nglobal grad norm per step (norm_type={args.norm_type:g}): {args.pp * args.dp * args.tp} ranks vs 1 process"
    )
    print(f"{'step':>4}  {'ppclip_func':>12}  {'1 process':>12}  {'rel diff':>8}{stages}")
    worst = 0.0
    for i, (log, r) in enumerate(zip(logs, ref)):
        rel = _relative_difference(log.norm, r)
        worst = max(worst, rel)
        cells = "".join(f"  {n:13.6f}" for n in log.stage_norms)
        print(f"{i + 1:4d}  {log.norm:12.6f}  {r:12.6f}  {rel:8.1e}{cells}")
    ok = worst <= args.rtol
    print(f"max relative difference {worst:.1e} ({'OK' if ok else 'MISMATCH'}: tolerance {args.rtol:g})")
    if args.pp > 1:
        last = logs[-1]
        coefs = ", ".join(f"{min(args.max_norm / (n + 1e-6), 1.0):.3f}" for n in last.stage_norms)
        print(
            f"torch.nn.utils.clip_grad_norm_ on each stage sees only that stage (torch columns): at step "
            f"{len(logs)} the stages would scale by {coefs} instead of {last.coef:.3f} everywhere"
        )
    return ok


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--dp", type=int, default=2, help="FSDP2 shards per stage (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel shards (default 2; must divide 4 heads)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--norm-type", type=float, default=2.0, help="p > 0, 0, inf or -inf (default 2)")
    parser.add_argument("--max-norm", type=float, default=0.5)
    parser.add_argument("--eager", action="store_true", help="run the optimizer step eagerly instead of compiled")
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend (default inductor; aot_eager traces only)"
    )
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks, split over the stages (default 2)")
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, whole model (default 8)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches per step (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rtol", type=float, default=1e-6, help="allowed relative difference (default 1e-6)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before every rank is killed (default 900)")
    args = parser.parse_args(argv)
    if min(args.pp, args.dp, args.tp, args.steps, args.microbatches) < 1:
        parser.error("--pp, --dp, --tp, --steps and --microbatches must be >= 1")
    if args.layers < args.pp:
        parser.error(f"--layers {args.layers} cannot be split over --pp {args.pp} stages")
    if N_HEADS % args.tp or args.seq_len % args.tp or args.dim % N_HEADS:
        parser.error(f"--tp must divide the {N_HEADS} heads and --seq-len; --dim must be a multiple of {N_HEADS}")
    if args.batch % (args.dp * args.microbatches):
        parser.error("--batch must be a multiple of --dp x --microbatches")
    return args


def model_and_data(args: argparse.Namespace) -> tuple[ModelConfig, list]:
    """The demo's model config and its token batches, from the parsed options."""
    cfg = ModelConfig(dim=args.dim, n_heads=N_HEADS, n_layers=args.layers, hidden=2 * args.dim, seq_len=args.seq_len)
    return cfg, token_batches(cfg, args.batch, args.steps, args.seed)


def on_demo_ranks(fn: Callable[..., Any], args: argparse.Namespace, cfg: ModelConfig, data: list, t0: float) -> Any:
    """Runs ``fn(rank, world, args, cfg, data, t0)`` on ``pp × dp × tp`` gloo ranks; returns rank 0's result.

    Raises:
        RanksFailed: A rank failed (its traceback is in the message).
    """
    world = args.pp * args.dp * args.tp
    print(f"starting {world} gloo ranks on this machine ...", flush=True)
    return run_ranks(
        fn,
        world,
        args,
        cfg,
        data,
        t0,
        timeout=args.timeout,
        start_method="forkserver",
        preload=("ppclip_func", "demo.model", "demo.parallel", "demo.optim"),
    )[0]


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns the exit status (non-zero if the norms disagree or a rank failed)."""
    t0 = time.monotonic()
    args = _parse(argv)
    cfg, data = model_and_data(args)
    try:
        logs = on_demo_ranks(_rank, args, cfg, data, t0)
    except RanksFailed as e:
        print(f"the distributed run failed:\n{e}", file=sys.stderr)
        return 1
    print("one process: the same model, seed and data with plain torch ...", flush=True)
    ok = _report(args, logs, _single_process(args, cfg, data))
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1
