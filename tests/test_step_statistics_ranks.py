"""On 4 gloo ranks: the step's loss statistics and the normalized clip, from one collective, against float64.

Mesh ("pp", "dp") = (2, 2) with FSDP-style ``Shard(0)`` grads, and
("pp", "tp") = (2, 2) where both tensor-parallel ranks of the last stage
hold the same loss. Only the last stage computes a loss; the first passes
``LocalLoss(0.0, 0)``. The reference gathers every rank's loss, tokens and
gradients and computes the mean loss, the token count, the norm of the
normalized gradient and the clipped gradients the obvious way, in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ppclip_func import LocalLoss, clip_grad_norm_with_loss, clip_grad_norm_with_loss_
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, norm_bits, steady_count
from tests._gather import gather_objects, model_gradient
from tests._reference import reference_coefficient, reference_norm

MAX_NORM = 0.5


def _grads(stage: int, shard_mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    """One stage's gradients (the same full values on every rank of the stage), sharded over ``shard_mesh``."""
    g = torch.Generator().manual_seed(10 + stage)
    full = {f"stage{stage}.w": torch.randn(6, 3, generator=g) * 40, f"stage{stage}.b": torch.randn(5, generator=g)}
    if shard_mesh is None:
        return full
    return {n: distribute_tensor(t, shard_mesh, [Shard(0)]) for n, t in full.items()}


def _local_loss(stage: int, rank: int, copies: int) -> LocalLoss:
    """The last stage's ranks hold a loss (``copies`` ranks the same one); the first stage none."""
    if stage == 0:
        return LocalLoss(0.0, 0, copies=copies)
    seed = rank // copies  # ranks holding one copy compute the same values
    return LocalLoss(torch.tensor(3.0 + 1.5 * seed), torch.tensor(4 + 3 * seed), copies=copies)


def _check(mesh: DeviceMesh, shard_mesh: DeviceMesh | None, copies: int) -> None:
    rank = torch.distributed.get_rank()
    stage = mesh.get_coordinate()[0]
    grads, loss = _grads(stage, shard_mesh), _local_loss(stage, rank, copies)

    # The reference, from what every rank holds: each copy of a loss once, each gradient once.
    everyone = gather_objects((rank // copies if stage else None, float(loss.loss_sum), float(loss.tokens)))
    distinct = {key: (s, n) for key, s, n in everyone if key is not None}
    loss_sum, tokens = sum(s for s, _ in distinct.values()), sum(n for _, n in distinct.values())
    model = model_gradient(grads)
    norm = reference_norm(list(model.values()), 2.0) / tokens
    coef = reference_coefficient(norm, MAX_NORM)
    assert coef < 0.9, "the clip scales: the check is not vacuous"

    with CollectiveCounter() as counter:
        clipped, stats = clip_grad_norm_with_loss(grads, mesh, MAX_NORM, loss)
    assert steady_count(counter) == 1, counter.ops
    assert float(stats.tokens) == tokens
    assert float(stats.loss) == pytest.approx(loss_sum / tokens, rel=1e-12)
    assert float(stats.total_norm) == pytest.approx(norm, rel=1e-6)
    assert not bool(stats.nonfinite)
    bits = gather_objects([norm_bits(t) for t in stats[:3]])
    assert all(b == bits[0] for b in bits), f"the statistics differ across ranks: {bits}"
    for name, got in model_gradient(clipped).items():
        torch.testing.assert_close(got, model[name] * coef / tokens, rtol=1e-6, atol=1e-12)

    # In place: the same bits.
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in grads.items()}
    for n, p in params.items():
        p.grad = grads[n].clone()
    inplace = clip_grad_norm_with_loss_(params.values(), mesh, MAX_NORM, loss)
    assert [norm_bits(t) for t in inplace[:3]] == [norm_bits(t) for t in stats[:3]]
    for n, p in params.items():
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        want = clipped[n].to_local() if isinstance(clipped[n], DTensor) else clipped[n]
        assert torch.equal(local, want), n


def a_loss_on_the_last_stage_gives_every_rank_the_global_mean_and_the_normalized_clip(
    rank: int, world_size: int
) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    _check(mesh, mesh["dp"], copies=1)


def tensor_parallel_copies_of_one_loss_are_counted_once(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    _check(mesh, None, copies=2)  # plain grads: replicated over tp


def a_malformed_loss_on_one_rank_raises_there_and_flags_the_step_everywhere_else(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    grads = _grads(mesh.get_coordinate()[0], mesh["dp"])
    if rank == 3:  # a float16 loss sum, on one rank only
        with pytest.raises(TypeError, match="overflows float16"):
            clip_grad_norm_with_loss(grads, mesh, MAX_NORM, LocalLoss(torch.tensor(1.0, dtype=torch.float16), 2))
    else:
        _, stats = clip_grad_norm_with_loss(grads, mesh, MAX_NORM, LocalLoss(torch.tensor(1.0), 2))
        assert math.isnan(float(stats.total_norm)) and bool(stats.nonfinite)
        assert math.isnan(float(stats.loss)), "the poisoned entries reach the loss too"
    # Nobody was left inside the all-reduce: a good step still works on every rank.
    _, stats = clip_grad_norm_with_loss(grads, mesh, MAX_NORM, LocalLoss(torch.tensor(1.0), 2))
    assert float(stats.tokens) == 8.0 and not bool(stats.nonfinite)


test_on_real_ranks = real_rank_test(
    [
        a_loss_on_the_last_stage_gives_every_rank_the_global_mean_and_the_normalized_clip,
        tensor_parallel_copies_of_one_loss_are_counted_once,
        a_malformed_loss_on_one_rank_raises_there_and_flags_the_step_everywhere_else,
    ],
    4,
    share=True,
)
