"""Ranks that disagree on a static option get one clear error on every rank, never a wrong norm or a hang.

2 real gloo ranks, mesh ("pp",) of 2, each rank holding its own stage's grads;
one process group for all cases (eager, then compiled with aot_eager). Each
case must raise ValueError naming the option on both ranks, leave every
gradient untouched, and leave the group usable (a good clip follows).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from demo.harness import run_ranks
from ppclip_func import clip_grad_norm_, global_grad_norm

MAX_NORM = 0.1


def _stage(stage: int) -> torch.nn.Module:
    torch.manual_seed(stage)
    m = torch.nn.Sequential()
    m.add_module(f"s{stage}", torch.nn.Linear(3, 2))
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    return m


def _cases(rank: int, stage: torch.nn.Module) -> dict:
    own = {n: n for n in dict(stage.named_parameters())}  # the pipeline trainer's natural mistake
    return {
        "groups": dict(groups=own),
        "norm_type": dict(norm_type=2.0 if rank == 0 else float("inf")),
        "the number of group labels": dict(groups={"a": "*weight"} if rank == 0 else {"a": "*weight", "b": "*bias"}),
        "overflow_safe": dict(overflow_safe=rank == 1),
    }


def _worker(rank: int, world_size: int) -> dict:
    torch._functorch.config.enable_autograd_cache = False
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    stage = _stage(rank)
    params = list(stage.parameters())
    out = {}
    for compiled in (False, True):
        for name, kw in _cases(rank, stage).items():
            torch._dynamo.reset()
            before = [p.grad.clone() for p in params]

            def clip(ps, kw=kw):
                return clip_grad_norm_(ps, mesh, MAX_NORM, **kw)

            fn = torch.compile(clip, backend="aot_eager", fullgraph=True) if compiled else clip
            try:
                fn(params)
                got = "no error"
            except Exception as e:
                # Under torch.compile(fullgraph=True) dynamo wraps it; the ValueError is the cause.
                while not isinstance(e, ValueError) and (e.__cause__ or e.__context__) is not None:
                    e = e.__cause__ or e.__context__
                msg = str(e)
                ok = isinstance(e, ValueError)
                got = "ok" if ok and name in msg and "whole model" in msg else f"{type(e).__name__}: {msg[:300]}"
            untouched = all(torch.equal(b, p.grad) for b, p in zip(before, params, strict=True))
            out[f"{'compiled' if compiled else 'eager'} {name}"] = (got, untouched)
    # The group is still usable: an agreeing clip works.
    total = clip_grad_norm_(params, mesh, MAX_NORM)
    out["after"] = bool(torch.isfinite(total))
    # The README's fix: groups from the whole model's names on every rank give each stage's true norm.
    whole = [f"s{s}.{k}" for s in range(world_size) for k in ("weight", "bias")]
    grads = {n: p.grad for n, p in stage.named_parameters()}
    _, per = global_grad_norm(grads, mesh, groups={n: n for n in whole})
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, {n: float(g.norm()) for n, g in grads.items()})
    true = {n: v for g in gathered for n, v in g.items()}
    out["fix"] = all(abs(float(per[n]) - true[n]) <= 1e-6 * true[n] for n in whole)
    dist.barrier()
    return out


def test_disagreeing_ranks_raise_on_every_rank_and_leave_grads_untouched():
    results = run_ranks(_worker, 2, timeout=240, pg_timeout=60)
    for rank, r in enumerate(results):
        assert r.pop("after"), rank
        assert r.pop("fix"), rank
        bad = {k: v for k, v in r.items() if v != ("ok", True)}
        assert not bad, f"rank {rank}: {bad}"
