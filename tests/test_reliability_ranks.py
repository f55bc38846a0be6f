"""On real ranks: no silent wrong norm, and no rank left waiting in the collective.

Four gloo ranks run every case in one start (``demo/harness.py``,
``run_cases``). A rank left inside an all-reduce that a peer skipped is
released by gloo's timeout and its case fails; each case ends with a good
clip on every rank, which would hang had the ranks fallen out of step.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ppclip_func import clip_grad_norm, clip_grad_norm_, global_grad_norm
from ppclip_func._core import agreement as _agree
from ppclip_func._core import measure as _measure
from tests._cases import real_rank_test
from tests._collectives import norm_bits
from tests._gather import gather_objects
from tests._reference import assert_close_rel, reference_norm

WORLD = 4
NORM_TYPES = (2.0, 1.0, 3.5, math.inf, -math.inf, 0.0)


def _pp_dp():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return mesh, mesh.get_coordinate()[0]


def _same_everywhere(x) -> bool:
    return len(set(gather_objects(x))) == 1


def _good_clip_still_works(mesh) -> None:
    grads = {"w": distribute_tensor(torch.ones(4, 2), mesh["dp"], [Shard(0)])}
    _, total = clip_grad_norm(grads, mesh, 1.0)
    assert float(total) == pytest.approx(4.0), float(total)  # 8 ones per stage, 2 stages


def _expect_nan_or_raise(rank_fails: bool, error: type, match: str, call) -> None:
    """The failing ranks raise ``error``; the others get a NaN norm instead of waiting for them."""
    if rank_fails:
        with pytest.raises(error, match=match):
            call()
    else:
        total = call()
        total = total[1] if isinstance(total, tuple) else total
        assert math.isnan(float(total)), float(total)


# --- 1. a NaN on any rank ----------------------------------------------------------------------


def nan_on_a_later_rank_reaches_every_rank(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    groups = {"w": "w", "v": "v"}
    for nan_rank in (1, 3):  # never first: a max/min all-reduce keeps a NaN only when it comes first

        def grads(nan_rank: int = nan_rank):
            w = torch.ones(4) * (rank + 1)
            if rank == nan_rank:
                w[1] = math.nan
            return {"w": DTensor.from_local(w, mesh, [Shard(0)], run_check=False), "v": torch.full((2,), 3.0)}

        for norm_type in NORM_TYPES:
            total, per_group = global_grad_norm(grads(), mesh, norm_type, groups=groups)
            assert _same_everywhere((norm_bits(total), norm_bits(per_group["w"]), norm_bits(per_group["v"])))
            assert_close_rel(float(per_group["v"]), reference_norm([torch.full((2,), 3.0)], norm_type), 1e-6)
            if norm_type == 0:  # a count of non-zero elements: a NaN is one, as in torch.linalg.vector_norm
                assert float(total) == 16 + 2, float(total)
                continue
            assert math.isnan(float(total)) and math.isnan(float(per_group["w"])), (norm_type, total, per_group)

            clipped, _ = clip_grad_norm(grads(), mesh, 1.0, norm_type, nonfinite="zero")
            assert torch.equal(clipped["w"].to_local(), torch.zeros(4)), "every rank zeroes its grads"
            params = {}
            for k, g in grads().items():
                params[k] = torch.nn.Parameter(torch.zeros_like(g))
                params[k].grad = g
            clip_grad_norm_(params, mesh, 1.0, norm_type, nonfinite="zero")
            assert torch.equal(params["w"].grad.to_local(), torch.zeros(4))
            assert torch.equal(params["v"].grad, torch.zeros(2))
    _good_clip_still_works(_pp_dp()[0])


# --- 3. the norm's dtype: tests/test_exact_ranks.py -------------------------------------------


# --- 4. tied names that match nothing ---------------------------------------------------------


def a_tied_name_matching_nothing_raises_and_releases_the_other_stage(rank: int, world_size: int) -> None:
    mesh, stage = _pp_dp()
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))]
    for p in params:
        p.grad = torch.ones_like(p)
    if stage == 0:
        # model.parameters() carries no names: the declaration would match nothing and count twice.
        tied = {"tok_embeddings.weight": 2}
        with pytest.raises(ValueError, match=r"tied\['tok_embeddings.weight'\] matches none of this rank's"):
            clip_grad_norm_(params, mesh, 1.0, tied=tied)
    else:
        # The last stage names its half of the pair (the declarations pair up across stages).
        named = {"output.weight": params[0], "norm.weight": params[1]}
        assert math.isnan(float(clip_grad_norm_(named, mesh, 1.0, tied={"output.weight": 2}))), "released"
    _good_clip_still_works(mesh)


def a_tied_name_declared_on_one_stage_only_raises_on_every_rank(rank: int, world_size: int) -> None:
    # The options check runs when a rank first sees a configuration; forget the earlier cases', as at the
    # start of a run (a stage returning to a configuration it used before is the check's documented limit).
    _agree.forget_configurations()
    mesh, stage = _pp_dp()
    named = {"w": torch.nn.Parameter(torch.ones(4))}
    named["w"].grad = torch.ones(4)
    tied = {"w": 2} if stage == 0 else None
    with pytest.raises(ValueError, match=r"tied \(the declarations do not pair up across pipeline stages"):
        clip_grad_norm_(named, mesh, 1.0, tied=tied)
    assert torch.equal(named["w"].grad, torch.ones(4)), "no gradient scaled"
    _good_clip_still_works(mesh)


# --- 7-10. every failing rank joins the collective ---------------------------------------------


def a_bad_parameter_on_one_stage_releases_the_other(rank: int, world_size: int) -> None:
    mesh, stage = _pp_dp()
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    params = [p, "not a parameter"] if stage == 1 else [p]
    _expect_nan_or_raise(
        stage == 1, TypeError, "parameters must be tensors, got str", lambda: clip_grad_norm_(params, mesh, 1.0)
    )
    _good_clip_still_works(mesh)


def float8_grads_and_any_error_release_the_other_stage(rank: int, world_size: int) -> None:
    mesh, stage = _pp_dp()
    grads = {"w": torch.ones(4)}
    if stage == 1:
        grads["f8"] = torch.ones(4).to(torch.float8_e4m3fn)
    _expect_nan_or_raise(
        stage == 1, TypeError, r"leaf \['f8'\] has dtype torch.float8_e4m3fn", lambda: clip_grad_norm(grads, mesh, 1.0)
    )

    def kernel_fails(*args, **kwargs):
        raise RuntimeError("a kernel failed on this rank")

    with pytest.MonkeyPatch.context() as patch:
        if stage == 1:
            patch.setattr(_measure, "local_statistics", kernel_fails)
        _expect_nan_or_raise(
            stage == 1, RuntimeError, "a kernel failed", lambda: clip_grad_norm({"w": torch.ones(4)}, mesh, 1.0)
        )
    _good_clip_still_works(mesh)


def with_mesh_none_a_failing_rank_releases_the_dtensor_mesh(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    grads = {"w": DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False)}
    if rank == 2:
        grads["step"] = torch.ones(1, dtype=torch.int64)
    _expect_nan_or_raise(
        rank == 2, TypeError, r"leaf \['step'\] has dtype torch.int64", lambda: clip_grad_norm(grads, None, 1.0)
    )
    _good_clip_still_works(_pp_dp()[0])


def under_compile_a_failing_rank_releases_its_peers(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch._dynamo.reset()
    step = torch.compile(lambda g: clip_grad_norm(g, mesh, 1.0)[1], backend="aot_eager", fullgraph=True)
    assert float(step({"w": torch.ones(4)})) == pytest.approx(2.0)  # compiled on every rank
    grads = {"w": torch.ones(4)}
    if rank == 1:  # a changed input: rank 1 alone re-traces, and fails while tracing
        grads["step"] = torch.ones(1, dtype=torch.int64)
    # Dynamo wraps the clip's TypeError in its own exception; the message is kept.
    _expect_nan_or_raise(rank == 1, Exception, r"leaf \['step'\] has dtype torch.int64", lambda: step(grads))
    torch._dynamo.reset()
    _good_clip_still_works(_pp_dp()[0])


# --- 11. no process group is made inside the clip ----------------------------------------------


def a_stage_that_never_clips_stays_in_step(rank: int, world_size: int) -> None:
    world = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    stage = world.get_coordinate()[0]
    grads = {
        "w": distribute_tensor(
            torch.arange(8.0).reshape(4, 2) * (stage + 1), world["dp", "tp"], [Shard(0), Replicate()]
        )
    }
    if stage == 0:  # stage 1 is frozen and never calls the clip
        with pytest.raises(ValueError, match=r"no process group of its own"):
            clip_grad_norm(grads, None, 1.0)
    # Every rank makes a group and uses it: had the clip made groups on stage 0
    # only, the ranks would number this one differently and hang here.
    group = dist.new_group()
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert float(t) == world_size

    # Flattened up front on every rank, the per-stage norm over that group is exact.
    world["dp", "tp"]._flatten()
    if stage == 0:
        _, total = clip_grad_norm(grads, None, 1.0)
        assert_close_rel(float(total), reference_norm([torch.arange(8.0)], 2.0), 1e-6)
    group = dist.new_group()
    dist.all_reduce(t, group=group)
    _good_clip_still_works(world["pp", "dp"])


# --- mesh=None with DTensor leaves, numerically ------------------------------------------------


def with_mesh_none_dtensors_reduce_over_their_own_mesh(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(7)
    full = {"wq": torch.randn(6, 4, generator=g), "norm": torch.randn(5, generator=g), "b": torch.randn(3, generator=g)}
    grads = {
        "wq": distribute_tensor(full["wq"], mesh, [Shard(0), Shard(1)]),
        "norm": distribute_tensor(full["norm"], mesh, [Replicate(), Replicate()]),
        "b": distribute_tensor(full["b"], mesh["tp"], [Shard(0)]),  # a smaller mesh, nested in the largest
    }
    for norm_type in NORM_TYPES:
        total = global_grad_norm(grads, None, norm_type)
        assert_close_rel(float(total), reference_norm(full.values(), norm_type), 1e-6, f"norm_type={norm_type}")
        assert _same_everywhere(norm_bits(total))
    _good_clip_still_works(_pp_dp()[0])


CASES = [
    nan_on_a_later_rank_reaches_every_rank,
    a_tied_name_matching_nothing_raises_and_releases_the_other_stage,
    a_tied_name_declared_on_one_stage_only_raises_on_every_rank,
    a_bad_parameter_on_one_stage_releases_the_other,
    float8_grads_and_any_error_release_the_other_stage,
    with_mesh_none_a_failing_rank_releases_the_dtensor_mesh,
    under_compile_a_failing_rank_releases_its_peers,
    a_stage_that_never_clips_stays_in_step,
    with_mesh_none_dtensors_reduce_over_their_own_mesh,
]


test_on_real_ranks = real_rank_test(CASES, WORLD, share=True)
