"""A real 4-rank gloo run: mesh ("pp", "dp") with FSDP-style Shard(0) DTensor grads.

Stage ``s`` of the pipeline holds its own parameters, sharded over ``dp``
(plus a plain replicated tensor and a Replicate DTensor). The clip's norm must
equal the float64 norm of the whole model gradient gathered from both stages,
be bitwise equal on every rank, and come from exactly one collective.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ppclip_func import clip_grad_norm, clip_grad_norm_
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, norm_bits, steady_count
from tests._reference import assert_close_rel, reference_coefficient, reference_norm

NORM_TYPES = [2.0, 1.0, 3.5, math.inf, -math.inf, 0.0]


def _stage_grads(stage: int, seed: int, dtype: torch.dtype, dp_mesh):
    """The full gradients of one stage (same on every rank of the stage) and their DTensor form."""
    g = torch.Generator().manual_seed(1000 * seed + stage)
    full = {
        "w": torch.randn(9 + stage, 5, generator=g, dtype=torch.float64),  # uneven over dp=2 on stage 0
        "b": torch.randn(4, generator=g, dtype=torch.float64),
        "norm": torch.randn(6, generator=g, dtype=torch.float64),
    }
    full = {k: v.to(dtype) for k, v in full.items()}
    local = {
        "w": distribute_tensor(full["w"], dp_mesh, [Shard(0)]),
        "b": full["b"].clone(),  # plain tensor: replicated over dp
        "norm": distribute_tensor(full["norm"], dp_mesh, [Replicate()]),
        "unused": None,
    }
    return full, local


def _clip_equals_the_reference(world_size: int, dtype: torch.dtype) -> None:
    """Pure and in-place clips, every norm type, three seeds: the float64 reference, one collective, every rank alike."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    for seed in range(3):
        full, local = _stage_grads(stage, seed, dtype, mesh["dp"])
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, (stage, full))
        model = {s: f for s, f in gathered}  # one entry per stage: dedupe dp replicas
        all_full = [t for s in sorted(model) for t in model[s].values()]
        for norm_type in NORM_TYPES:
            expected = reference_norm(all_full, norm_type)
            assert expected > 0, (norm_type, expected)
            max_norm = expected / 2  # the clip always scales: the check below is not vacuous
            with CollectiveCounter() as counter:
                clipped, total = clip_grad_norm(local, mesh, max_norm, norm_type)
            assert steady_count(counter) == 1, f"expected one collective, saw {counter.ops}"

            assert_close_rel(float(total), expected, 1e-6 if dtype == torch.float32 else 1e-5)
            bits: list = [None] * world_size
            dist.all_gather_object(bits, norm_bits(total))
            assert len(set(bits)) == 1, f"norm differs across ranks: {bits}"

            coef = reference_coefficient(expected, max_norm)
            assert coef < 0.51, coef
            for name, leaf in clipped.items():
                if leaf is None:
                    continue
                got = leaf.full_tensor() if isinstance(leaf, DTensor) else leaf
                assert isinstance(leaf, DTensor) == isinstance(local[name], DTensor)
                if isinstance(leaf, DTensor):
                    assert leaf.placements == local[name].placements and leaf.device_mesh == local[name].device_mesh
                want = full[name].to(torch.float64) * coef
                tol = torch.finfo(dtype).eps + 2e-6
                torch.testing.assert_close(got.to(torch.float64), want, rtol=tol, atol=1e-30)

            # The in-place drop-in: same norm, same single collective, grads scaled in place.
            params = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in local.items() if v is not None}
            for k, p in params.items():
                p.grad = local[k].clone()
            with CollectiveCounter() as counter:
                total_ = clip_grad_norm_(params.values(), mesh, max_norm, norm_type)
            assert steady_count(counter) == 1, counter.ops
            assert norm_bits(total_) == norm_bits(total)
            for k, p in params.items():
                a = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                b = clipped[k].to_local() if isinstance(clipped[k], DTensor) else clipped[k]
                assert torch.equal(a, b), k


def fp32_grads_sharded_over_dp_on_two_stages_clip_as_the_float64_reference(rank: int, world_size: int) -> None:
    _clip_equals_the_reference(world_size, torch.float32)


def bf16_grads_sharded_over_dp_on_two_stages_clip_as_the_float64_reference(rank: int, world_size: int) -> None:
    _clip_equals_the_reference(world_size, torch.bfloat16)


test_on_real_ranks = real_rank_test(
    [
        fp32_grads_sharded_over_dp_on_two_stages_clip_as_the_float64_reference,
        bf16_grads_sharded_over_dp_on_two_stages_clip_as_the_float64_reference,
    ],
    4,
    share=True,
)
