"""Ranks that disagree get one clear error on every rank: never a wrong norm, a crash or a hang.

Four gloo ranks, mesh ``(pp=2, dp=2)``, each pipeline stage holding its own
parameters, every case run eagerly and under ``torch.compile(fullgraph=True)``
(``aot_eager``) in one start (``tests/_cases.py``: a hard timeout per case,
so a hang fails its case instead of stalling the suite). Each disagreement
must raise on every rank, name the option (or state) and the ranks that
differ, leave every gradient untouched, and leave the ranks in step: each
case ends with an agreeing clip on every rank.

The static check runs the first time a rank sees a configuration; each case
starts with no configuration seen (``_fresh``), as a new training run does.
"""

from __future__ import annotations

import math
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from ppclip_func import (
    ClipState,
    UnsupportedTorchError,
    adagc_clip_grad_norm_,
    adaptive_clip_grad_norm,
    adaptive_clip_grad_norm_,
    clip_grad_norm,
    clip_grad_norm_,
    clip_grad_norm_by_group_,
    global_grad_norm,
    init_adagc_state,
    init_clip_state,
    param_norm_index,
)
from ppclip_func._core import agreement as _agree
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter
from tests._gather import gather_objects
from tests.test_compile_fake_pg import CaptureBackend, assert_one_graph_one_collective, aten_ops

WORLD = 4


def _fresh():
    """The mesh, this rank's stage and its named parameters with grads; no configuration seen yet."""
    _agree.forget_configurations()
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    torch.manual_seed(stage)
    params = {
        f"s{stage}.weight": torch.nn.Parameter(torch.randn(2, 3)),
        f"s{stage}.bias": torch.nn.Parameter(torch.randn(2)),
    }
    for p in params.values():
        p.grad = torch.randn_like(p)
    return mesh, stage, params


def _cause(e: BaseException) -> BaseException:
    """Under ``torch.compile(fullgraph=True)`` dynamo wraps an error raised while tracing; the cause is ours."""
    while not isinstance(e, (ValueError, _agree.StateDisagreement)) and (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return e


def _raises_everywhere(call, params: dict, error: type, *texts: str) -> None:
    """``call()`` raises ``error`` naming each of ``texts`` here, eagerly and compiled; grads untouched."""
    for compiled in (False, True):
        torch._dynamo.reset()
        before = {n: p.grad.clone() for n, p in params.items()}
        fn = torch.compile(call, backend="aot_eager", fullgraph=True) if compiled else call
        with pytest.raises(Exception) as caught:
            fn()
        e = _cause(caught.value)
        where = "compiled" if compiled else "eager"
        assert isinstance(e, error), f"{where}: {type(e).__name__}: {e}"
        for text in texts:
            assert text in str(e), f"{where}: {text!r} not in {e}"
        for n, p in params.items():
            assert torch.equal(p.grad, before[n]), f"{where}: {n} was changed"


def _in_step(mesh) -> None:
    """An agreeing clip on every rank: the ranks are still in step (a rank left behind would hang here)."""
    g = {"w": torch.ones(4)}
    total = global_grad_norm(g, mesh)
    assert float(total) == pytest.approx(math.sqrt(8.0)), float(total)  # 4 ones per stage, 2 stages


# --- static options -----------------------------------------------------------------------------------


def groups_built_from_each_stages_own_names(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    own = {n: n for n in params}  # the natural mistake in a pipeline trainer
    _raises_everywhere(
        lambda: clip_grad_norm_(params, mesh, 0.1, groups=own),
        params,
        ValueError,
        "groups (ranks [2, 3] differ from rank 0)",
        "whole model",
    )
    _in_step(mesh)


def the_readme_fix_gives_each_stage_its_true_norm(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    whole = [f"s{s}.{k}" for s in range(2) for k in ("weight", "bias")]
    _, per = global_grad_norm({n: p.grad for n, p in params.items()}, mesh, groups={n: n for n in whole})
    true = {n: float(p.grad.norm()) for n, p in params.items()}
    true = {n: v for t in gather_objects(true) for n, v in t.items()}
    for n in whole:
        assert float(per[n]) == pytest.approx(true[n], rel=1e-6), n


def norm_type_on_one_rank(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    p = math.inf if rank == 3 else 2.0
    _raises_everywhere(
        lambda: clip_grad_norm_(params, mesh, 0.1, norm_type=p),
        params,
        ValueError,
        "norm_type (rank 3 differs from rank 0)",
    )
    _in_step(mesh)


def a_different_number_of_group_labels(rank: int, world_size: int) -> None:
    # Reduced as is, the all-reduce lengths would differ: gloo aborts the process, NCCL hangs.
    mesh, _stage, params = _fresh()
    groups = {"a": "weight"} if rank == 0 else {"a": "weight", "b": "bias"}
    _raises_everywhere(
        lambda: clip_grad_norm_(params, mesh, 0.1, groups=groups),
        params,
        ValueError,
        "the number of group labels (ranks [1, 2, 3] differ from rank 0)",
    )
    _in_step(mesh)


def every_other_option_that_shapes_or_reads_the_vector(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    index = param_norm_index(params, mesh)
    odd = rank == 2
    cases = {
        "overflow_safe": dict(overflow_safe=odd),
        "partial": dict(partial="reduce" if odd else "error"),
        "eps": dict(eps=1e-3 if odd else 1e-6),
        "nonfinite": dict(nonfinite="zero" if odd else "propagate"),
    }
    for option, kw in cases.items():
        _raises_everywhere(
            lambda kw=kw: clip_grad_norm_(params, mesh, 0.1, **kw),
            params,
            ValueError,
            f"{option} (rank 2 differs from rank 0)",
        )
    state = init_clip_state()
    _raises_everywhere(
        lambda: adaptive_clip_grad_norm_(params, mesh, state, param_norms=index if odd else None),
        params,
        ValueError,
        "param_norms (rank 2 differs from rank 0)",
    )
    _raises_everywhere(
        lambda: adaptive_clip_grad_norm_(params, mesh, state, z=3.0 if odd else 2.5),
        params,
        ValueError,
        "rule (rank 2 differs from rank 0)",
    )
    _in_step(mesh)


def an_option_invalid_on_one_rank_only(rank: int, world_size: int) -> None:
    # Rank 3's own argument checks fail; it still takes part in the check, which names the option everywhere.
    mesh, _, params = _fresh()
    state = init_clip_state()
    warmup = 1 if rank == 3 else 5  # 1 is not a valid warm-up
    _raises_everywhere(
        lambda: adaptive_clip_grad_norm_(params, mesh, state, warmup=warmup),
        params,
        ValueError,
        "rule (rank 3 differs from rank 0)",
    )
    groups = {"w": "weight", "b": "bias"}
    exclude = {"x"} if rank == 2 else {"w"}  # "x" is not a label of groups
    _raises_everywhere(
        lambda: adaptive_clip_grad_norm_(params, mesh, state, groups=groups, exclude=exclude),
        params,
        ValueError,
        "exclude (rank 2 differs from rank 0)",
    )
    # Invalid alike on every rank: the same error everywhere, and the ranks stay in step.
    with pytest.raises(ValueError, match="warmup must be an int >= 2"):
        adaptive_clip_grad_norm_(params, mesh, state, warmup=1)
    _in_step(mesh)


def tied_declared_on_one_stage_only(rank: int, world_size: int) -> None:
    mesh, stage, params = _fresh()
    tied = {f"s{stage}.weight": 2} if stage == 0 else None
    _raises_everywhere(
        lambda: clip_grad_norm_(params, mesh, 0.1, tied=tied),
        params,
        ValueError,
        "tied (the declarations do not pair up across pipeline stages",
        "stage (0,): 1, stage (1,): 0",
    )
    _in_step(mesh)


def tied_that_differs_within_a_stage(rank: int, world_size: int) -> None:
    mesh, stage, params = _fresh()
    tied = {f"s{stage}.weight": 2} if rank != 1 else {f"s{stage}.bias": 2}
    _raises_everywhere(
        lambda: clip_grad_norm_(params, mesh, 0.1, tied=tied),
        params,
        ValueError,
        "tied (rank 1 differs from rank 0 of the same pipeline stage)",
    )
    _in_step(mesh)


def tied_declared_on_both_stages_is_fine(rank: int, world_size: int) -> None:
    mesh, stage, params = _fresh()
    total = clip_grad_norm_(params, mesh, 1e9, tied={f"s{stage}.weight": 2})
    mine = (params[f"s{stage}.weight"].grad.norm() ** 2 / 2 + params[f"s{stage}.bias"].grad.norm() ** 2).item()
    assert float(total) ** 2 == pytest.approx(sum(gather_objects(mine)) / 2, rel=1e-6)


def exclude_and_group_thresholds(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    groups = {"w": "weight", "b": "bias"}
    state = init_clip_state()
    excl = {"b"} if rank == 3 else {"w"}
    _raises_everywhere(
        lambda: adaptive_clip_grad_norm_(params, mesh, state, groups=groups, exclude=excl),
        params,
        ValueError,
        "exclude (rank 3 differs from rank 0)",
    )
    limits = {"w": 0.5 if rank == 3 else 0.25}
    _raises_everywhere(
        lambda: clip_grad_norm_by_group_(params, mesh, groups, 1.0, group_max_norm=limits),
        params,
        ValueError,
        "group_max_norm (rank 3 differs from rank 0)",
    )
    _in_step(mesh)


def with_mesh_none_the_dtensor_leaves_name_the_world(rank: int, world_size: int) -> None:
    # The world is each stage's dp mesh: ranks (0, 1) disagree, ranks (2, 3) agree.
    mesh, stage, _params = _fresh()
    grads = {"w": DTensor.from_local(torch.ones(4), mesh["dp"], [Replicate()], run_check=False)}
    p = 1.0 if rank == 1 else 2.0
    for compiled in (False, True):
        torch._dynamo.reset()

        def call():
            return clip_grad_norm(grads, None, 0.1, norm_type=p)

        fn = torch.compile(call, backend="aot_eager", fullgraph=True) if compiled else call
        if stage == 0:
            with pytest.raises(Exception) as caught:
                fn()
            e = _cause(caught.value)
            assert isinstance(e, ValueError) and "norm_type (rank 1 differs from rank 0)" in str(e), str(e)
        else:
            _, total = fn()
            assert float(total) == pytest.approx(2.0)
        assert torch.equal(grads["w"].to_local(), torch.ones(4))


def with_mesh_none_a_rank_that_fails_first_still_takes_part_in_the_check(rank: int, world_size: int) -> None:
    # With mesh=None the check comes once the leaves have named the world; rank 1 fails before that (a
    # bad leaf), so it takes part in the check from its failure path, then in the all-reduce.
    mesh, stage, _ = _fresh()
    grads = {"w": DTensor.from_local(torch.ones(4), mesh["dp"], [Replicate()], run_check=False)}
    if rank == 1:
        grads["step"] = torch.ones(1, dtype=torch.int64)
    if rank == 1:
        with pytest.raises(TypeError, match=r"leaf \['step'\] has dtype torch.int64"):
            clip_grad_norm(grads, None, 0.1)
    else:
        _, total = clip_grad_norm(grads, None, 0.1)
        assert math.isnan(float(total)) if stage == 0 else float(total) == pytest.approx(2.0)
    # The same, with rank 1's options differing too: both ranks of its world raise the disagreement.
    _agree.forget_configurations()
    p = 1.0 if rank == 1 else 2.0
    if stage == 0:
        with pytest.raises(ValueError, match=r"norm_type \(rank 1 differs from rank 0\)"):
            clip_grad_norm(grads, None, 0.1, norm_type=p)
    else:
        assert float(clip_grad_norm(grads, None, 0.1, norm_type=p)[1]) == pytest.approx(2.0)
    _in_step(mesh)


def different_functions_on_different_ranks(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()

    def call():
        if rank == 0:
            return global_grad_norm({n: p.grad for n, p in params.items()}, mesh)
        return clip_grad_norm_(params, mesh, 0.1)

    _raises_everywhere(
        call, params, ValueError, "the options passed (which clip function) (ranks [1, 2, 3] differ from rank 0)"
    )
    _in_step(mesh)


# --- adaptive state -----------------------------------------------------------------------------------


def a_clip_state_from_another_step_on_one_rank(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    state = init_clip_state()
    if rank == 2:  # e.g. restored from another checkpoint
        state = ClipState(
            torch.tensor(7), torch.tensor(1.5, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)
        )
    eager_text = "ranks hold different adaptive clip states (ClipState: count, mean, var)"
    for compiled in (False, True):
        torch._dynamo.reset()
        before = {n: p.grad.clone() for n, p in params.items()}

        def call():
            return adaptive_clip_grad_norm_(params, mesh, state, max_norm=0.01)

        fn = torch.compile(call, backend="aot_eager", fullgraph=True) if compiled else call
        with pytest.raises(RuntimeError) as caught:
            fn()
        assert eager_text in str(caught.value), str(caught.value)
        if not compiled:  # eager, the error path gathers once more to say which ranks
            assert isinstance(caught.value, _agree.StateDisagreement)
            assert "rank 2 differs from rank 0" in str(caught.value), str(caught.value)
        for n, p in params.items():
            assert torch.equal(p.grad, before[n]), f"{'compiled' if compiled else 'eager'}: {n} was changed"
    _in_step(mesh)


def an_adagc_state_that_differs_on_one_rank(rank: int, world_size: int) -> None:
    mesh, _, params = _fresh()
    index = param_norm_index(params, mesh)
    state = init_adagc_state(index)
    if rank == 1:
        state = state._replace(gamma=state.gamma.clone().fill_(0.5))
    for compiled in (False, True):
        torch._dynamo.reset()
        before = {n: p.grad.clone() for n, p in params.items()}

        def call():
            return adagc_clip_grad_norm_(params, mesh, state, index, max_norm=0.01)

        fn = torch.compile(call, backend="aot_eager", fullgraph=True) if compiled else call
        with pytest.raises(RuntimeError, match=r"ranks hold different AdaGC states") as caught:
            fn()
        if not compiled:
            assert isinstance(caught.value, _agree.StateDisagreement)
            assert "(rank 1 differs from rank 0)" in str(caught.value), str(caught.value)
        assert all(torch.equal(p.grad, before[n]) for n, p in params.items())
    _in_step(mesh)


def the_same_state_steps_on(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    state = init_clip_state()
    for _ in range(3):
        state = adaptive_clip_grad_norm_(params, mesh, state, max_norm=1.0, warmup=2).state
    assert int(state.count) == 3
    assert len(set(gather_objects((int(state.count), float(state.mean), float(state.var))))) == 1


def a_state_changed_in_place_on_one_rank(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    index = param_norm_index(params, mesh)
    clips = {
        "adaptive clip states": (
            init_clip_state(),
            lambda s: adaptive_clip_grad_norm_(params, mesh, s, max_norm=1.0, warmup=2),
            lambda s: s.mean.mul_(2.0),  # e.g. one rank's load_state_dict copying another step's values in
        ),
        "AdaGC states": (
            init_adagc_state(index),
            lambda s: adagc_clip_grad_norm_(params, mesh, s, index, max_norm=1.0),
            lambda s: s.gamma.fill_(0.5),
        ),
    }
    for what, (state, clip, change) in clips.items():
        state = clip(clip(state).state).state  # two steps on, as a training loop passes its state back
        if rank == 1:
            change(state)
        before = {n: p.grad.clone() for n, p in params.items()}
        with pytest.raises(_agree.StateDisagreement) as caught:
            clip(state)
        assert f"ranks hold different {what}" in str(caught.value), str(caught.value)
        assert "(rank 1 differs from rank 0)" in str(caught.value), str(caught.value)
        assert all(torch.equal(p.grad, before[n]) for n, p in params.items()), what
    _in_step(mesh)


def a_rank_that_passes_back_an_older_state(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()

    def clip(state):
        return adaptive_clip_grad_norm_(params, mesh, state, max_norm=1.0, warmup=2)

    older = clip(init_clip_state()).state
    newer = clip(older).state
    before = {n: p.grad.clone() for n, p in params.items()}
    with pytest.raises(_agree.StateDisagreement, match=r"\(rank 3 differs from rank 0\)"):
        clip(older if rank == 3 else newer)  # rank 3 dropped the state its last step returned
    assert all(torch.equal(p.grad, before[n]) for n, p in params.items())
    _in_step(mesh)


def a_rank_that_remakes_the_same_state_goes_on(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()

    def clip(state):
        return adaptive_clip_grad_norm_(params, mesh, state, max_norm=1.0, warmup=2).state

    state = clip(clip(init_clip_state()))
    if rank == 2:  # e.g. restored from the same checkpoint: the same values in new tensors
        state = ClipState(*(t.clone() for t in state))
    with CollectiveCounter() as counter:
        state = clip(state)  # the state's bits are compared, not its tensors: no error, nothing more gathered
    assert counter.ops == ["_c10d_functional.all_reduce"], counter.ops
    assert len(set(gather_objects((int(state.count), float(state.mean), float(state.var))))) == 1


# --- the steady state -----------------------------------------------------------------------------------


def after_the_first_call_one_all_reduce_and_nothing_else(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    groups = {"w": "weight", "b": "bias"}
    calls = {
        "clip_grad_norm_": lambda: clip_grad_norm_(params, mesh, 1.0, groups=groups),
        "adaptive, with its state": lambda: adaptive_clip_grad_norm_(params, mesh, init_clip_state(), groups=groups),
    }
    for what, call in calls.items():
        with CollectiveCounter() as first:
            call()
        with CollectiveCounter() as second:
            call()
        assert first.ops == ["c10d._allgather_base_", "_c10d_functional.all_reduce"], (what, first.ops)
        assert second.ops == ["_c10d_functional.all_reduce"], (what, second.ops)
    # A new max_norm every step (a schedule) is not a new configuration: no gather, for the fixed
    # threshold and for an adaptive rule's cap (ZClip's and AdaGC's), a float or a tensor.
    index = param_norm_index(params, mesh)
    state, adagc = init_clip_state(), init_adagc_state(index)
    adagc = adagc_clip_grad_norm_(params, mesh, adagc, index, max_norm=1.0).state  # its first sight: a gather
    for max_norm in (0.5, 0.25, 0.125, torch.tensor(0.1), torch.tensor(0.05)):
        with CollectiveCounter() as c:
            clip_grad_norm_(params, mesh, max_norm, groups=groups)
            state = adaptive_clip_grad_norm_(params, mesh, state, max_norm=max_norm, groups=groups).state
            adagc = adagc_clip_grad_norm_(params, mesh, adagc, index, max_norm=max_norm).state
        assert c.ops == ["_c10d_functional.all_reduce"] * 3, c.ops
    dist.barrier()


def the_first_sights_gather_warns_nothing(rank: int, world_size: int) -> None:
    # It ran every rank's first call of each configuration: a deprecated collective printed a
    # FutureWarning there on every rank (all_gather_into_tensor, deprecated in torch 2.13).
    mesh, _stage, params = _fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CollectiveCounter() as c:
            clip_grad_norm_(params, mesh, 1.0)
    assert c.ops == ["c10d._allgather_base_", "_c10d_functional.all_reduce"], c.ops  # the gather did run
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


def a_torch_without_all_gather_single_gathers_the_older_way(rank: int, world_size: int) -> None:
    # torch < 2.13 has no all_gather_single: the first sight gathers with all_gather_into_tensor,
    # and a disagreement is still seen by every rank.
    with mock.patch.object(dist, "all_gather_single", None, create=True):
        mesh, _stage, params = _fresh()
        with CollectiveCounter() as c:
            clip_grad_norm_(params, mesh, 1.0)
        assert c.ops == ["c10d._allgather_base_", "_c10d_functional.all_reduce"], c.ops
        _fresh()
        norm_type = 1.0 if rank == 3 else 2.0
        _raises_everywhere(
            lambda: clip_grad_norm_(params, mesh, 1.0, norm_type), params, ValueError, "norm_type", "rank 3 differs"
        )
    _in_step(mesh)


def a_torch_without_either_gather_raises_the_same_everywhere(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    before = {n: p.grad.clone() for n, p in params.items()}
    with (
        mock.patch.object(dist, "all_gather_single", None, create=True),
        mock.patch.object(dist, "all_gather_into_tensor", None),
        pytest.raises(UnsupportedTorchError, match="all_gather_single or all_gather_into_tensor"),
    ):
        clip_grad_norm_(params, mesh, 1.0)
    assert all(torch.equal(p.grad, before[n]) for n, p in params.items())
    _in_step(mesh)


def _ending_with(suffix: str) -> object:
    return lambda name: name.endswith(suffix)  # a new function object every call


def a_groups_function_written_in_the_loop_is_one_configuration(rank: int, world_size: int) -> None:
    mesh, _stage, params = _fresh()
    gather, all_reduce = "c10d._allgather_base_", "_c10d_functional.all_reduce"
    seen = []
    for _ in range(3):
        with CollectiveCounter() as c:
            clip_grad_norm_(params, mesh, 1.0, groups={"weights": lambda name: name.endswith("weight")})
        seen.append(c.ops)
    assert seen == [[gather, all_reduce], [all_reduce], [all_reduce]], seen
    # The same code capturing another value, or the same groups in another order, is another
    # configuration: checked once, then remembered.
    configurations = [
        {"weights": _ending_with("weight")},
        {"weights": _ending_with("bias")},
        {"w": _ending_with("weight"), "b": _ending_with("bias")},
        {"b": _ending_with("bias"), "w": _ending_with("weight")},
    ]
    for i, groups in enumerate(configurations * 2):
        with CollectiveCounter() as c:
            clip_grad_norm_(params, mesh, 1.0, groups=groups)
        first_sight = i < len(configurations)
        assert c.ops == [gather] * first_sight + [all_reduce], (i, c.ops)


def a_groups_mapping_changed_in_place_is_a_new_configuration(rank: int, world_size: int) -> None:
    # The same dict object every call: a repeated call is one comparison with a copy of the last
    # configuration, so a label added, or the labels reordered, in place is checked again.
    mesh, _stage, params = _fresh()
    gather, all_reduce = "c10d._allgather_base_", "_c10d_functional.all_reduce"
    groups = {"w": _ending_with("weight")}
    seen = []
    for change in (None, None, "add a label", None, "reorder", None):
        if change == "add a label":
            groups["b"] = _ending_with("bias")
        elif change == "reorder":
            groups["w"] = groups.pop("w")  # the same items, "w" now last
        with CollectiveCounter() as c:
            clip_grad_norm_(params, mesh, 1.0, groups=groups)
        seen.append(c.ops)
    first_sight, again = [gather, all_reduce], [all_reduce]
    assert seen == [first_sight, again, first_sight, again, first_sight, again], seen


def compiled_with_its_state_check_one_graph_one_all_reduce_no_host_read(rank: int, world_size: int) -> None:
    mesh, _, params = _fresh()
    grads = {n: p.grad for n, p in params.items()}
    backend = CaptureBackend()
    step = torch.compile(
        lambda g, s: adaptive_clip_grad_norm(g, mesh, s, max_norm=1.0, warmup=2), backend=backend, fullgraph=True
    )
    state = init_clip_state()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(4):
            _, stats = step(grads, state)
            state = stats.state
    assert int(state.count) == 4
    assert_one_graph_one_collective(backend)  # and no host sync in it
    assert any(op.startswith("aten::_assert_async") for op in aten_ops(backend.aten[0])), aten_ops(backend.aten[0])


def inductor_keeps_every_gradient_when_the_states_differ(rank: int, world_size: int) -> None:
    # Inductor may order the scaling before the assert: the step is a no-op by then (threshold inf).
    mesh, _, params = _fresh()
    state = init_clip_state()
    if rank == 0:
        state = state._replace(count=torch.tensor(3))
    before = {n: p.grad.clone() for n, p in params.items()}
    step = torch.compile(lambda: adaptive_clip_grad_norm_(params, mesh, state, max_norm=1e-3), fullgraph=True)
    with pytest.raises(RuntimeError, match="ranks hold different adaptive clip states"):
        step()
    for n, p in params.items():
        assert torch.equal(p.grad, before[n]), n
    _in_step(mesh)


CASES = [
    groups_built_from_each_stages_own_names,
    the_readme_fix_gives_each_stage_its_true_norm,
    norm_type_on_one_rank,
    a_different_number_of_group_labels,
    every_other_option_that_shapes_or_reads_the_vector,
    an_option_invalid_on_one_rank_only,
    tied_declared_on_one_stage_only,
    tied_that_differs_within_a_stage,
    tied_declared_on_both_stages_is_fine,
    exclude_and_group_thresholds,
    with_mesh_none_the_dtensor_leaves_name_the_world,
    with_mesh_none_a_rank_that_fails_first_still_takes_part_in_the_check,
    different_functions_on_different_ranks,
    a_clip_state_from_another_step_on_one_rank,
    an_adagc_state_that_differs_on_one_rank,
    the_same_state_steps_on,
    a_state_changed_in_place_on_one_rank,
    a_rank_that_passes_back_an_older_state,
    a_rank_that_remakes_the_same_state_goes_on,
    after_the_first_call_one_all_reduce_and_nothing_else,
    the_first_sights_gather_warns_nothing,
    a_torch_without_all_gather_single_gathers_the_older_way,
    a_torch_without_either_gather_raises_the_same_everywhere,
    a_groups_function_written_in_the_loop_is_one_configuration,
    a_groups_mapping_changed_in_place_is_a_new_configuration,
    compiled_with_its_state_check_one_graph_one_all_reduce_no_host_read,
    inductor_keeps_every_gradient_when_the_states_differ,
]

# The compiled cases (about 14 s of the shared 4-rank run) are left out of `make test-quick`.
SLOW = (
    "inductor_keeps_every_gradient_when_the_states_differ",
    "a_clip_state_from_another_step_on_one_rank",
    "compiled_with_its_state_check_one_graph_one_all_reduce_no_host_read",
)
test_on_real_ranks = real_rank_test(CASES, WORLD, case_timeout=120.0, slow=SLOW, share=True)
