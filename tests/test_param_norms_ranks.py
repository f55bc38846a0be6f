"""Per-parameter norms on real ranks: every parameter of every stage, on every rank, from the one collective.

Four gloo ranks as a (pp=2, dp=2) mesh, one start for every case
(``demo/harness.py``, ``run_cases``). The two stages hold different
parameters: FSDP-sharded DTensors (``Shard(0)`` and ``Shard(1)``), plain
replicated tensors, an empty leaf, a parameter whose grad is ``None``, and an
embedding tied across both stages. The reference is the whole model's
gradient gathered in float64 (``tests/_gather.py``), one ``vector_norm`` per
parameter.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ppclip_func import adaptive_clip_grad_norm, adaptive_clip_grad_norm_, init_clip_state, param_norm_index
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, norm_bits, steady_count
from tests._gather import gather_objects, model_gradient
from tests._reference import assert_close_rel, reference_norm

WORLD = 4
NORM_TYPES = (2.0, 1.0, 3.5, math.inf, -math.inf, 0.0)
TIED = {"embed.weight": 2}


def _stage_params(mesh, stage: int, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """This rank's gradients, by the model's parameter names; the same values on both dp ranks of a stage."""
    dp = mesh["dp"]
    d = dp.get_local_rank()
    g = torch.Generator().manual_seed(100 * stage + seed)

    def sharded(shape, dim):
        full = torch.rand(shape, generator=g) - 0.3
        local = full.chunk(2, dim=dim)[d].contiguous()
        return DTensor.from_local(local, dp, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())

    embed = torch.rand(6, 4, generator=torch.Generator().manual_seed(7 + seed))  # identical on both stages
    if stage == 0:
        return {
            "embed.weight": embed,
            "layers.0.w": sharded((8, 4), 0),
            "layers.0.b": torch.rand(4, generator=g),
            "layers.0.unused": None,
        }
    return {
        "layers.1.w": sharded((4, 10), 1),
        "layers.1.empty": torch.zeros(0),
        "norm.weight": torch.rand(4, generator=g) + 0.1,
        "embed.weight": embed,
    }


def _setup():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    return mesh, stage


def _as_params(grads):
    params = {}
    for name, g in grads.items():
        p = torch.nn.Parameter(torch.zeros_like(g) if g is not None else torch.zeros(1))
        if g is not None:
            p.grad = g.clone()
        params[name] = p
    return params


def every_parameter_norm_on_every_rank_matches_the_reference(rank: int, world_size: int) -> None:
    mesh, stage = _setup()
    grads = _stage_params(mesh, stage)
    index = param_norm_index(grads | {"layers.0.unused": torch.zeros(1)} if stage == 0 else grads, mesh)
    assert index.names == (
        "embed.weight", "layers.0.w", "layers.0.b", "layers.0.unused",
        "layers.1.w", "layers.1.empty", "norm.weight",
    )  # fmt: skip
    model = model_gradient(grads)
    for norm_type in NORM_TYPES:
        with CollectiveCounter() as counter:
            _, stats = adaptive_clip_grad_norm(grads, mesh, init_clip_state(), norm_type, param_norms=index, tied=TIED)
            named = index.named(stats.param_norms)
            values = {k: float(v) for k, v in named.items()}
        assert steady_count(counter) == 1, counter.ops
        for name, value in values.items():
            if name == "layers.0.unused":
                assert math.isnan(value), "a parameter with no gradient anywhere has no norm"
                continue
            assert_close_rel(value, reference_norm([model[name]], norm_type), 1e-6, f"{name}, norm_type={norm_type}")
        assert_close_rel(float(stats.total_norm), reference_norm(model.values(), norm_type), 1e-6, "total")
        bits = (*(norm_bits(v) for v in stats.param_norms.unbind()), norm_bits(stats.total_norm))
        assert len(set(gather_objects(bits))) == 1, "every rank holds the same bits"


def groups_total_and_in_place_clip_compose_with_parameter_norms(rank: int, world_size: int) -> None:
    mesh, stage = _setup()
    grads = _stage_params(mesh, stage, seed=1)
    params = _as_params(grads)
    index = param_norm_index(params, mesh)
    model = model_gradient(grads)
    groups = {"layers": "layers", "embed": "embed"}
    with CollectiveCounter() as counter:
        stats = adaptive_clip_grad_norm_(params, mesh, init_clip_state(), groups=groups, tied=TIED, param_norms=index)
    assert steady_count(counter) == 1, counter.ops
    layers = [v for k, v in model.items() if k.startswith("layers")]
    assert_close_rel(float(stats.group_norms["layers"]), reference_norm(layers, 2.0), 1e-6, "layers group")
    assert_close_rel(float(stats.group_norms["embed"]), reference_norm([model["embed.weight"]], 2.0), 1e-6)
    total = reference_norm(model.values(), 2.0)
    assert_close_rel(float(stats.total_norm), total, 1e-6, "total")
    coef = min(1.0 / (total + 1e-6), 1.0)
    for name, g in grads.items():
        if g is None:
            continue
        got = params[name].grad
        got = got.to_local() if isinstance(got, DTensor) else got
        want = (g.to_local() if isinstance(g, DTensor) else g).double() * coef
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-9)
    norms = index.named(stats.param_norms)
    assert_close_rel(float(norms["norm.weight"]), reference_norm([model["norm.weight"]], 2.0), 1e-6)


def a_tree_unlike_the_index_raises_on_every_rank_and_releases_peers(rank: int, world_size: int) -> None:
    mesh, stage = _setup()
    grads = _stage_params(mesh, stage)
    index = param_norm_index(grads, mesh)
    wrong = dict(grads) if stage == 0 else {**grads, "extra": torch.ones(2)}  # stage 1 only
    if stage == 1:
        with pytest.raises(ValueError, match="built from a tree of"):
            adaptive_clip_grad_norm(wrong, mesh, init_clip_state(), param_norms=index)
    else:
        _, stats = adaptive_clip_grad_norm(wrong, mesh, init_clip_state(), param_norms=index)
        assert math.isnan(float(stats.total_norm)), "the failing stage poisoned the collective instead of hanging"
    _, stats = adaptive_clip_grad_norm(grads, mesh, init_clip_state(), param_norms=index)  # still in step
    assert math.isfinite(float(stats.total_norm))


CASES = [
    every_parameter_norm_on_every_rank_matches_the_reference,
    groups_total_and_in_place_clip_compose_with_parameter_norms,
    a_tree_unlike_the_index_raises_on_every_rank_and_releases_peers,
]


test_on_real_ranks = real_rank_test(CASES, WORLD, share=True)
