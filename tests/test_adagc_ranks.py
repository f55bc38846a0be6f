"""AdaGC on real ranks: every parameter of every pipeline stage clipped against its own history, one collective.

Four gloo ranks, one start for every case (``demo/harness.py``,
``run_cases``). The model's parameters are split over pipeline stages,
FSDP-sharded as DTensors (``Shard(0)``, ``Shard(1)``) or replicated, with an
embedding tied across the first and last stage, an empty parameter and one
whose gradient is ``None``. The reference is ``tests/test_adagc.py``'s float64
loop run on the whole model's gradient, gathered (``tests/_gather.py``).

* (pp=2, dp=2), with ``mesh`` and with ``pp_mesh`` (``mesh=None``): each
  step's state and coefficients follow the loop within 1e-6, every rank
  holds the same bits, each rank's shards are scaled by their parameter's
  coefficient, and each step issues exactly one collective.
* The state saved by ``dcp.save`` on (pp=2, dp=2) and loaded into a run split
  into 4 stages with no sharding (the index lists the names in another order):
  the resumed run follows the run that never stopped.
"""

from __future__ import annotations

import math

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ppclip_func import AdaGCStateful, adagc_clip_grad_norm_, init_adagc_state, param_norm_index
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, steady_count
from tests._gather import gather_objects, model_gradient, shared_dir
from tests.test_adagc import reference_run

WORLD = 4
TIED = {"embed.weight": 2}
SHAPES = {
    "embed.weight": (6, 4),
    "layers.0.w": (8, 4),
    "layers.0.b": (4,),
    "layers.0.unused": (3,),
    "layers.1.w": (4, 10),
    "layers.1.empty": (0,),
    "norm.weight": (4,),
}
# Which stage holds which parameter, for 2 and for 4 stages; the embedding is tied to the last stage.
STAGES = {
    2: [["embed.weight", "layers.0.w", "layers.0.b", "layers.0.unused"], ["layers.1.w", "layers.1.empty", "norm.weight", "embed.weight"]],
    4: [["layers.0.w", "embed.weight"], ["layers.0.b", "layers.0.unused"], ["layers.1.w", "layers.1.empty"], ["norm.weight", "embed.weight"]],
}  # fmt: skip
SHARD_DIM = {"layers.0.w": 0, "layers.1.w": 1}
SPIKES = {(9, "layers.1.w"): 30.0, (12, "norm.weight"): 5.0, (13, "layers.0.w"): 0.1}
OPTS = dict(warmup=4, beta=0.9, max_norm=1.0)
STEPS, STOP = 16, 7


def _full(step: int, name: str) -> torch.Tensor | None:
    """The whole gradient of ``name`` at ``step``: the same on every rank and in every layout."""
    if name == "layers.0.unused":
        return None
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    scale = 0.1 * (1 + 0.3 * math.sin(step + len(name))) * SPIKES.get((step, name), 1.0)
    return (torch.rand(SHAPES[name], generator=g) - 0.4) * scale


def _params(pp: int, mesh) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters (zeros; their grads are set per step), sharded over dp where the layout says."""
    stage = mesh.get_coordinate()[0]
    dp = mesh["dp"]
    params = {}
    for name in STAGES[pp][stage]:
        full = torch.zeros(SHAPES[name])
        if name in SHARD_DIM and dp.size() > 1:  # FSDP's parameters are DTensors, as their grads
            dim = SHARD_DIM[name]
            local = full.chunk(dp.size(), dim=dim)[dp.get_local_rank()].contiguous()
            full = DTensor.from_local(local, dp, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())
        params[name] = torch.nn.Parameter(full)
    return params


def _set_grads(params, step: int, mesh) -> dict[str, torch.Tensor | None]:
    """Sets this rank's grads for ``step``; returns them (DTensors for the sharded ones, as FSDP holds them)."""
    dp = mesh["dp"]
    out = {}
    for name, p in params.items():
        full = _full(step, name)
        if full is not None and name in SHARD_DIM and dp.size() > 1:
            dim = SHARD_DIM[name]
            local = full.chunk(dp.size(), dim=dim)[dp.get_local_rank()].contiguous()
            full = DTensor.from_local(local, dp, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())
        p.grad = None if full is None else full.clone()
        out[name] = full
    return out


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _run(pp: int, first: int, last: int, state=None, use_pp_mesh: bool = False):
    """Runs steps ``first`` to ``last - 1`` on a (pp, WORLD // pp) mesh; checks each against the loop."""
    mesh = init_device_mesh("cpu", (pp, WORLD // pp), mesh_dim_names=("pp", "dp"))
    params = _params(pp, mesh)
    # The index and every clip see a tree of parameters that are DTensors where their grads are.
    index = param_norm_index(params, mesh)
    state = init_adagc_state(index) if state is None else state
    where = dict(mesh=None, pp_mesh=mesh["pp"]) if use_pp_mesh else dict(mesh=mesh)
    records = []
    for step in range(first, last):
        grads = _set_grads(params, step, mesh)
        with CollectiveCounter() as counter:
            stats = adagc_clip_grad_norm_(
                params,
                where["mesh"],
                state,
                index,
                tied=TIED if "embed.weight" in params else None,
                pp_mesh=where.get("pp_mesh"),
                **OPTS,
            )
            state = stats.state
            gamma = {k: float(v) for k, v in index.named(state.gamma).items()}
            coef = {k: float(v) for k, v in index.named(stats.coefficients).items()}
        assert steady_count(counter) == 1, counter.ops
        for name, g in grads.items():
            if g is not None:
                want = _local(g).double() * coef[name]
                torch.testing.assert_close(_local(params[name].grad).double(), want, rtol=1e-6, atol=1e-12)
        bits = tuple(state.gamma.tolist()) + tuple(stats.coefficients.tolist())
        assert len(set(map(repr, gather_objects(bits)))) == 1, "every rank holds the same state and coefficients"
        records.append((gamma, coef, bool(stats.skip)))
    return records, state, index, mesh


def _model_steps(first: int, last: int) -> list[dict[str, torch.Tensor | None]]:
    return [{name: _full(step, name) for name in SHAPES} for step in range(first, last)]


def _assert_follows(records, want, what: str) -> None:
    """Each step's gamma and coefficient by name against the loop's (``want``: gamma, coefficients, skip)."""
    clipped = 0
    for i, ((gamma, coef, skip), (want_gamma, want_coef, want_skip)) in enumerate(zip(records, want, strict=True)):
        assert skip == want_skip, (what, i)
        for name in SHAPES:
            if name not in want_gamma:
                assert gamma[name] == math.inf, (what, i, name)
            else:
                assert math.isclose(gamma[name], want_gamma[name], rel_tol=1e-6), (what, i, name, gamma, want_gamma)
        for name, c in want_coef.items():
            assert math.isclose(coef[name], c, rel_tol=1e-6), (what, i, name, coef[name], c)
            clipped += c < 1
    assert clipped >= 3, f"{what}: parameters were clipped, so the comparison could fail"


def _reference(first: int, last: int):
    """The loop over the whole model's gradient from step 0; steps ``first`` to ``last - 1`` of it."""
    steps = _model_steps(0, last)
    out = []
    for grads, (clipped, gamma, skip) in zip(steps, reference_run(steps, **OPTS)):
        coef = {
            k: float(clipped[k].norm() / g.double().norm()) for k, g in grads.items() if g is not None and g.norm() > 0
        }
        out.append((gamma, coef, skip))
    return out[first:last]


def every_stage_follows_the_reference_with_one_collective_per_step(rank: int, world_size: int) -> None:
    want = _reference(0, STEPS)
    for use_pp_mesh in (False, True):
        records, _, index, mesh = _run(2, 0, STEPS, use_pp_mesh=use_pp_mesh)
        assert index.names == ("embed.weight", "layers.0.w", "layers.0.b", "layers.0.unused", "layers.1.w", "layers.1.empty", "norm.weight")  # fmt: skip
        _assert_follows(records, want, f"pp_mesh={use_pp_mesh}")
    # The loop's whole-model gradient is the one the ranks hold, gathered the obvious way.
    grads = _set_grads(_params(2, mesh), STEPS - 1, mesh)
    model = model_gradient(grads)
    for name, full in model.items():
        assert torch.equal(full, _full(STEPS - 1, name).double()), name


def saved_on_two_stages_resumed_on_four(rank: int, world_size: int) -> None:
    with shared_dir("ppclip-adagc-") as folder:
        _, state, index, _ = _run(2, 0, STOP)
        clip = AdaGCStateful(index)
        clip.state = state
        dcp.save({"clip": clip}, checkpoint_id=folder)
        mesh4 = init_device_mesh("cpu", (4, 1), mesh_dim_names=("pp", "dp"))
        index4 = param_norm_index(_params(4, mesh4), mesh4)
        assert index4.names != index.names and set(index4.names) == set(index.names)
        resumed = AdaGCStateful(index4)
        dcp.load({"clip": resumed}, checkpoint_id=folder)
        assert int(resumed.state.count) == STOP
        for name in index.names:
            a, b = index.named(state.gamma)[name], index4.named(resumed.state.gamma)[name]
            assert torch.equal(a, b), name
        records, _, _, _ = _run(4, STOP, STEPS, state=resumed.state)
        _assert_follows(records, _reference(STOP, STEPS), "resumed on 4 stages")
        fresh, _, _, _ = _run(4, STOP, STEPS)
        assert fresh[-1][0] != records[-1][0], "a fresh state differs: the resume is seen"


CASES = [every_stage_follows_the_reference_with_one_collective_per_step, saved_on_two_stages_resumed_on_four]
test_on_real_ranks = real_rank_test(CASES, WORLD, case_timeout=60.0, share=True)
