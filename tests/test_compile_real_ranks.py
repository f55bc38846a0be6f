"""The compiled clip on 4 real gloo ranks (PP=2 × FSDP=2) gives eager's norm and clipped grads.

Each rank compiles ``clip_grad_norm`` and ``clip_grad_norm_`` with
``fullgraph=True`` twice: with ``aot_eager`` (the same aten ops as eager, so
the norm and the grads must match eager bit for bit) and with ``inductor``
(generated CPU kernels that may sum in another order: 1e-6 relative). The
compiled norm must also equal the float64 norm of the whole model gathered
from both stages — so the all-reduce inside the compiled graph really ran
across ranks — and be bitwise the same on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from demo.harness import run_ranks
from ppclip_func import clip_grad_norm, clip_grad_norm_
from tests._collectives import norm_bits
from tests._reference import assert_close_rel, reference_coefficient, reference_norm

REL = 1e-6
MAX_NORM = 0.5


def _stage_grads(stage: int, dp_mesh) -> tuple[dict, dict]:
    """One stage's full float32 grads (the same on each of its ranks) and this rank's DTensor/plain form."""
    g = torch.Generator().manual_seed(7 + stage)
    full = {
        "w": torch.randn(9 + stage, 5, generator=g),  # uneven over dp=2 on stage 0
        "b": torch.randn(4, generator=g),
        "norm": torch.randn(6, generator=g),
        "big": torch.randn(64, 33, generator=g),
    }
    local = {
        "w": distribute_tensor(full["w"], dp_mesh, [Shard(0)]),
        "b": full["b"].clone(),  # plain tensor: replicated over dp
        "norm": distribute_tensor(full["norm"], dp_mesh, [Replicate()]),
        "big": distribute_tensor(full["big"], dp_mesh, [Shard(1)]),
        "frozen": None,
    }
    return full, local


def _locals(tree: dict) -> dict[str, torch.Tensor]:
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in tree.items() if v is not None}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def _worker(rank: int, world_size: int) -> dict[str, bool]:
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no compile-worker pool per rank on 2 cores
    # torch 2.13's AOTAutograd cache keys a DTensor input by its global metadata, so
    # ranks with unevenly sized local shards (stage 0's "w": 5 and 4 rows) share a key
    # and load each other's kernels (pytorch/pytorch#188390). The inductor FX graph
    # cache keys the local shapes and stays on.
    torch._functorch.config.enable_autograd_cache = False
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    full, local = _stage_grads(stage, mesh["dp"])
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (stage, full))
    model = {s: f for s, f in gathered}
    expected = reference_norm([t for s in sorted(model) for t in model[s].values()], 2.0)
    coef = reference_coefficient(expected, MAX_NORM)
    assert coef < 1.0, "the clip must bite"

    max_norm = torch.tensor(MAX_NORM)
    eager_clipped, eager_total = clip_grad_norm(local, mesh, max_norm)
    bitwise: dict[str, bool] = {}
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        pure = torch.compile(lambda g, m: clip_grad_norm(g, mesh, m), backend=backend, fullgraph=True)
        clipped, total = pure(local, max_norm)

        params = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in local.items() if v is not None}
        for k, p in params.items():
            p.grad = local[k].clone()
        inplace = torch.compile(lambda ps, m: clip_grad_norm_(ps, mesh, m), backend=backend, fullgraph=True)
        total_ = inplace(params, max_norm)

        for what, t in (("pure", total), ("in-place", total_)):
            assert_close_rel(float(t), expected, REL, f"{backend} {what} norm vs float64 reference")
            assert_close_rel(float(t), float(eager_total), REL, f"{backend} {what} norm vs eager")
            bits: list = [None] * world_size
            dist.all_gather_object(bits, norm_bits(t))
            assert len(set(bits)) == 1, f"{backend} {what}: norm differs across ranks: {bits}"
        got_pure, got_inplace, want = (
            _locals(clipped),
            _locals({k: p.grad for k, p in params.items()}),
            _locals(eager_clipped),
        )
        for k in want:
            assert isinstance(clipped[k], DTensor) == isinstance(local[k], DTensor), k
            assert _rel_err(got_pure[k], want[k]) <= REL, f"{backend} pure {k}"
            assert _rel_err(got_inplace[k], want[k]) <= REL, f"{backend} in-place {k}"
            # And the clip really scaled: against the float64 reference coefficient.
            full_k = clipped[k].full_tensor() if isinstance(clipped[k], DTensor) else clipped[k]
            assert _rel_err(full_k, full[k].double() * coef) <= REL + 2e-7, f"{backend} {k} vs reference"

        same = norm_bits(total) == norm_bits(eager_total) and norm_bits(total_) == norm_bits(eager_total)
        same_grads = all(torch.equal(got_pure[k], want[k]) and torch.equal(got_inplace[k], want[k]) for k in want)
        if backend == "aot_eager":
            # The same aten ops in the same order as eager: the same bits.
            assert same and same_grads, "aot_eager must reproduce eager bit for bit"
        bitwise[backend] = same
        bitwise[f"{backend}_grads"] = same_grads
    torch._dynamo.reset()
    return bitwise


@pytest.mark.slow
def test_compiled_clip_on_pp_by_fsdp_ranks_matches_eager():
    results = run_ranks(_worker, 4, timeout=420)
    assert len(results) == 4 and all(r["aot_eager"] for r in results)
