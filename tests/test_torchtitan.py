"""The clip on torchtitan 0.3.0's own models and parallelisms, against the float64 gradient of the whole model.

Eight gloo ranks, started once for every case (``demo/harness.py`` through
``tests/_cases.py``). Each layout is built with torchtitan's code, as its
trainer builds it (``tests/_torchtitan.py``: ``ParallelDims.build_mesh``,
llama3 ``debugmodel`` or a small qwen3 MoE from the model registry,
``pipeline_llm`` with 1F1B, ``parallelize_llama`` / ``parallelize_qwen3``,
torchtitan's cross-entropy loss), then runs one forward/backward. The
reference is that step's gradient gathered from every rank in float64
(``tests/_gather.py``), its norm taken the obvious way. For norm types 2, 1
and inf, each layout is checked three ways, one test each:

* ``named_mesh``: ``global_grad_norm`` and ``clip_grad_norm_`` given the
  named mesh over every rank that torchtitan builds, e.g.
  ``("pp", "dp_shard", "tp")`` from ``parallel_dims.get_activated_mesh``;
* ``world_mesh``: the mesh a torchtitan trainer holds,
  ``parallel_dims.world_mesh``, one dim called ``"world"``: with a pipeline
  it says nothing of the stages, so alone it is refused with an error naming
  ``pp_mesh``; with ``pp_mesh=parallel_dims.get_optional_mesh("pp")`` (or
  with ``mesh=None`` and ``pp_mesh``) the norm is right;
* ``drop_in``: ``ppclip_func.torchtitan.clip_grad_norm_`` called exactly as
  torchtitan's trainer calls ``torchtitan.distributed.utils.clip_grad_norm_``,
  and torchtitan's own function called the same way on the same gradients.

Norms are within 1e-6 relative of float64 with exactly one collective (the
first call with a set of options may add the one-time check that every rank
passes the same, ``ppclip_func/_core/agreement.py``; ``named_mesh`` and ``drop_in``
then repeat a call, as the next step would, and count exactly one);
clipped gradients are the float64 reference scaled by the float64 clip
coefficient, within 1e-6.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ppclip_func import clip_grad_norm_, global_grad_norm
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter
from tests._gather import gather_objects, model_gradient
from tests._torchtitan import TORCHTITAN_VERSION, Layout, Trained, needs_torchtitan, train_step
from tests._trainer_checks import BuiltOnce, Checks, SteppedLayout, every_rank_meshes, layout_case, local_copies

pytestmark = needs_torchtitan

WORLD = 8
NORM_TYPES = (2.0, 1.0, math.inf)
# torchtitan's own norm is float32 throughout, and torch's CPU vector_norm of one large shard is off
# by up to 1.1e-5 here (lm_head's 131k elements): its norms are within 3.1e-5 of float64 on these
# layouts. Agreeing with it this closely rules out a layout read wrongly in either (a whole
# transformer block, a stage, an FSDP or TP replica counted twice or not at all), not a single small
# parameter; the 1e-6 comparisons with float64 do that.
TORCHTITAN_RTOL = 1e-4

LAYOUTS = {
    "pp2_fsdp2_tp2": Layout("llama3", pp=2, dp_shard=2, tp=2),
    "pp2_hsdp2x2": Layout("llama3", pp=2, dp_replicate=2, dp_shard=2),
    "pp2_fsdp4_ep2": Layout("qwen3_moe", pp=2, dp_shard=4, ep=2),
    "pp2_fsdp2_tp2_ep4": Layout("qwen3_moe", pp=2, dp_shard=2, tp=2, ep=4),
    "hsdp2x4_ep2": Layout("qwen3_moe", dp_replicate=2, dp_shard=4, ep=2),
    "pp2_fsdp2_tp2_partial_dtensor": Layout("llama3", pp=2, dp_shard=2, tp=2, spmd_backend="partial_dtensor"),
    # torchtitan's default backend; torch >= 2.14 (skipped on 2.13, saying why: Layout.skip_reason).
    "pp2_fsdp2_tp2_spmd_types": Layout("llama3", pp=2, dp_shard=2, tp=2, spmd_backend="spmd_types"),
    "pp2_hsdp2x2_spmd_types": Layout("llama3", pp=2, dp_replicate=2, dp_shard=2, spmd_backend="spmd_types"),
    "pp2_fsdp4_ep2_spmd_types": Layout("qwen3_moe", pp=2, dp_shard=4, ep=2, spmd_backend="spmd_types"),
    "pp2_fsdp2_tp2_ep4_spmd_types": Layout("qwen3_moe", pp=2, dp_shard=2, tp=2, ep=4, spmd_backend="spmd_types"),
    "hsdp2x4_ep2_spmd_types": Layout("qwen3_moe", dp_replicate=2, dp_shard=4, ep=2, spmd_backend="spmd_types"),
}

# The meshes each layout's gradients live on (names of their dims): the layouts are what they claim to be.
GRAD_MESHES = {
    "pp2_fsdp2_tp2": {("dp_shard", "tp")},
    "pp2_hsdp2x2": {("dp_replicate", "dp_shard")},
    "pp2_fsdp4_ep2": {("dp_shard",), ("efsdp", "ep")},
    "pp2_fsdp2_tp2_ep4": {("dp_shard", "tp"), ("efsdp", "ep")},
    "hsdp2x4_ep2": {("dp_replicate", "dp_shard"), ("dp_replicate", "efsdp", "ep")},
    "pp2_fsdp2_tp2_partial_dtensor": {("fsdp", "tp")},
    "pp2_fsdp2_tp2_spmd_types": {("dp_shard", "tp")},
    "pp2_hsdp2x2_spmd_types": {("dp_replicate", "dp_shard")},
    "pp2_fsdp4_ep2_spmd_types": {("dp_shard",), ("efsdp", "ep")},
    "pp2_fsdp2_tp2_ep4_spmd_types": {("dp_shard", "tp"), ("efsdp", "ep")},
    "hsdp2x4_ep2_spmd_types": {("dp_replicate", "dp_shard"), ("dp_replicate", "efsdp", "ep")},
}


def test_torchtitan_is_installed() -> None:
    """torchtitan is a pinned test dependency on Python >= 3.11: without it these tests fail, they do not skip."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"torchtitan is not installed: pip install --no-deps torchtitan=={TORCHTITAN_VERSION}")
    assert version == TORCHTITAN_VERSION, f"torchtitan {version} is installed; these tests pin {TORCHTITAN_VERSION}"


# ---------------------------------------------------------------------------------------------
# One build and one step per layout, shared by its three cases
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Built(SteppedLayout):
    """A layout after one step: what torchtitan's trainer holds at its clip."""

    trained: Trained

    @property
    def parallel_dims(self) -> Any:
        return self.trained.parallel_dims

    def grads(self) -> dict[str, torch.Tensor | None]:
        return self.trained.named_grads()

    def parameters(self) -> list[torch.nn.Parameter]:
        """What torchtitan's trainer passes to the clip: every parameter of every model part."""
        return [p for m in self.trained.model_parts for p in m.parameters()]


def _step(name: str) -> Built:
    """Layout ``name`` built with torchtitan on this rank and stepped once."""
    trained = train_step(LAYOUTS[name])
    grads = trained.named_grads()
    meshes = every_rank_meshes(grads.values())
    assert meshes == GRAD_MESHES[name], meshes
    assert all(gather_objects(all(g is not None for g in grads.values()))), "a parameter has no gradient after the step"
    return Built(model_gradient(grads), local_copies(grads), trained)


_built = BuiltOnce(_step)  # each layout built once, for its three cases


def named_world_mesh(parallel_dims: Any) -> DeviceMesh:
    """torchtitan's named mesh of every rank: its dense mesh (``pp``, data and tensor dims), enabled dims only."""
    dp_shard = "fsdp" if parallel_dims.spmd_backend == "partial_dtensor" else "dp_shard"
    mesh = parallel_dims.get_activated_mesh(["pp", "dp_replicate", dp_shard, "cp", "tp"])
    assert mesh.size() == dist.get_world_size(), mesh
    return mesh


# ---------------------------------------------------------------------------------------------
# The cases: collectives on every rank first, assertions at the end (tests/_trainer_checks.py)
# ---------------------------------------------------------------------------------------------


def named_mesh(built: Built, checks: Checks) -> None:
    """``global_grad_norm`` and ``clip_grad_norm_`` over torchtitan's named mesh of every rank."""
    mesh = named_world_mesh(built.parallel_dims)

    def clip(max_norm: float, p: float) -> torch.Tensor:
        return clip_grad_norm_(built.parameters(), mesh, max_norm, p)

    def calls(p: float, again: str = "") -> None:
        first_sight = not again  # a call repeating one above has no one-time agreement gather
        with CollectiveCounter() as c:
            total = global_grad_norm(built.grads(), mesh, p)
        checks.close(f"global_grad_norm p={p}{again}", total, built.expected(p))
        checks.count(f"global_grad_norm p={p}{again}", c, first_sight=first_sight)
        checks.clip(f"clip_grad_norm_ p={p}{again}", built, clip, p, first_sight=first_sight)

    for p in NORM_TYPES:
        calls(p)
    # The next step: the same calls with the same options, agreed on already, issue exactly one collective each.
    calls(NORM_TYPES[0], again=", again")


def world_mesh(built: Built, checks: Checks) -> None:
    """``parallel_dims.world_mesh``, the 1-D mesh a torchtitan trainer holds: with ``pp_mesh`` when there are stages."""
    world = built.parallel_dims.world_mesh
    pp_mesh = built.parallel_dims.get_optional_mesh("pp")
    assert world.mesh_dim_names == ("world",) and (pp_mesh is not None) == (built.parallel_dims.pp > 1)
    if pp_mesh is not None:
        # Which ranks hold which stage is not in a 1-D mesh: refused on every rank (each joins the
        # one collective first, so that no peer is left waiting: docs/failure-modes.md).
        with CollectiveCounter() as c, pytest.raises(ValueError, match="pp_mesh"):
            global_grad_norm(built.grads(), world, 2.0)
        checks.count("refused", c, expected=None)

    def clip(max_norm: float, p: float) -> torch.Tensor:
        return clip_grad_norm_(built.parameters(), world, max_norm, p, pp_mesh=pp_mesh)

    for p in NORM_TYPES:
        expected = built.expected(p)
        with CollectiveCounter() as c:
            total = global_grad_norm(built.grads(), world, p, pp_mesh=pp_mesh)
        checks.close(f"global_grad_norm(world_mesh, pp_mesh=) p={p}", total, expected)
        checks.count(f"global_grad_norm(world_mesh, pp_mesh=) p={p}", c, first_sight=True)
        checks.clip(f"clip_grad_norm_(world_mesh, pp_mesh=) p={p}", built, clip, p, first_sight=True)
        if pp_mesh is not None:
            with CollectiveCounter() as c:
                total = global_grad_norm(built.grads(), None, p, pp_mesh=pp_mesh)
            checks.close(f"global_grad_norm(None, pp_mesh=) p={p}", total, expected)
            checks.count(f"global_grad_norm(None, pp_mesh=) p={p}", c, first_sight=True)


def _as_the_trainer_calls(clip: Callable[..., torch.Tensor], built: Built, max_norm: float, p: float) -> torch.Tensor:
    """``clip`` called as torchtitan 0.3.0's ``Trainer.train_step`` calls its clip (``torchtitan/trainer.py``)."""
    parallel_dims = built.parallel_dims
    norm_type = {} if p == 2.0 else {"norm_type": p}  # the trainer leaves the default, 2
    return clip(
        [param for m in built.trained.model_parts for param in m.parameters()],
        max_norm,
        **norm_type,
        foreach=True,
        pp_mesh=parallel_dims.get_optional_mesh("pp"),
        ep_enabled=parallel_dims.ep_enabled,
    )


def drop_in(built: Built, checks: Checks) -> None:
    """``ppclip_func.torchtitan.clip_grad_norm_`` where torchtitan's trainer calls its own; torchtitan's alongside."""
    from torchtitan.distributed.utils import clip_grad_norm_ as torchtitan_clip_grad_norm_

    from ppclip_func.torchtitan import clip_grad_norm_ as ppclip_clip_grad_norm_

    def ours(max_norm: float, p: float) -> torch.Tensor:
        return _as_the_trainer_calls(ppclip_clip_grad_norm_, built, max_norm, p)

    for p in NORM_TYPES:
        expected = built.expected(p)
        total = checks.clip(f"ppclip_func.torchtitan p={p}", built, ours, p, first_sight=True)
        with CollectiveCounter() as c:
            theirs = _as_the_trainer_calls(torchtitan_clip_grad_norm_, built, expected / 2, p)
        built.restore()
        checks.count(f"torchtitan p={p}", c, expected=None)
        # torchtitan is right on these layouts, up to its float32 arithmetic: the two agree.
        what = f"torchtitan's own clip_grad_norm_ vs float64 p={p}"
        checks.close(what, theirs, expected, TORCHTITAN_RTOL, "torchtitan")
        checks.close(
            f"ppclip_func.torchtitan vs torchtitan's p={p}", total, float(theirs), TORCHTITAN_RTOL, "torchtitan"
        )
    # The trainer's next step: the same call, its options agreed on already: exactly one collective.
    checks.clip(f"ppclip_func.torchtitan p={NORM_TYPES[0]}, again", built, ours, NORM_TYPES[0])


PARTS: tuple[Callable[[Built, Checks], None], ...] = (named_mesh, world_mesh, drop_in)


CASES = [layout_case(globals(), layout, part, _built) for layout in LAYOUTS for part in PARTS]
SKIP = {
    case.__name__: reason
    for case in CASES
    if (reason := LAYOUTS[case.__name__.split("__")[0]].skip_reason()) is not None
}

# The first case builds torchtitan's meshes and model on 8 ranks of 2 busy cores: gloo waits up to 2 minutes.
# Every case is slow: one layout alone takes 18 s and more, left out of make test-quick.
test_on_real_ranks = pytest.mark.slow(real_rank_test(CASES, WORLD, case_timeout=120.0, skip=SKIP))
