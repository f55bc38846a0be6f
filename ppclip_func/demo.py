"""Demo: train a small transformer over pipeline × FSDP2 × TP and check the global gradient norm.

Run on 8 CPU ranks (gloo); ``make demo`` does exactly this::

    torchrun --standalone --nproc-per-node 8 -m ppclip_func.demo

The world mesh is ``("pp", "dp", "tp") = (2, 2, 2)`` by default. A small
decoder-only transformer (token embedding, blocks of causal self-attention and
a SwiGLU MLP, RMSNorm, output head) is split into pipeline stages
(``torch.distributed.pipelining``, GPipe schedule), tensor-parallelized inside
each stage (``parallelize_module``: column/row-parallel linears, sequence
parallel norms) and sharded with FSDP2 (``fully_shard``) over ``dp``. Every
step runs the pipeline forward/backward on a synthetic token stream, then the
optimizer step: ``ppclip_func.clip_grad_norm_`` (one all-reduce over the world
mesh) and AdamW, under ``torch.compile(fullgraph=True)`` unless ``--eager``.

At the end, rank 0 trains the same model in one process with plain torch
(same seed, init and data; ``torch.optim.AdamW``; the norm of all gradients
concatenated, by ``torch.linalg.vector_norm`` in float64) and prints the
per-step norms side by side, next to the norm torch computes on each pipeline
stage alone (what ``torch.nn.utils.clip_grad_norm_`` would clip by there).
The demo exits non-zero if the distributed and single-process norms differ by
more than ``--rtol`` (1e-4) at any step.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.adamw import adamw as functional_adamw

__all__ = [
    "ModelConfig",
    "Transformer",
    "apply_fsdp",
    "apply_tp",
    "build_model",
    "main",
    "split_stage",
]

N_HEADS = 4


# --------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo transformer."""

    vocab: int = 128
    dim: int = 64
    n_heads: int = N_HEADS
    n_layers: int = 4
    hidden: int = 128
    seq_len: int = 32


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, written out so that DTensor inputs need no special kernel."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head self-attention; the head count follows the (TP-local) width of ``wq``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only transformer. A pipeline stage is this module with the parts it lacks set to ``None``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The whole model, initialized from ``seed`` alone (every rank and the reference build the same one)."""
    torch.manual_seed(seed)
    return Transformer(cfg)


def split_stage(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """Keeps this stage's share of the blocks (and the embedding on the first, norm and head on the last)."""
    n = len(model.layers)
    if n < n_stages:
        raise ValueError(f"{n} layers cannot be split over {n_stages} pipeline stages")
    bounds = [round(i * n / n_stages) for i in range(n_stages + 1)]
    keep = {str(i) for i in range(bounds[stage], bounds[stage + 1])}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < n_stages - 1:
        model.norm = None
        model.output = None
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def token_batches(cfg: ModelConfig, batch: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A synthetic token stream with learnable structure, cut into ``(inputs, targets)`` per step.

    The stream is a random sparse Markov chain: each token is followed by
    one of four tokens fixed per token, so the loss has something to learn.
    """
    g = torch.Generator().manual_seed(10_000 + seed)
    successors = torch.randint(0, cfg.vocab, (cfg.vocab, 4), generator=g)
    n = steps * batch * (cfg.seq_len + 1)
    stream = torch.empty(n, dtype=torch.long)
    stream[0] = 0
    choice = torch.randint(0, 4, (n,), generator=g)
    for i in range(1, n):
        stream[i] = successors[stream[i - 1], choice[i]]
    seqs = stream.view(steps, batch, cfg.seq_len + 1)
    return [(s[:, :-1].clone(), s[:, 1:].clone()) for s in seqs]


# --------------------------------------------------------------------------- parallelism


def apply_tp(model: Transformer, tp_mesh) -> None:
    """Megatron-style TP with sequence-parallel norms, as torchtitan does for Llama."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


def apply_fsdp(model: Transformer, dp_mesh) -> None:
    """FSDP2 per block and for the stage root; parameters stay gathered between microbatches."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)


# --------------------------------------------------------------------------- optimizer

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


class AdamWState:
    """AdamW moments and step counts, one per parameter (DTensors for DTensor parameters)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.exp_avgs = [torch.zeros_like(p) for p in params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in params]
        # float64: compiled (capturable), the bias corrections are computed in the step's dtype.
        self.steps = [torch.zeros((), dtype=torch.float64) for _ in params]


def adamw_step(params: list[torch.Tensor], state: AdamWState, lr: float) -> None:
    """One AdamW update through torch's functional ``adamw`` (what ``torch.optim.AdamW.step`` runs).

    ``AdamW.step`` itself cannot be traced with ``fullgraph=True``: it inserts
    graph breaks on purpose around its no-grad region. The functional form
    has no such break, so clip + update compile into one graph.
    """
    functional_adamw(
        params,
        [p.grad for p in params],
        state.exp_avgs,
        state.exp_avg_sqs,
        [],
        state.steps,
        foreach=True,
        # Traced, the bias corrections must stay tensors (capturable); eager CPU rejects capturable.
        capturable=torch.compiler.is_compiling(),
        amsgrad=False,
        beta1=BETAS[0],
        beta2=BETAS[1],
        lr=lr,
        weight_decay=WEIGHT_DECAY,
        eps=1e-8,
        maximize=False,
    )


# --------------------------------------------------------------------------- runs


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

    # The last stage returns its logits as a view (DTensor.to_local of the Replicate output of the
    # ColwiseParallel head); the pipeline schedule never modifies a stage output in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # torch's own per-stage norm below: full_tensor() of a norm Partial over (dp, tp) runs two sequential
    # all-reduces, and DTensor says so. That is the baseline's cost, shown on purpose.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # AOTAutograd's on-disk cache: it cannot pickle the DeviceMesh in this step anyway (and warns), and it
    # keys DTensor inputs by global shape, so ranks with uneven shards could load each other's kernels.
    torch._functorch.config.enable_autograd_cache = False


def _torch_stage_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm ``torch.nn.utils.clip_grad_norm_`` computes on this stage: ``get_total_norm``, made whole."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _distributed(args: argparse.Namespace, cfg: ModelConfig, data: list) -> list[StepLog] | None:
    """Trains on this rank; returns the step logs on rank 0 (``None`` elsewhere)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.tensor.debug import CommDebugMode

    from ppclip_func import clip_grad_norm_, global_grad_norm

    world, rank = dist.get_world_size(), dist.get_rank()
    if args.pp * args.dp * args.tp != world:
        raise SystemExit(f"--pp {args.pp} x --dp {args.dp} x --tp {args.tp} must equal the world size {world}")
    mesh = init_device_mesh("cpu", (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, _ = mesh.get_coordinate()

    model = split_stage(build_model(cfg, args.seed), pp_rank, args.pp)
    if args.tp > 1:
        apply_tp(model, mesh["tp"])
    if args.dp > 1:
        apply_fsdp(model, mesh["dp"])
    params = list(model.parameters())
    adam = AdamWState(params)
    stage = PipelineStage(model, pp_rank, args.pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)

    def optimizer_step() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            # partial="reduce": without FSDP (--dp 1), the sequence-parallel norm weights' grads stay Partial
            # over tp and need reducing first; with FSDP2 there are none and it changes nothing.
            total = clip_grad_norm_(params, mesh, args.max_norm, args.norm_type, partial="reduce")
            adamw_step(params, adam, args.lr)
            return total, torch.clamp(args.max_norm / (total + 1e-6), max=1.0)

    step_fn = optimizer_step if args.eager else torch.compile(optimizer_step, fullgraph=True, backend=args.backend)
    per_dp = args.batch // args.dp
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    logs: list[StepLog] = []
    for step, (inputs, targets) in enumerate(data):
        t0 = time.perf_counter()
        x, y = (t[dp_rank * per_dp : (dp_rank + 1) * per_dp] for t in (inputs, targets))
        losses: list[torch.Tensor] = []
        if first and last:
            schedule.step(x, target=y, losses=losses)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        t1 = time.perf_counter()

        # Not part of the step: what torch alone reports on this stage, and (once) the collective counts.
        grads = [p.grad for p in params]
        if step == 0:
            with CommDebugMode() as ours_comm:
                global_grad_norm(grads, mesh, args.norm_type, partial="reduce")
            with CommDebugMode() as torch_comm:
                _torch_stage_norm(grads, args.norm_type)
        stage_norm = _torch_stage_norm(grads, args.norm_type)

        t2 = time.perf_counter()
        total, coef = step_fn()
        norm, coef = float(total), float(coef)
        seconds = (t1 - t0) + (time.perf_counter() - t2)
        for p in params:
            p.grad = None

        # For printing on rank 0: the loss lives on the last stage, each stage norm on its stage.
        stats = torch.zeros(1 + args.pp, dtype=torch.float64)
        if last:
            stats[0] = torch.stack(losses).detach().mean().double() / (args.dp * args.tp)
        stats[1 + pp_rank] = stage_norm.double() / (args.dp * args.tp)
        dist.all_reduce(stats)
        logs.append(StepLog(float(stats[0]), norm, coef, seconds, stats[1:].tolist()))
        if rank != 0:
            continue
        if step == 0:
            n_params = sum(p.numel() for p in build_model(cfg, args.seed).parameters())
            print(
                f"mesh (pp, dp, tp) = ({args.pp}, {args.dp}, {args.tp}) on {world} gloo ranks; {n_params:,} params; "
                f"optimizer step (clip + AdamW) {'eager' if args.eager else f'compiled ({args.backend}, fullgraph)'}\n"
                f"collectives (CommDebugMode): ppclip_func {ours_comm.get_total_counts()} for the whole model; "
                f"torch get_total_norm().full_tensor() {torch_comm.get_total_counts()} for one stage",
                flush=True,
            )
        print(
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
    opt = torch.optim.AdamW(params, lr=args.lr, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=True)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks, split over the stages (default 4)")
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, whole model (default 8)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches per step (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rtol", type=float, default=1e-4, help="allowed relative difference (default 1e-4)")
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


def main(argv: list[str] | None = None) -> int:
    """Runs the demo on this rank; returns the exit status (non-zero on rank 0 if the norms disagree)."""
    start = time.perf_counter()
    args = _parse(argv)
    _quiet()
    torch.set_num_threads(1)
    cfg = ModelConfig(dim=args.dim, n_heads=N_HEADS, n_layers=args.layers, hidden=2 * args.dim, seq_len=args.seq_len)
    data = token_batches(cfg, args.batch, args.steps, args.seed)
    dist.init_process_group("gloo")
    try:
        logs = _distributed(args, cfg, data)
    finally:
        dist.destroy_process_group()
    if logs is None:
        return 0
    ok = _report(args, logs, _single_process(args, cfg, data))
    print(f"rank 0 done in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
