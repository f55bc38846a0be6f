"""The clip in OLMo-core 3.0.0's own train modules and parallelisms, against the float64 gradient of the whole model.

Four gloo ranks, started once for every case (``tests/_cases.py``). Each
layout is built by OLMo-core's ``TransformerTrainModuleConfig.build()``
(``tests/_olmo_core.py``: its ``build_world_mesh``, pipeline split, TP, CP,
EP, FSDP/HSDP/DDP), then stepped: a real forward/backward through
``train_batch`` where OLMo-core's forward runs on a CPU, else gradients set
in every parameter's layout (the layout says what stops its forward). The
reference is that gradient gathered from every rank in float64
(``tests/_gather.py``), its norm taken the obvious way. Per layout:

* ``drop_in``: for norm types 2, 1, inf and -inf,
  ``ppclip_func.olmo_core.clip_grad_norm_(train_module, ...)`` is within
  1e-6 of float64 with one collective and clips to the float64 reference;
  OLMo-core's own ``_clip_grad_norm`` on the same gradients is recorded (its
  norm's error, its collectives) and held to what it computes: float32
  arithmetic, and for ``-inf`` in a pipeline the MAX over the stages of each
  stage's min (its ``pp_group`` all-reduce takes MAX for any infinite norm
  type), which is not the model's min. Then the same with the gradients in
  bf16, where OLMo-core's norm is itself bf16.
* ``call_site``: ``use_ppclip(train_module)`` and OLMo-core's unchanged
  ``optim_step()``: the norm it logs as ``optim/total grad norm`` and the
  ``latest_grad_norm`` its ``SkipStepAdamW`` reads are ours, one collective.
* ``adaptive_checkpoint`` (two layouts): the adaptive threshold through the
  same seam, its statistics saved and loaded by OLMo-core's checkpoint
  functions with the train module's own state dict.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from typing import Any

import pytest
import torch

from tests._olmo_core import DIST_NAME, OLMO_CORE_VERSION, Built, Layout, build, skip_reason

if (_reason := skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from ppclip_func.olmo_core import STATE_KEY, PPClipMixin, clip_grad_norm_, use_ppclip
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter
from tests._gather import cast_grads, gather_objects, model_gradient, shared_dir
from tests._reference import reference_coefficient, reference_norm
from tests._trainer_checks import (
    RTOL,
    BuiltOnce,
    Checks,
    SteppedLayout,
    all_but,
    layout_case,
    local,
    local_copies,
    put_back,
)

WORLD = 4
NORM_TYPES = (2.0, 1.0, math.inf, -math.inf)
# OLMo-core's norm is float32 throughout (torch's get_total_norm): within 1e-4 of float64 on these models.
OLMO_RTOL = 1e-4
# Its norm of bf16 gradients is a bf16 number (8 bits of mantissa) taken of bf16 norms of each gradient: two
# roundings, within 2**-7 of the float64 norm (up to 5.2e-3 measured).
OLMO_BF16_RTOL = 2.0**-7

LAYOUTS = {
    "fsdp4": Layout(dp="fsdp"),
    "hsdp2x2": Layout(dp="hsdp", num_replicas=2),
    "ddp4": Layout(dp="ddp"),
    "fsdp2_tp2": Layout(dp="fsdp", tp=2),
    "fsdp2_cp2": Layout(dp="fsdp", cp=2),
    "hsdp2x2_ep2_moe": Layout(dp="hsdp", num_replicas=2, ep=2, moe=True),
    "pp2_fsdp2": Layout(pp=2, dp="fsdp"),
    "pp2_hsdp1x2_ep2_moe": Layout(pp=2, dp="hsdp", num_replicas=1, ep=2, moe=True),
}
ADAPTIVE_LAYOUTS = ("fsdp2_tp2", "pp2_fsdp2")


def test_olmo_core_is_installed() -> None:
    """The version these tests pin (OLMo-core is installed --no-deps, pinned, by the Makefile)."""
    version = importlib.metadata.version(DIST_NAME)
    assert version == OLMO_CORE_VERSION, f"{DIST_NAME} {version} is installed; these tests pin {OLMO_CORE_VERSION}"


# ---------------------------------------------------------------------------------------------
# One build and one step per layout, shared by its cases
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stepped(SteppedLayout):
    """A layout after one step: its train module, whose model parts hold the gradients."""

    built: Built
    stage_names: list[set[str]]  # the parameter names of each pipeline stage ([all names] without a pipeline)

    @property
    def module(self) -> Any:
        return self.built.module

    def grads(self) -> dict[str, torch.Tensor | None]:
        return self.built.named_grads()

    def restore(self) -> None:
        """The step's own gradient tensors back (a case may have put others in), holding the step's values."""
        with torch.no_grad():
            for name, p in self._params().items():
                p.grad = self._original[name]
        super().restore()

    def _params(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for m in self.built.model_parts for n, p in m.named_parameters()}

    def __post_init__(self) -> None:
        self._original = {n: p.grad for n, p in self._params().items()}


def _step(name: str) -> Stepped:
    """Layout ``name`` built and stepped on this rank, with each stage's parameter names."""
    built = build(LAYOUTS[name])
    grads = built.named_grads()
    assert all(g is not None for g in grads.values()), "a parameter has no gradient after the step"
    mesh = built.module.world_mesh
    stage = mesh.get_local_rank("pp") if "pp" in (mesh.mesh_dim_names or ()) else 0
    stages: dict[int, set[str]] = {}
    for s, names in gather_objects((stage, sorted(grads))):
        stages.setdefault(s, set()).update(names)
    return Stepped(model_gradient(grads), local_copies(grads), built, [stages[s] for s in sorted(stages)])


_stepped = BuiltOnce(_step)  # each layout built once, for all its cases


def _olmo_expected(stepped: Stepped, model: dict[str, torch.Tensor], p: float) -> float:
    """What OLMo-core's clip computes, in exact arithmetic: the norm, except for an infinite norm type in a
    pipeline, where its MAX over the stages takes the largest of the stages' norms."""
    if math.isinf(p) and len(stepped.stage_names) > 1:
        return max(reference_norm([model[n] for n in names], p) for names in stepped.stage_names)
    return reference_norm(model.values(), p)


def _compare(
    stepped: Stepped, checks: Checks, model: dict[str, torch.Tensor], tag: str, olmo_rtol: float, grad_rtol: float
) -> None:
    """Ours and OLMo-core's ``_clip_grad_norm`` on the gradients the module holds now (clipped within ``grad_rtol``:
    a scaled bf16 gradient is rounded to bf16)."""
    saved = local_copies(stepped.grads())
    for p in NORM_TYPES:
        expected = reference_norm(model.values(), p)
        max_norm = expected / 2  # the clip always scales
        with CollectiveCounter() as c:
            ours = clip_grad_norm_(stepped.module, max_norm, p)
        checks.close(f"ours {tag} p={p}", ours, expected, RTOL, f"ours {tag}")
        checks.count(f"ours {tag} p={p}", c, first_sight=True)
        coefficient = reference_coefficient(expected, max_norm)
        checks.clipped(f"ours {tag} p={p}", stepped, coefficient, grad_rtol, saved=saved)
        put_back(stepped.grads(), saved)
        with CollectiveCounter() as c:
            theirs = stepped.built.olmo_class._clip_grad_norm(stepped.module, max_norm, p)
        put_back(stepped.grads(), saved)
        checks.count(f"OLMo-core {tag} p={p}", c, expected=None)
        what = _olmo_expected(stepped, model, p)
        checks.close(f"OLMo-core's _clip_grad_norm {tag} p={p}", theirs, what, olmo_rtol, f"OLMo-core {tag}")
        if what != expected:  # its -inf in a pipeline: wrong, and by more than its precision
            checks.close(f"OLMo-core {tag} p={p} vs float64", theirs, expected, math.inf, f"OLMo-core {tag} wrong")
            right = abs(float(theirs) - expected) <= olmo_rtol * expected
            checks.that(not right, f"OLMo-core {tag} p={p}: {float(theirs)} is the model's norm {expected}")
    # The next step: the same call, its options agreed on already: exactly one collective.
    expected = reference_norm(model.values(), 2.0)
    with CollectiveCounter() as c:
        ours = clip_grad_norm_(stepped.module, expected / 2)
    checks.close(f"ours {tag} p=2, again", ours, expected, RTOL, f"ours {tag}")
    checks.count(f"ours {tag} p=2, again", c)
    put_back(stepped.grads(), saved)


def drop_in(stepped: Stepped, checks: Checks) -> None:
    """``clip_grad_norm_(train_module, ...)`` and OLMo-core's ``_clip_grad_norm`` on fp32, then bf16, gradients."""
    _compare(stepped, checks, stepped.reference, "fp32", OLMO_RTOL, RTOL)
    # bf16 gradients of fp32 parameters (as where the model is kept in bf16): torch lets a parameter take a
    # gradient of another dtype once its grad_dtype is None.
    params = {n: p for m in stepped.built.model_parts for n, p in m.named_parameters()}
    grad_dtypes = {n: p.grad_dtype for n, p in params.items()}
    try:
        for name, g in cast_grads(stepped.grads(), torch.bfloat16).items():
            params[name].grad_dtype = None
            params[name].grad = g
        _compare(stepped, checks, model_gradient(stepped.grads()), "bf16", OLMO_BF16_RTOL, 2.0**-8)
    finally:
        stepped.restore()
        for name, p in params.items():
            p.grad_dtype = grad_dtypes[name]


def call_site(stepped: Stepped, checks: Checks) -> None:
    """``use_ppclip`` and OLMo-core's own ``optim_step()``: the norm logged and handed to ``SkipStepAdamW``."""
    module = use_ppclip(stepped.module)
    assert isinstance(module, stepped.built.olmo_class) and type(module)._clip_grad_norm is PPClipMixin._clip_grad_norm
    expected = stepped.expected(2.0)
    module.max_grad_norm = expected / 2
    params = {n: p for m in stepped.built.model_parts for n, p in m.named_parameters()}
    before = local_copies(params)
    with CollectiveCounter() as c:
        module.optim_step()
    logged = stepped.built.trainer.metrics["optim/total grad norm"]
    checks.close("optim/total grad norm", logged, expected, RTOL, "logged norm")
    checks.count("optim_step", c, first_sight=True)
    checks.clipped("optim_step", stepped, reference_coefficient(expected, expected / 2))
    for optim in stepped.built.optimizers():
        read = optim.latest_grad_norm is logged
        checks.that(read, f"{type(optim).__name__}.latest_grad_norm is not the norm optim_step logged")
    updated = any(not torch.equal(local(p), before[n]) for n, p in params.items())
    checks.that(updated, "optim_step did not update the parameters")
    put_back(params, before)
    stepped.restore()


def adaptive_checkpoint(stepped: Stepped, checks: Checks) -> None:
    """The adaptive threshold through ``_clip_grad_norm``; its statistics through OLMo-core's checkpoint."""
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata, load_state_dict, save_state_dict

    module = use_ppclip(stepped.module, adaptive={"warmup": 2})
    expected = stepped.expected(2.0)
    for step in range(3):
        with CollectiveCounter() as c:
            norm = module._clip_grad_norm(expected / 2)
        checks.close(f"adaptive step {step}", norm, expected, RTOL, "adaptive norm")
        checks.count(f"adaptive step {step}", c, first_sight=step == 0)
        stepped.restore()
    want = module.ppclip_state.state_dict()
    checks.that(int(want["count"]) == 3, f"the statistics counted {int(want['count'])} norms, not 3")
    try:
        with shared_dir("ppclip_olmo_") as path:
            save_state_dict(path, module.state_dict_to_save(), save_overwrite=True)
            metadata = get_checkpoint_metadata(path)
            saved = any(k.startswith(f"{STATE_KEY}.") for k in metadata.state_dict_metadata)
            checks.that(saved, f"the checkpoint has no {STATE_KEY}.* keys")
            module.__dict__.pop("_ppclip_state")  # a restarted run: fresh statistics, then the checkpoint loaded
            state_dict = module.state_dict_to_load(metadata)
            load_state_dict(path, state_dict)
            module.load_state_dict(state_dict)
            got = module.ppclip_state.state_dict()
            same = all(torch.equal(got[k], want[k]) for k in want)
            checks.that(same, f"statistics after the checkpoint {got} differ from before it {want}")
    finally:
        use_ppclip(module)  # back to the fixed threshold
        stepped.restore()


CASES = [
    layout_case(globals(), layout, part, _stepped)
    for layout in LAYOUTS
    for part in (drop_in, call_site, *((adaptive_checkpoint,) if layout in ADAPTIVE_LAYOUTS else ()))
]

# make test-quick runs one case alone on the ranks (about 5 s); the others are slow (all together about 30 s).
SLOW = all_but(CASES, "ddp4__call_site")

test_on_real_ranks = real_rank_test(CASES, WORLD, case_timeout=120.0, slow=SLOW)
