"""A threshold per group and groups kept out of the clip: against float64 computed the obvious way.

The reference flattens each group's gradients, takes each group's norm and the
total over the groups that count (``tests/_reference.py``), and scales each
leaf of an included group by ``min(max_norm / (total + eps),
group_max_norm / (group norm + eps), 1)`` (each term where given); excluded
leaves are returned as they came. Checked for every norm type, in place and
pure, with a NaN in an excluded group (which must change nothing) and in an
included one, a group that matches no leaf, bad options (named), under
``torch.compile`` (one graph, one collective, over DTensor leaves) and on 4
gloo ranks split into pipeline stages with FSDP-sharded leaves (one collective).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ppclip_func import (
    adagc_clip_grad_norm,
    adaptive_clip_grad_norm,
    adaptive_clip_grad_norm_,
    clip_grad_norm_by_group,
    clip_grad_norm_by_group_,
    init_adagc_state,
    init_clip_state,
    param_norm_index,
)
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, steady_count
from tests._fake_pg import fake_world
from tests._gather import model_gradient
from tests._reference import reference_norm
from tests.test_adagc import reference_run
from tests.test_compile_fake_pg import CaptureBackend, assert_one_graph_one_collective

GROUPS = {"embed": "embed", "experts": "experts", "muon": lambda name: name.endswith(".muon"), "nothing": "absent"}
NORM_TYPES = (2.0, 1.0, 3.5, math.inf, -math.inf, 0.0)
OPTIONS = [
    dict(max_norm=1.0),
    dict(max_norm=1.0, exclude={"muon"}),
    dict(max_norm=2.0, group_max_norm={"experts": 0.5}, exclude={"muon"}),
    dict(max_norm=None, group_max_norm={"embed": 0.3, "experts": 100.0}),
    dict(max_norm=0.5, group_max_norm={"nothing": 0.1}, exclude={"muon", "embed"}),
]


def _grads(seed: int = 0) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(6, 4, generator=g) * 0.2,
        "layers.0.experts.w": torch.randn(3, 5, generator=g),
        "layers.0.attn.muon": torch.randn(4, 4, generator=g) * 10,
        "layers.0.attn.b": torch.randn(4, generator=g) * 0.1,
        "layers.0.empty": torch.zeros(0),
        "layers.1.none": None,
        "head.muon": torch.randn(2, 3, generator=g) * 3,
    }


def _label(name: str) -> str | None:
    for label, pattern in GROUPS.items():
        if pattern(name) if callable(pattern) else pattern in name.split("."):
            return label
    return None


def reference(grads, norm_type, *, max_norm, group_max_norm=None, exclude=(), eps=1e-6):
    """``(clipped, total, {label: norm})`` in float64, the obvious way."""
    present = {k: g.double() for k, g in grads.items() if g is not None}
    members = {label: [g for k, g in present.items() if _label(k) == label] for label in GROUPS}
    norms = {label: reference_norm(gs, norm_type) if gs else math.nan for label, gs in members.items()}
    total = reference_norm([g for k, g in present.items() if _label(k) not in exclude], norm_type)
    clipped = {}
    for k, g in grads.items():
        label = _label(k)
        if g is None or label in (exclude or ()):
            clipped[k] = g
            continue
        coef = 1.0
        if max_norm is not None:
            coef = min(coef, max_norm / (total + eps))
        if label in (group_max_norm or {}):
            coef = min(coef, group_max_norm[label] / (norms[label] + eps))
        clipped[k] = g.double() * coef
    return clipped, total, norms


def _assert_matches(clipped, total, norms, want, where):
    want_clipped, want_total, want_norms = want
    assert math.isclose(float(total), want_total, rel_tol=1e-6) or float(total) == want_total, (
        where,
        total,
        want_total,
    )
    for label, n in want_norms.items():
        got = float(norms[label])
        assert (math.isnan(got) and math.isnan(n)) or math.isclose(got, n, rel_tol=1e-6), (where, label, got, n)
    for k, w in want_clipped.items():
        if w is None:
            assert clipped[k] is None
        else:
            torch.testing.assert_close(clipped[k].double(), w.double(), rtol=2e-6, atol=1e-12, msg=f"{where} {k}")


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("opts", OPTIONS, ids=range(len(OPTIONS)))
def test_pure_and_in_place_match_the_reference(norm_type, opts):
    grads = _grads()
    want = reference(grads, norm_type, **opts)
    clipped, total, norms = clip_grad_norm_by_group(grads, None, GROUPS, norm_type=norm_type, **opts)
    _assert_matches(clipped, total, norms, want, "pure")
    params = {k: torch.nn.Parameter(torch.zeros_like(g) if g is not None else torch.zeros(1)) for k, g in grads.items()}
    for k, g in grads.items():
        params[k].grad = None if g is None else g.clone()
    total, norms = clip_grad_norm_by_group_(params, None, GROUPS, norm_type=norm_type, **opts)
    _assert_matches({k: p.grad for k, p in params.items()}, total, norms, want, "in place")


def test_the_cases_clip_something_and_exclusion_changes_the_total():
    grads = _grads()
    _, all_total, _ = reference(grads, 2.0, max_norm=1.0)
    _, part_total, _ = reference(grads, 2.0, max_norm=1.0, exclude={"muon"})
    assert part_total < all_total / 5, "the muon group dominates the total unless excluded"
    clipped, _, _ = clip_grad_norm_by_group(grads, None, GROUPS, **OPTIONS[2])
    assert clipped["layers.0.attn.muon"] is grads["layers.0.attn.muon"], "an excluded leaf is returned as it came"
    ratio = float(clipped["layers.0.experts.w"].norm() / grads["layers.0.experts.w"].norm())
    assert ratio < 0.5, "the experts were clipped by their own threshold"


def test_a_nan_in_an_excluded_group_changes_nothing_and_one_in_an_included_group_makes_the_total_nan():
    grads = _grads()
    grads["head.muon"][0, 0] = math.nan
    clipped, total, norms = clip_grad_norm_by_group(grads, None, GROUPS, max_norm=1.0, exclude={"muon"})
    _, want_total, _ = reference(_grads(), 2.0, max_norm=1.0, exclude={"muon"})
    assert math.isclose(float(total), want_total, rel_tol=1e-6) and math.isnan(float(norms["muon"]))
    assert torch.isfinite(clipped["embed.weight"]).all()
    grads["embed.weight"][0, 0] = math.nan
    clipped, total, _ = clip_grad_norm_by_group(grads, None, GROUPS, max_norm=1.0, exclude={"muon"}, nonfinite="zero")
    assert math.isnan(float(total))
    assert float(clipped["layers.0.experts.w"].abs().sum()) == 0, "nonfinite='zero' zeroed the included leaves"
    assert torch.equal(clipped["layers.0.attn.muon"], grads["layers.0.attn.muon"]), "and left the excluded alone"


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (dict(exclude={"moun"}), ValueError, "exclude names 'moun'"),
        (dict(group_max_norm={"expert": 1.0}), ValueError, "group_max_norm names 'expert'"),
        (dict(group_max_norm={"muon": 1.0}, exclude={"muon"}), ValueError, "'muon' is both excluded"),
        (dict(group_max_norm={"embed": -1.0}), ValueError, r"group_max_norm\['embed'\]"),
        (dict(exclude="muon"), TypeError, "exclude must be a collection"),
    ],
)
def test_bad_options_raise_naming_the_label(bad, error, match):
    with pytest.raises(error, match=match):
        clip_grad_norm_by_group(_grads(), None, GROUPS, **({"max_norm": 1.0} | bad))


def test_twenty_compiled_steps_over_dtensor_leaves_trace_once_with_one_collective():
    torch._dynamo.reset()
    with fake_world(8, rank=3):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        dp = mesh["dp"]
        backend = CaptureBackend()

        def step(grads, max_norm):
            return clip_grad_norm_by_group(
                grads, mesh, GROUPS, max_norm, group_max_norm={"experts": 0.5}, exclude={"muon"}
            )

        compiled = torch.compile(step, backend=backend, fullgraph=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(20):
                local = {k: v for k, v in _grads(i).items() if v is not None and v.numel()}
                grads = {k: DTensor.from_local(v, dp, [Shard(0)], run_check=False) for k, v in local.items()}
                max_norm = torch.tensor(0.5 + 0.1 * i)
                (got, total, _), (want, want_total, _) = compiled(grads, max_norm), step(grads, max_norm)
                torch.testing.assert_close(total, want_total, rtol=1e-6, atol=0)
                for k in grads:
                    torch.testing.assert_close(got[k].to_local(), want[k].to_local(), rtol=1e-6, atol=0)
        assert_one_graph_one_collective(backend)
    torch._dynamo.reset()


# --- real ranks --------------------------------------------------------------------------------------


def every_stage_clips_by_group_with_one_collective(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, dp = mesh.get_coordinate()[0], mesh["dp"]
    full = _grads(7)
    names = list(full)
    mine = {k: full[k] for k in (names[:4] if stage == 0 else names[4:])}
    grads = {}
    for k, g in mine.items():
        if g is not None and g.dim() == 2 and g.shape[0] % 2 == 0:  # FSDP-sharded
            local = g.chunk(2)[dp.get_local_rank()].contiguous()
            g = DTensor.from_local(local, dp, [Shard(0)], run_check=False, shape=g.shape, stride=g.stride())
        grads[k] = g
    model = model_gradient(grads)
    whole = {k: model.get(k) for k in full}
    for norm_type in (2.0, math.inf):
        for opts in OPTIONS[1:3]:
            with CollectiveCounter() as counter:
                clipped, total, norms = clip_grad_norm_by_group(grads, mesh, GROUPS, norm_type=norm_type, **opts)
            assert steady_count(counter) == 1, counter.ops
            clipped = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in clipped.items()}
            want_clipped, want_total, want_norms = reference(whole, norm_type, **opts)
            _assert_matches(
                clipped,
                total,
                norms,
                ({k: want_clipped[k] for k in clipped}, want_total, want_norms),
                (norm_type, opts),
            )


test_on_real_ranks = real_rank_test([every_stage_clips_by_group_with_one_collective], 4, share=True)


# --- exclude= on the adaptive clips: out of the total, the statistics and the skip decision -----------


def test_the_zclip_clip_leaves_an_excluded_group_out_of_its_total_and_skip_decision():
    grads = _grads()
    grads["head.muon"][0, 0] = math.nan  # an excluded group's NaN: no skip, nothing NaN
    want_clipped, want_total, _ = reference(grads, 2.0, max_norm=1.0, exclude={"muon"})
    clipped, stats = adaptive_clip_grad_norm(grads, None, init_clip_state(), groups=GROUPS, exclude={"muon"}, z=None)
    assert math.isclose(float(stats.total_norm), want_total, rel_tol=1e-6) and not bool(stats.skip)
    assert math.isnan(float(stats.group_norms["muon"])), "still measured and returned"
    for k, w in want_clipped.items():
        if w is not None and _label(k) != "muon":
            torch.testing.assert_close(clipped[k].double(), w, rtol=2e-6, atol=1e-12)
    assert torch.equal(clipped["layers.0.attn.muon"], grads["layers.0.attn.muon"])
    params = {k: torch.nn.Parameter(torch.zeros_like(g)) for k, g in grads.items() if g is not None}
    for k, p in params.items():
        p.grad = grads[k].clone()
    stats = adaptive_clip_grad_norm_(params, None, init_clip_state(), groups=GROUPS, exclude={"muon"}, z=None)
    assert not bool(stats.skip)
    assert params["layers.0.attn.muon"].grad.equal(grads["layers.0.attn.muon"]), "never scaled"
    torch.testing.assert_close(params["embed.weight"].grad.double(), want_clipped["embed.weight"], rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match="exclude names 'moun'"):
        adaptive_clip_grad_norm(grads, None, init_clip_state(), groups=GROUPS, exclude={"moun"})


def test_adagc_leaves_an_excluded_group_out_of_its_total_and_state():
    opts = dict(max_norm=0.5, warmup=3, beta=0.9)
    steps = [{k: v for k, v in _grads(i).items() if v is not None} for i in range(10)]
    for s in steps[6:8]:
        s["layers.0.experts.w"] = s["layers.0.experts.w"] * 20  # a spike, clipped
    index = param_norm_index({k: torch.zeros_like(v) for k, v in steps[0].items()}, None)
    counted = [{k: v for k, v in s.items() if _label(k) != "muon"} for s in steps]
    want = reference_run(counted, **opts)
    state = init_adagc_state(index)
    clipped_spike = False
    for i, (grads, (want_clipped, want_gamma, _)) in enumerate(zip(steps, want)):
        clipped, stats = adagc_clip_grad_norm(grads, None, state, index, groups=GROUPS, exclude={"muon"}, **opts)
        state = stats.state
        gamma, coef = index.named(state.gamma), index.named(stats.coefficients)
        clipped_spike |= i in (6, 7) and float(coef["layers.0.experts.w"]) < 0.5
        for k, g in grads.items():
            if _label(k) == "muon":
                assert clipped[k] is g and float(coef[k]) == 1.0 and float(gamma[k]) == math.inf, (i, k)
            else:
                torch.testing.assert_close(clipped[k].double(), want_clipped[k], rtol=2e-6, atol=1e-12)
                if k in want_gamma:
                    assert math.isclose(float(gamma[k]), want_gamma[k], rel_tol=1e-6), (i, k)
    assert clipped_spike, "the spike was clipped by its own history: the comparison could fail"
