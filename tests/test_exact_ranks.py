"""On 4 real gloo ranks (PP=2 × DP=2): one float64 norm everywhere, and a non-finite norm stops every rank.

All cases run in one start of the ranks (``tests/_cases.real_rank_test``,
hard timeouts: a rank left inside a collective is released by gloo's
timeout and its case fails).

* A float64 leaf on one pipeline stage only: both stages return the same
  float64 norm, bit for bit, equal to the float64 norm of the whole model
  (finite where torch's is, for 2e200 gradients), and scale their fp32 leaf
  by the same coefficient, bit for bit.
* ``nonfinite="abort"`` with a non-finite gradient on one rank: every rank
  raises (on CPU ``torch._assert_async`` raises where it runs), eagerly and
  in a compiled graph, and the ranks stay in step: a good clip follows.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ppclip_func import clip_grad_norm, clip_grad_norm_, global_grad_norm
from tests._cases import real_rank_test
from tests._collectives import norm_bits
from tests._gather import gather_objects
from tests._reference import assert_close_rel, reference_coefficient, reference_norm

WORLD = 4
NORM_TYPES = (2.0, 1.0, 3.5, math.inf, -math.inf, 0.0)
ABORTED = r"non-finite \(nonfinite='abort'\)"


def _pp_dp():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return mesh, mesh.get_coordinate()[0]


def _good_clip_still_works(mesh) -> None:
    grads = {"w": distribute_tensor(torch.ones(4, 2), mesh["dp"], [Shard(0)])}
    _, total = clip_grad_norm(grads, mesh, 1.0)
    assert float(total) == pytest.approx(4.0), float(total)  # 8 ones per stage, 2 stages


def _stage_tree(mesh, stage: int, f64: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
    """Both stages: an fp32 FSDP-style leaf and an fp32 plain leaf ``c``, equal on both stages (so their
    clipped values must be too); stage 0 also holds the float64 leaf ``f64``. Returns the tree and the
    stage's full leaves."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(6, 3, generator=g)
    c = torch.randn(5, generator=g)
    tree = {"w": distribute_tensor(w, mesh["dp"], [Shard(0)]), "c": c}
    full = [w, c]
    if stage == 0:
        tree["f64"] = f64
        full.append(f64)
    return tree, full


def a_float64_leaf_on_one_stage_gives_every_rank_the_same_norm_and_coefficient(rank: int, world_size: int) -> None:
    mesh, stage = _pp_dp()
    moderate = torch.randn(7, generator=torch.Generator().manual_seed(12), dtype=torch.float64) / 3
    cases = [(moderate, p) for p in NORM_TYPES] + [
        (torch.full((10,), 2e200, dtype=torch.float64), p) for p in (1.0, math.inf)
    ]
    wrong_f64: list[float] = []
    for f64, norm_type in cases:
        tree, full = _stage_tree(mesh, stage, f64)
        stages = dict(gather_objects((stage, full)))
        expected = reference_norm([t for s in sorted(stages) for t in stages[s]], norm_type)
        assert math.isfinite(expected)

        total = global_grad_norm(tree, mesh, norm_type)
        _, groups = global_grad_norm(tree, mesh, norm_type, groups={"c": "c"})
        # A plain float64 tensor, not the collective's AsyncCollectiveTensor (p=1 and 0 are a view of it).
        assert type(total) is torch.Tensor and type(groups["c"]) is torch.Tensor, (type(total), type(groups["c"]))
        assert total.dtype == torch.float64, total.dtype
        assert len(set(gather_objects(norm_bits(total)))) == 1, "the norm differs between ranks"
        # The fp32 leaves bound the precision (1e-6); a 2e200 float64 leaf dominates: float64 precision.
        assert_close_rel(float(total), expected, 1e-6 if abs(float(f64[0])) < 1e10 else 1e-15, f"p={norm_type}")

        # The clip bites. Beyond float32's range (2e200) fp32 leaves get a float32 coefficient of 0.
        max_norm = expected / 2 if expected < 1e30 else 1.0
        params = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in tree.items()}
        for k, p in params.items():
            p.grad = tree[k].clone()
        total_ = clip_grad_norm_(params, mesh, max_norm, norm_type)
        assert norm_bits(total_) == norm_bits(total)
        c_bits = params["c"].grad.view(torch.int32).tolist()
        assert len(set(map(tuple, gather_objects(c_bits)))) == 1, "the fp32 leaf was scaled differently"
        if stage == 0:  # no collective may follow a stage's own assertion: checked after the loop
            # The float64 leaf's coefficient: float64 arithmetic on the shared norm, as torch's.
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            want = reference_coefficient(expected, max_norm)
            if not torch.equal(params["f64"].grad, f64 * coef) or abs(float(coef) - want) > 1e-6 * want:
                wrong_f64.append(norm_type)
    _good_clip_still_works(mesh)
    assert not wrong_f64, f"float64 leaf not scaled by the float64 coefficient for norm types {wrong_f64}"


def a_nonfinite_gradient_on_one_rank_aborts_every_rank(rank: int, world_size: int) -> None:
    mesh, _ = _pp_dp()
    # An inf element leaves the -inf norm (the smallest |x|) finite, as in torch: only NaN stops that one.
    cases = [(math.inf, 2.0), (math.inf, math.inf), (math.nan, 2.0), (math.nan, math.inf), (math.nan, -math.inf)]
    for bad, norm_type in cases:
        w = torch.ones(3) * (rank + 1)
        if rank == 3:  # never the first rank: a max/min all-reduce keeps a NaN only when it comes first
            w[1] = bad
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = w.clone()
        with pytest.raises(RuntimeError, match=ABORTED):
            clip_grad_norm_([p], mesh, 1.0, norm_type, nonfinite="abort")
        torch.testing.assert_close(p.grad, w, equal_nan=True, rtol=0.0, atol=0.0)  # nothing scaled
    _good_clip_still_works(mesh)


def a_compiled_abort_stops_every_rank_too(rank: int, world_size: int) -> None:
    torch._functorch.config.enable_autograd_cache = False
    mesh, _ = _pp_dp()
    p = torch.nn.Parameter(torch.zeros(3))
    torch._dynamo.reset()
    step = torch.compile(
        lambda: clip_grad_norm_([p], mesh, 1.0, nonfinite="abort"), backend="aot_eager", fullgraph=True
    )
    p.grad = torch.ones(3)
    assert float(step()) == pytest.approx(math.sqrt(2 * 3))  # a plain leaf is replicated over dp: 2 stages of 3 ones
    p.grad = torch.ones(3)
    if rank == 3:
        p.grad[0] = math.inf
    with pytest.raises(RuntimeError, match=ABORTED):
        step()
    _good_clip_still_works(mesh)


CASES = [
    a_float64_leaf_on_one_stage_gives_every_rank_the_same_norm_and_coefficient,
    a_nonfinite_gradient_on_one_rank_aborts_every_rank,
    a_compiled_abort_stops_every_rank_too,
]

test_on_real_ranks = real_rank_test(CASES, WORLD, case_timeout=120.0, share=True)
