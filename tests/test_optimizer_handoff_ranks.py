"""The clip handed to torchtitan's OptimizersContainer on 4 gloo ranks, pipeline stages × FSDP shards.

Mesh ``("pp", "dp")`` = (2, 2): each stage holds its own two-layer model,
its parameters ``Shard(0)`` DTensors over ``dp`` (FSDP's layout), and
torchtitan's own ``OptimizersContainer`` with a fused AdamW for the first
layer and a non-fused Adam for the second (the fallback). Each rank runs the
model twice from the same start: clip-then-step (``clip_grad_norm_``, then
``step()``) and the clip handed to the container. They agree within a
rounding at every step; then a gradient made infinite on one rank of one
stage makes every rank skip its step, bit for bit, with one collective.
The same trainer step compiled (``aot_eager``: the norm traced with its one
collective, the hand-over at its graph break, the fused step as torch runs it)
equals the eager one on every rank (within the roundings of the compiled
fallback step), the skipped step included, bit for bit.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ppclip_func import clip_grad_norm_, clip_grad_norm_in_optimizer
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, norm_bits
from tests._gather import gather_objects
from tests._torchtitan import needs_torchtitan
from tests.test_compile_fake_pg import CaptureBackend, collectives

pytestmark = needs_torchtitan  # every case runs torchtitan's OptimizersContainer


def _stage_model(stage: int, dp_mesh) -> torch.nn.Module:
    torch.manual_seed(10 + stage)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    for layer in model:
        for name, p in list(layer.named_parameters()):
            setattr(layer, name, torch.nn.Parameter(distribute_tensor(p.detach(), dp_mesh, [Shard(0)])))
    return model


def _container(model: torch.nn.Module):
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    groups = [
        ParamGroupConfig(pattern=r"^0\.", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2}),
        ParamGroupConfig(pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-2, "fused": False}),
    ]
    config = OptimizersContainer.Config(param_groups=groups, implementation="fused")
    return OptimizersContainer(config, model_parts=[model])


def _set_grads(model: torch.nn.Module, stage: int, step: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(1000 * step + stage)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=gen) * scale
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)


def _locals(model: torch.nn.Module, container) -> list[torch.Tensor]:
    out = [p.to_local().detach() for p in model.parameters()]
    for opt in container.optimizers:
        for p in model.parameters():
            for v in opt.state.get(p, {}).values():
                out.append(v.to_local() if isinstance(v, DTensor) else v)
    return out


def handed_over_equals_clip_then_step_across_stages(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    ref_model, model = _stage_model(stage, mesh["dp"]), _stage_model(stage, mesh["dp"])
    ref_opt, opt = _container(ref_model), _container(model)
    assert [o.param_groups[0]["fused"] for o in opt.optimizers] == [True, False]
    for step, scale in enumerate((3.0, 0.01, 2.0)):
        _set_grads(ref_model, stage, step, scale)
        _set_grads(model, stage, step, scale)
        want = clip_grad_norm_(ref_model.parameters(), mesh, 1.0)
        ref_opt.step()
        with CollectiveCounter() as counter:
            got = clip_grad_norm_in_optimizer(opt, model.parameters(), mesh, 1.0)
        assert counter.count == 1, counter.ops
        opt.step()
        assert norm_bits(got) == norm_bits(want)
        for a, b in zip(_locals(model, opt), _locals(ref_model, ref_opt)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    # One rank of stage 1 holds an infinite gradient: every rank, both stages, skips.
    _set_grads(model, stage, 9, 1.0)
    if rank == world_size - 1:
        next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
    before = [t.clone() for t in _locals(model, opt)]
    norm = clip_grad_norm_in_optimizer(opt, model.parameters(), mesh, 1.0, nonfinite="skip")
    opt.step()
    assert not torch.isfinite(norm)
    assert len(set(gather_objects(norm_bits(norm)))) == 1
    assert all(torch.equal(a, b) for a, b in zip(_locals(model, opt), before))


def compiled_hand_over_equals_eager_across_stages(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    eager_model, model = _stage_model(stage, mesh["dp"]), _stage_model(stage, mesh["dp"])
    eager_opt, opt = _container(eager_model), _container(model)

    def train_step(m: torch.nn.Module, o) -> torch.Tensor:
        norm = clip_grad_norm_in_optimizer(o, m.parameters(), mesh, 1.0, nonfinite="skip")
        o.step()
        return norm

    backend = CaptureBackend()  # runs as aot_eager
    compiled = torch.compile(train_step, backend=backend)
    before: list[torch.Tensor] = []
    for step, scale in enumerate((3.0, 0.01, 2.0, 1.0)):
        for m in (eager_model, model):
            _set_grads(m, stage, step, scale)
            if step == 3 and rank == 1:  # one rank of stage 0: every rank skips
                next(m.parameters()).grad.to_local().view(-1)[0] = float("nan")
        # No CollectiveCounter here: dynamo does not compile under an active dispatch mode (it would run
        # eagerly); the collective is counted in the traced graphs below.
        want, got = train_step(eager_model, eager_opt), compiled(model, opt)
        assert norm_bits(got) == norm_bits(want)
        # The fused AdamW is not traced (torch disables it): the same kernel as eager. The fallback Adam's
        # foreach step is compiled by dynamo, which rounds apart from eager by ~1e-7.
        for a, b in zip(_locals(model, opt), _locals(eager_model, eager_opt)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if step == 3:
            assert not torch.isfinite(got)
            assert all(torch.equal(a, b) for a, b in zip(_locals(model, opt), before))
        before = [t.clone() for t in _locals(model, opt)]
    colls = [op for gm in backend.aten for op in collectives(gm)[0]]
    assert colls == ["_c10d_functional::all_reduce"], f"the norm and its one collective are traced: {colls}"
    torch._dynamo.reset()


test_on_real_ranks = real_rank_test(
    [handed_over_equals_clip_then_step_across_stages, compiled_hand_over_equals_eager_across_stages],
    4,
    case_timeout=120,
    slow=("compiled_hand_over_equals_eager_across_stages",),  # about 11 s
    share=True,
)
