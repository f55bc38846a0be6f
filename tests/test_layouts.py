"""Distributed correctness on every real parallel layout, built with torch's own parallel APIs.

Each case builds the demo's llama-like model (``demo/model.py``), tiny, with
``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``,
``Schedule1F1B`` or ``ScheduleInterleaved1F1B``), FSDP2 ``fully_shard``
(HSDP on a 2-D mesh),
``parallelize_module`` (Colwise/Rowwise/SequenceParallel), DDP and an
expert-parallel MoE, runs one real forward/backward step on gloo ranks, and
checks the clip against the float64 gradient of the whole model gathered
from every rank (:func:`check_clip`: the contract every layout meets).

All cases of one world size run in one start of the ranks (starting
processes is the slow part on 2 cores); each case passes or fails on its
own, naming the ranks that failed. A rank stuck in a collective that a
failed peer skipped is released by gloo's timeout (a minute), and the whole
run has a hard timeout (``demo/harness.py``, ``run_cases``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from demo.model import ModelConfig, Transformer, build_model, random_batch, split_stage
from demo.parallel import Pipeline, apply_ddp, apply_ep, apply_fsdp, apply_tp
from ppclip_func import clip_grad_norm, clip_grad_norm_, global_grad_norm
from tests._cases import case_failures, join_run
from tests._collectives import CollectiveCounter, norm_bits, steady_count
from tests._gather import cast_grads, full_grads, gather_objects, model_gradient
from tests._reference import assert_close_rel, reference_coefficient, reference_norm

NORM_TYPES = (2.0, 1.0, 3.5, math.inf, -math.inf, 0.0)
DTYPES = (torch.float32, torch.bfloat16)
NORM_RTOL = {torch.float32: 1e-6, torch.bfloat16: 1e-5}

# Per-group norms asked for in the same call; feed-forward, router and output head are in no group.
GROUPS: dict[str, str | Callable[[str], bool]] = {
    "embeddings": "tok_embeddings",
    "attention": "attention",
    "experts": "experts",  # matches no leaf in the dense layouts: its norm is NaN there
    "norms": lambda path: "norm.weight" in path,
}


# ---------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------


class _Failures(list):
    """Collects failed checks so that every rank reaches the same collectives before one raises."""

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.append(message)

    def close(self, actual: float, expected: float, rel: float, what: str) -> None:
        try:
            assert_close_rel(actual, expected, rel, what)
        except AssertionError as e:
            self.append(str(e))

    def raise_if_any(self, show: int = 20) -> None:
        if self:
            more = f"\n... and {len(self) - show} more" if len(self) > show else ""
            raise AssertionError(f"{len(self)} failed check(s):\n" + "\n".join(self[:show]) + more)


def _group_of(name: str, groups: Mapping[str, Any]) -> str | None:
    # The patterns here are predicates or one whole part of the dotted parameter name.
    for label, pattern in groups.items():
        if pattern(name) if callable(pattern) else pattern in name.split("."):
            return label
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _is_partial(t: Any) -> bool:
    return isinstance(t, DTensor) and any(p.is_partial() for p in t.placements)


def check_clip(
    grads: Mapping[str, Any],
    mesh: DeviceMesh,
    *,
    params: Mapping[str, torch.nn.Parameter] | None = None,
    same_as: Mapping[str, str] | None = None,
    groups: Mapping[str, Any] = GROUPS,
    collectives: int = 1,
    **options: Any,
) -> None:
    """Checks the clip of this rank's named ``grads`` over ``mesh``; every rank calls it.

    For each norm type in :data:`NORM_TYPES` and for fp32 and bf16 grads:

    * the total norm is within 1e-6 (fp32) / 1e-5 (bf16) relative of the
      float64 norm of the whole model's gradient (:func:`model_gradient`),
      and bitwise identical on every rank;
    * every clipped grad is the reference grad times the reference
      coefficient, with the input's type, dtype, mesh and placements
      (``max_norm`` is half the reference norm, so the clip always scales);
    * the clip issues exactly ``collectives`` collective(s), and
      ``global_grad_norm`` gives the same norm with as many (the first call
      with a set of options may add the one-time agreement gather,
      :class:`_PerStep`; a call repeating options used before may not);
    * with ``groups=``: the total and clipped grads as above, each group's
      norm within tolerance of the reference norm of that group's
      parameters, and still the same count of collectives.

    With ``params`` (fp32, norm 2, last since it clips in place),
    ``clip_grad_norm_`` returns the same norm with the same collectives and
    leaves each ``p.grad`` equal to the pure clip's result.

    Args:
        same_as: Tied names → the name the reference knows them by.
        options: Passed to every clip call (``tied=``, ``partial=``).
    """
    same_as = same_as or {}
    failures = _Failures()
    per_step = _PerStep()
    l2_fp32: tuple[dict, torch.Tensor, float] | None = None
    for dtype in DTYPES:
        g = cast_grads(grads, dtype)
        model = model_gradient(g, same_as)
        members = {label: [t for n, t in model.items() if _group_of(n, groups) == label] for label in groups}
        for norm_type in NORM_TYPES:
            # Collectives first, identically on every rank; checks after, so a failure cannot desynchronize.
            expected = reference_norm(model.values(), norm_type)
            max_norm = expected / 2 if 0 < expected < math.inf else 1.0
            coef = reference_coefficient(expected, max_norm)
            with CollectiveCounter() as plain:
                clipped, total = clip_grad_norm(g, mesh, max_norm, norm_type, **options)
            with CollectiveCounter() as grouped:
                clipped_g, total_g, group_norms = clip_grad_norm(g, mesh, max_norm, norm_type, groups=groups, **options)
            with CollectiveCounter() as measured:
                total_m = global_grad_norm(g, mesh, norm_type, **options)
            bits = gather_objects(
                (norm_bits(total), norm_bits(total_g), {k: norm_bits(v) for k, v in group_norms.items()})
            )
            got = full_grads(clipped)

            where = f"[{dtype}, norm_type={norm_type}]"
            rtol = NORM_RTOL[dtype]
            # A call's first options may add the one-time agreement gather; options already used here may not.
            n_plain = per_step(plain, ("clip", norm_type, max_norm))
            n_grouped = per_step(grouped, ("clip with groups", norm_type, max_norm))
            n_measured = per_step(measured, ("global_grad_norm", norm_type))  # the bf16 pass repeats the fp32 one's
            failures.check(n_plain == collectives, f"{where} {plain.count} collectives: {plain.ops}")
            failures.check(n_grouped == collectives, f"{where} with groups: {grouped.count}: {grouped.ops}")
            failures.check(n_measured == collectives, f"{where} global_grad_norm: {measured.ops}")
            failures.check(norm_bits(total_m) == norm_bits(total), f"{where} global_grad_norm {total_m} != {total}")
            failures.check(len(set(map(repr, bits))) == 1, f"{where} norms differ across ranks: {bits}")
            failures.close(float(total), expected, rtol, f"{where} total norm")
            failures.close(float(total_g), expected, rtol, f"{where} total norm with groups")
            failures.check(list(group_norms) == list(groups), f"{where} group labels {list(group_norms)}")
            for label, tensors in members.items():
                if label in group_norms and not tensors:  # no leaf anywhere: NaN, not a norm of 0
                    failures.check(math.isnan(float(group_norms[label])), f"{where} empty group {label!r} not NaN")
                elif label in group_norms:
                    want = reference_norm(tensors, norm_type)
                    failures.close(float(group_norms[label]), want, rtol, f"{where} norm of group {label!r}")
            for name, src in g.items():
                for label, out in (("", clipped), ("with groups: ", clipped_g)):
                    _check_scaled(failures, f"{where} {label}{name}", out[name], src, coef)
                if src is not None and not _is_partial(src):  # a Partial leaf's full sum can cancel
                    want = model[same_as.get(name, name)] * coef
                    _check_close(failures, f"{where} full {name}", got[name], want, dtype)
            if dtype == torch.float32 and norm_type == 2.0:
                l2_fp32 = (clipped, total, max_norm)

    if params is not None and l2_fp32 is not None:
        clipped, total, max_norm = l2_fp32
        # The torchtitan call site passes model.parameters(); name-based options need the names.
        parameters = params if "tied" in options else iter(params.values())
        with CollectiveCounter() as inplace:
            total_ = clip_grad_norm_(parameters, mesh, max_norm, 2.0, **options)
        # The same options as the float32, norm 2 clip above (agreed on already): exactly `collectives`.
        n_inplace = per_step(inplace, ("clip", 2.0, max_norm))
        failures.check(n_inplace == collectives, f"clip_grad_norm_: {inplace.count} collectives: {inplace.ops}")
        failures.check(norm_bits(total_) == norm_bits(total), f"clip_grad_norm_ norm {total_} != {total}")
        for name, p in params.items():
            if p.grad is not None:
                failures.check(torch.equal(_local(p.grad), _local(clipped[name])), f"clip_grad_norm_: {name}")
    failures.raise_if_any()


class _PerStep:
    """The collectives a call issues in the steady state.

    The first call with a set of static options on a world group also checks, once, that every rank
    passes the same (``ppclip_func/_core/agreement.py``: one extra all-gather, never again for those options).
    A call whose ``options`` (a key naming the function and its static options) this ``check_clip``
    has not used yet may have been the first sight: at most that one gather is not counted
    (``steady_count``). A call repeating options used already counts every collective it issued.
    """

    def __init__(self) -> None:
        self.seen: set[tuple] = set()

    def __call__(self, counter: CollectiveCounter, options: tuple) -> int:
        first_sight = options not in self.seen
        self.seen.add(options)
        return steady_count(counter) if first_sight else counter.count


def _check_scaled(failures: _Failures, where: str, out: Any, src: Any, coef: float) -> None:
    """``out`` is ``src`` with each local shard times ``coef`` (rounded once), in the same layout."""
    if src is None:
        failures.check(out is None, f"{where}: None became {out}")
        return
    failures.check(type(out) is type(src) and out.dtype == src.dtype, f"{where}: {type(out)} {out.dtype}")
    if isinstance(src, DTensor):
        layout = (src.device_mesh, src.placements, src.shape, src.stride())
        same = (out.device_mesh, out.placements, out.shape, out.stride()) == layout
        failures.check(same, f"{where}: placements {out.placements} != {src.placements}")
    _check_close(failures, where, _local(out), (_local(src).double() * coef).to(src.dtype), src.dtype)


def _check_close(failures: _Failures, where: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to one rounding to ``dtype`` and the clip coefficient's error (as the norm's)."""
    rtol = torch.finfo(dtype).eps + 2 * NORM_RTOL[dtype]
    try:
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=0.0)
    except AssertionError as e:
        worst = [line.strip() for line in str(e).splitlines() if "relative difference" in line]
        failures.append(f"{where} is not the reference scaled: {worst[0] if worst else e}")


def _placement_kinds(grads: Mapping[str, Any]) -> set[str]:
    """Every rank's placement types, e.g. {"Shard", "_StridedShard", "Replicate", "Tensor"} (a collective)."""
    kinds = set()
    for g in grads.values():
        if isinstance(g, DTensor):
            kinds |= {type(p).__name__ for p in g.placements}
        elif g is not None:
            kinds.add("Tensor")
    return set().union(*gather_objects(kinds))


# ---------------------------------------------------------------------------------------------
# The layouts: one function per layout, run on every rank
# ---------------------------------------------------------------------------------------------

CASES: list[Callable[[int, int], None]] = []


def layout(world_size: int, *, slow: bool = False) -> Callable:
    """Registers a case to run on ``world_size`` ranks."""

    def register(fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
        fn.world_size = world_size  # type: ignore[attr-defined]
        fn.slow = slow  # type: ignore[attr-defined]
        CASES.append(fn)
        return fn

    return register


# The demo's model at test size.
ARGS = ModelConfig(vocab=32, dim=16, n_heads=2, n_layers=2, hidden=32, seq_len=8)


def build_stage(cfg: ModelConfig, stage: int, n_stages: int, *, layers: list[int] | None = None) -> Transformer:
    """The whole model built from seed 0 on every rank, cut down to pipeline stage ``stage``."""
    return split_stage(build_model(cfg), stage, n_stages, layers=layers)


def named_grads(*modules: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``{parameter name: .grad}`` of every parameter of ``modules``, as a trainer would pass them."""
    return {name: p.grad for m in modules for name, p in m.named_parameters()}


def named_parameters(*modules: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for m in modules for name, p in m.named_parameters()}


@layout(world_size=8)
def pp_fsdp2_tp(rank: int, world_size: int) -> None:
    """torchtitan's layout: PP=2 (GPipe) × FSDP2=2 × TP=2 with sequence parallelism."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
    pp, dp, _ = mesh.get_coordinate()
    model = build_stage(ARGS, pp, 2)
    apply_tp(model, mesh["tp"])
    apply_fsdp(model, mesh["dp_shard"])
    Pipeline([model], [pp], 2, mesh["pp"]).step(*random_batch(ARGS, dp))
    grads = named_grads(model)
    assert _placement_kinds(grads) == {"_StridedShard", "Shard", "Replicate"}
    check_clip(grads, mesh, params=named_parameters(model))


@layout(world_size=8)
def pp_hsdp(rank: int, world_size: int) -> None:
    """PP=2 (1F1B) × HSDP (replicate=2 × shard=2): grads Replicate over dp_replicate, Shard(0) over dp_shard.

    (With TP as well this needs 16 ranks: :func:`pp_hsdp_tp`.)
    """
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    pp, rep, shard = mesh.get_coordinate()
    model = build_stage(ARGS, pp, 2)
    apply_fsdp(model, mesh["dp_replicate", "dp_shard"])
    Pipeline([model], [pp], 2, mesh["pp"], schedule_cls=Schedule1F1B).step(*random_batch(ARGS, 2 * rep + shard))
    grads = named_grads(model)
    assert {g.placements for g in grads.values()} == {(Replicate(), Shard(0))}
    check_clip(grads, mesh, params=named_parameters(model))


@layout(world_size=16, slow=True)
def pp_hsdp_tp(rank: int, world_size: int) -> None:
    """PP=2 × HSDP (replicate=2 × shard=2) × TP=2: all four kinds of dim at once (16 ranks)."""
    mesh = init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    pp, rep, shard, _ = mesh.get_coordinate()
    model = build_stage(ARGS, pp, 2)
    apply_tp(model, mesh["tp"])
    apply_fsdp(model, mesh["dp_replicate", "dp_shard"])
    Pipeline([model], [pp], 2, mesh["pp"]).step(*random_batch(ARGS, 2 * rep + shard))
    grads = named_grads(model)
    assert _placement_kinds(grads) == {"_StridedShard", "Shard", "Replicate"}
    check_clip(grads, mesh, params=named_parameters(model))


@layout(world_size=8)
def pp_fsdp2_ep(rank: int, world_size: int) -> None:
    """Expert parallelism the torchtitan way, dense and expert layers in one call.

    World mesh ("pp", "dp_shard") = (2, 4). The dense layers are sharded over
    all 4 ``dp_shard`` ranks; the MoE experts of stage 1 are sharded on the
    expert dim over ``ep`` and by FSDP over ``dp_shard_mod_ep``, the same
    ranks factored 2 × 2 (``mesh._unflatten``). Stage 0 owns no expert.
    """
    args = dataclasses.replace(ARGS, moe_layers=(1,))
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp_shard"))
    experts_mesh = mesh._unflatten(mesh.mesh_dim_names.index("dp_shard"), (2, 2), ("dp_shard_mod_ep", "ep"))
    pp, dp = mesh.get_coordinate()
    model = build_stage(args, pp, 2)
    apply_ep(model, experts_mesh["ep"])
    apply_fsdp(model, mesh["dp_shard"], expert_dp_mesh=experts_mesh["dp_shard_mod_ep"])
    Pipeline([model], [pp], 2, mesh["pp"]).step(*random_batch(args, dp))
    grads = named_grads(model)
    experts = {n: g for n, g in grads.items() if ".experts." in n}
    if pp == 0:
        assert not experts
    else:
        assert len(experts) == 2
        for g in experts.values():
            assert g.device_mesh.mesh_dim_names == ("dp_shard_mod_ep", "ep"), g.device_mesh
            assert isinstance(g.placements[0], _StridedShard) and g.placements[1] == Shard(0), g.placements
    check_clip(grads, mesh, params=named_parameters(model))


@layout(world_size=8)
def pp_hsdp_ep(rank: int, world_size: int) -> None:
    """Expert parallelism with HSDP: experts replicated over ``dp_replicate``, unlike those of :func:`pp_fsdp2_ep`.

    World mesh ("pp", "dp_replicate", "dp_shard") = (2, 2, 2). Dense layers
    are HSDP over (dp_replicate, dp_shard); the experts are sharded on the
    expert dim over ``ep`` = dp_shard and HSDP over (dp_replicate,
    dp_shard_mod_ep = 1), as torchtitan lays them out: their grads are
    Replicate over dp_replicate, so they count once out of two copies.
    """
    args = dataclasses.replace(ARGS, moe_layers=(1,))
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    experts_mesh = mesh._unflatten(mesh.mesh_dim_names.index("dp_shard"), (1, 2), ("dp_shard_mod_ep", "ep"))
    pp, rep, shard = mesh.get_coordinate()
    model = build_stage(args, pp, 2)
    apply_ep(model, experts_mesh["ep"])
    apply_fsdp(model, mesh["dp_replicate", "dp_shard"], expert_dp_mesh=experts_mesh["dp_replicate", "dp_shard_mod_ep"])
    Pipeline([model], [pp], 2, mesh["pp"]).step(*random_batch(args, 2 * rep + shard))
    grads = named_grads(model)
    experts = {n: g for n, g in grads.items() if ".experts." in n}
    assert len(experts) == (2 if pp == 1 else 0)
    for g in experts.values():
        assert g.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard_mod_ep", "ep"), g.device_mesh
        assert g.placements[0] == Replicate() and g.placements[2] == Shard(0), g.placements
    check_clip(grads, mesh, params=named_parameters(model))


@layout(world_size=4)
def pp_ddp(rank: int, world_size: int) -> None:
    """PP=2 (1F1B) × DDP=2: plain, replicated torch.Tensor grads (not DTensors).

    The pipeline dim is called "stage" here, so the clip is told with ``pp_dim``.
    """
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("stage", "dp"))
    pp, dp = mesh.get_coordinate()
    model = build_stage(ARGS, pp, 2)
    ddp = apply_ddp(model, mesh["dp"])
    Pipeline([ddp], [pp], 2, mesh["stage"], schedule_cls=Schedule1F1B).step(*random_batch(ARGS, dp))
    grads = named_grads(model)
    assert _placement_kinds(grads) == {"Tensor"}
    check_clip(grads, mesh, params=named_parameters(model), pp_dim="stage")


@layout(world_size=4)
def interleaved_pp_fsdp2(rank: int, world_size: int) -> None:
    """Interleaved 1F1B: 4 stages on PP=2 (stages r and r + 2 on pipeline rank r) × FSDP2=2."""
    args = dataclasses.replace(ARGS, n_layers=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    pp, dp = mesh.get_coordinate()
    stage_ids = [pp, pp + 2]
    models = [build_stage(args, s, 4) for s in stage_ids]
    for m in models:
        apply_fsdp(m, mesh["dp_shard"])
    Pipeline(models, stage_ids, 4, mesh["pp"]).step(*random_batch(args, dp))
    grads = named_grads(*models)
    assert {n.split(".")[1] for n in grads if n.startswith("layers.")} == {str(s) for s in stage_ids}
    check_clip(grads, mesh, params=named_parameters(*models))


TIED_GROUPS = {"embedding_and_head": lambda path: "tok_embeddings" in path or "output" in path, **GROUPS}


@layout(world_size=4)
def tied_embedding(rank: int, world_size: int) -> None:
    """PP=2 × FSDP2=2 with the input embedding (stage 0) tied to the output head (stage 1).

    As a trainer does, the two stages sum their gradients of the tied weight,
    so both hold the same gradient; ``tied=`` counts it once and both copies
    are clipped.
    """
    args = dataclasses.replace(ARGS, tie_embeddings=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    pp, dp = mesh.get_coordinate()
    model = build_stage(args, pp, 2)
    apply_fsdp(model, mesh["dp_shard"])
    Pipeline([model], [pp], 2, mesh["pp"]).step(*random_batch(args, dp))
    tied_name = "tok_embeddings.weight" if pp == 0 else "output.weight"
    with torch.no_grad():  # same Shard(0) layout on both stages: the local shards line up
        dist.all_reduce(model.get_parameter(tied_name).grad.to_local(), group=mesh["pp"].get_group())
    grads = named_grads(model)

    # Without tied= the shared gradient counts twice: the option is what makes the norm right.
    expected = reference_norm(model_gradient(grads, {"output.weight": "tok_embeddings.weight"}).values(), 2.0)
    untied = float(clip_grad_norm(grads, mesh, 1.0)[1])
    assert untied > expected * (1 + 1e-3), (untied, expected)

    check_clip(
        grads,
        mesh,
        params=named_parameters(model),
        same_as={"output.weight": "tok_embeddings.weight"},
        groups=TIED_GROUPS,
        tied={tied_name: 2},  # each stage declares the tied parameter it holds
    )


@layout(world_size=4)
def stages_without_grads(rank: int, world_size: int) -> None:
    """PP=4: stage 1 is frozen (every grad None), stage 2 has no parameters (an empty dict).

    Their ranks still join the one collective and get the global norm.
    """
    args = dataclasses.replace(ARGS, n_layers=3)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    pp = mesh.get_local_rank()
    model = build_stage(args, pp, 4, layers={0: [0], 1: [1], 2: [], 3: [2]}[pp])
    if pp == 1:
        model.requires_grad_(False)
    Pipeline([model], [pp], 4, mesh).step(*random_batch(args, 0))
    grads = named_grads(model)
    if pp == 1:
        assert grads and all(g is None for g in grads.values())
    if pp == 2:
        assert grads == {}
    check_clip(grads, mesh, params=named_parameters(model))


@layout(world_size=4)
def partial_grads(rank: int, world_size: int) -> None:
    """PP=2 × TP=2 without FSDP: the SequenceParallel norms' grads come back ``Partial("sum")``.

    By default the clip refuses them with an error naming the leaf; with
    ``partial="reduce"`` it all-reduces each such leaf first (one more
    collective per leaf) and is correct, for ``Partial("avg")`` too;
    ``Partial("max")`` cannot be handled and is an error.
    """
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, _ = mesh.get_coordinate()
    model = build_stage(ARGS, pp, 2)
    apply_tp(model, mesh["tp"])
    Pipeline([model], [pp], 2, mesh["pp"]).step(*random_batch(ARGS, 0))
    grads = named_grads(model)
    partial = [n for n, g in grads.items() if _is_partial(g)]
    assert partial and all(g.placements == (Partial("sum"),) for n, g in grads.items() if n in partial)

    with pytest.raises(ValueError, match=re.escape(partial[0])):
        clip_grad_norm(grads, mesh, 1.0)
    check_clip(grads, mesh, params=named_parameters(model), partial="reduce", collectives=1 + len(partial))

    def with_reduce_op(op: str, factor: float) -> dict[str, Any]:
        g = grads[partial[0]]  # factor: the local values of Partial(op) that have the same full tensor
        local = g.to_local() * factor
        return {**grads, partial[0]: DTensor.from_local(local, g.device_mesh, [Partial(op)], run_check=False)}

    check_clip(with_reduce_op("avg", 2.0), mesh, partial="reduce", collectives=1 + len(partial))
    with pytest.raises(ValueError, match=re.escape(partial[0])):
        clip_grad_norm(with_reduce_op("max", 1.0), mesh, 1.0, partial="reduce")


# ---------------------------------------------------------------------------------------------
# pytest: one run per world size, one test per layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            join_run(c, c.world_size, 60.0, share=True),
            id=f"{c.__name__}-{c.world_size}ranks",
            marks=[pytest.mark.slow] if c.slow else [],
        )
        for c in CASES
    ],
)
def test_layout(case: Callable, request: pytest.FixtureRequest) -> None:
    failures = case_failures(request, case)
    assert not failures, f"{case.__name__} failed:\n{failures}"
