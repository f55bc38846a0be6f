"""On real ranks: bad input fails everywhere before the collective, non-finite norms are one decision.

Four gloo ranks, mesh ("pp", "dp") = (2, 2). After every expected failure
the ranks run a good clip together: had any rank been left inside an
all-reduce that the others skipped, that clip would hang (and the harness
would kill it and name the rank).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from ppclip_func import clip_grad_norm, clip_grad_norm_
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, norm_bits, steady_count
from tests._reference import assert_close_rel


def _all_equal(x) -> bool:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return len(set(out)) == 1


def _good_clip_still_works(mesh) -> None:
    grads = {"w": distribute_tensor(torch.ones(4, 2), mesh["dp"], [Shard(0)])}
    _, total = clip_grad_norm(grads, mesh, 1.0)
    assert float(total) == pytest.approx(math.sqrt(16.0)), float(total)  # 8 ones per stage, 2 stages


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))


def bad_input_on_every_rank_raises_the_same_error_after_the_one_collective(rank: int, world_size: int) -> None:
    mesh = _mesh()
    bad = {"w": distribute_tensor(torch.ones(4, 2), mesh["dp"], [Shard(0)]), "step": torch.ones(1, dtype=torch.int32)}
    with CollectiveCounter() as counter, pytest.raises(TypeError, match=r"leaf \['step'\] has dtype torch.int32"):
        clip_grad_norm(bad, mesh, 1.0)
    assert steady_count(counter) == 1
    _good_clip_still_works(mesh)


def bad_input_on_one_stage_raises_there_and_gives_the_other_a_nonfinite_norm(rank: int, world_size: int) -> None:
    mesh = _mesh()
    stage = mesh.get_coordinate()[0]
    # A Partial grad on stage 1 only: that stage raises, the other gets a non-finite norm instead of waiting.
    for norm_type in (2.0, math.inf, -math.inf):
        if stage == 1:
            leaf = DTensor.from_local(torch.ones(4), mesh["dp"], [Partial("sum")], run_check=False)
            with pytest.raises(ValueError, match=r"leaf \['v'\] has a Partial placement"):
                clip_grad_norm({"v": leaf}, mesh, 1.0, norm_type)
        else:
            _, total = clip_grad_norm({"w": torch.ones(4)}, mesh, 1.0, norm_type)
            assert not math.isfinite(float(total)), float(total)
        _good_clip_still_works(mesh)


def an_inf_on_one_rank_is_zeroed_or_raised_alike_on_every_rank(rank: int, world_size: int) -> None:
    mesh = _mesh()

    def grads_with_inf():
        g = torch.ones(4, 2)
        if rank == 2:
            g[0, 0] = math.inf
        # Each rank passes its own local shard: the inf is on rank 2 only.
        return {"w": DTensor.from_local(g[:2], mesh["dp"], [Shard(0)], run_check=False)}

    for norm_type in (2.0, 1.0, math.inf):
        clipped, total = clip_grad_norm(grads_with_inf(), mesh, 1.0, norm_type, nonfinite="zero")
        assert math.isinf(float(total)) and _all_equal(norm_bits(total))
        assert torch.equal(clipped["w"].to_local(), torch.zeros(2, 2)), "every rank zeroes its grads"

        params = {"w": torch.nn.Parameter(torch.zeros(4, 2))}
        params["w"].grad = grads_with_inf()["w"]
        total_ = clip_grad_norm_(params, mesh, 1.0, norm_type, nonfinite="zero")
        assert norm_bits(total_) == norm_bits(total)
        assert torch.equal(params["w"].grad.to_local(), torch.zeros(2, 2))

        with pytest.raises(RuntimeError, match=rf"non-finite \(inf, norm_type={norm_type}\)"):
            clip_grad_norm(grads_with_inf(), mesh, 1.0, norm_type, nonfinite="error")
        _good_clip_still_works(mesh)


def overflow_safe_norm_of_1e20_grads_is_finite_and_identical_on_every_rank(rank: int, world_size: int) -> None:
    mesh = _mesh()
    stage = mesh.get_coordinate()[0]
    big = {"w": distribute_tensor(torch.full((4096, 2), 1e20 * (1 + stage)), mesh["dp"], [Shard(0)])}
    _, total = clip_grad_norm(big, mesh, 1.0, overflow_safe=True)
    expected = math.sqrt(8192 * (1e20**2) * (1 + 4))
    assert_close_rel(float(total), expected, 1e-6)
    assert _all_equal(norm_bits(total))


test_on_real_ranks = real_rank_test(
    [
        bad_input_on_every_rank_raises_the_same_error_after_the_one_collective,
        bad_input_on_one_stage_raises_there_and_gives_the_other_a_nonfinite_norm,
        an_inf_on_one_rank_is_zeroed_or_raised_alike_on_every_rank,
        overflow_safe_norm_of_1e20_grads_is_finite_and_identical_on_every_rank,
    ],
    4,
    share=True,
)
