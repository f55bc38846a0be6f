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
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests._olmo_core import DIST_NAME, OLMO_CORE_VERSION, Built, Layout, build, skip_reason

if (_reason := skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from ppclip_func.olmo_core import STATE_KEY, PPClipMixin, clip_grad_norm_, use_ppclip
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, steady_count
from tests._gather import cast_grads, gather_objects, model_gradient
from tests._reference import reference_coefficient, reference_norm

WORLD = 4
NORM_TYPES = (2.0, 1.0, math.inf, -math.inf)
RTOL = 1e-6
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
class Stepped:
    """A layout after one step, with its float64 reference; ``restore()`` undoes an in-place clip."""

    built: Built
    model: dict[str, torch.Tensor]  # the whole model's gradient in float64, by parameter name
    saved: dict[str, torch.Tensor]  # this rank's local gradients as the step left them
    stage_names: list[set[str]]  # the parameter names of each pipeline stage ([all names] without a pipeline)

    @property
    def module(self) -> Any:
        return self.built.module

    def grads(self) -> dict[str, torch.Tensor | None]:
        return self.built.named_grads()

    def restore(self) -> None:
        with torch.no_grad():
            for name, p in self._params().items():
                p.grad = self._original[name]
                _local(p.grad).copy_(self.saved[name])

    def _params(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for m in self.built.model_parts for n, p in m.named_parameters()}

    def __post_init__(self) -> None:
        self._original = {n: p.grad for n, p in self._params().items()}


_STEPPED: dict[str, Stepped | BaseException] = {}


def _stepped(name: str) -> Stepped:
    """Layout ``name`` built and stepped on this rank (once: its cases share it; one layout held at a time)."""
    if name not in _STEPPED:
        _STEPPED.clear()
        try:
            built = build(LAYOUTS[name])
            grads = built.named_grads()
            assert all(g is not None for g in grads.values()), "a parameter has no gradient after the step"
            mesh = built.module.world_mesh
            stage = mesh.get_local_rank("pp") if "pp" in (mesh.mesh_dim_names or ()) else 0
            everyone = gather_objects((stage, sorted(grads)))
            stages: dict[int, set[str]] = {}
            for s, names in everyone:
                stages.setdefault(s, set()).update(names)
            saved = {n: _local(g).detach().clone() for n, g in grads.items()}
            _STEPPED[name] = Stepped(built, model_gradient(grads), saved, [stages[s] for s in sorted(stages)])
        except BaseException as e:
            _STEPPED[name] = e
            raise
    stepped = _STEPPED[name]
    if isinstance(stepped, BaseException):
        raise RuntimeError(f"building {name} failed in an earlier case") from stepped
    return stepped


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------------------------
# The checks: collectives on every rank first, assertions at the end
# ---------------------------------------------------------------------------------------------


class Checks:
    """Collects failed checks so that every rank reaches the same collectives; prints what was measured."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.failures: list[str] = []
        self.worst: dict[str, float] = {}
        self.collectives: dict[str, set[int]] = {}

    def close(self, what: str, actual: torch.Tensor | float, expected: float, rtol: float, kind: str) -> None:
        """``actual`` is ``expected`` within ``rtol``; the worst error is kept under ``kind``."""
        if expected == 0:  # a -inf norm where some element is 0 (an embedding row no token used)
            err = 0.0 if float(actual) == 0 else math.inf
        else:
            err = abs(float(actual) - expected) / abs(expected)
        self.worst[kind] = max(self.worst.get(kind, 0.0), err)
        if not err <= rtol:
            self.failures.append(f"{what}: {float(actual)!r}, expected {expected!r} (relative error {err:.3g})")

    def count(self, what: str, counter: CollectiveCounter, expected: int | None = 1, first_sight: bool = True) -> None:
        """``counter`` saw ``expected`` collectives (any number if ``None``; the one-time agreement gather of
        a first call with its options is not counted when ``first_sight``)."""
        n = steady_count(counter) if first_sight else counter.count
        self.collectives.setdefault(what, set()).add(n)
        if expected is not None and n != expected:
            self.failures.append(f"{what}: {n} collectives, {expected} expected: {counter.ops}")

    def clipped(
        self, what: str, stepped: Stepped, coefficient: float, saved: dict[str, torch.Tensor], rtol: float = RTOL
    ) -> None:
        """Every local gradient is ``saved`` times the float64 ``coefficient``, within ``rtol``."""
        for name, g in stepped.grads().items():
            want = saved[name].double() * coefficient
            got = _local(g).double()
            err = float(((got - want).abs() / want.abs()).nan_to_num(0.0).max()) if want.numel() else 0.0
            kind = f"clipped {saved[name].dtype}".replace("torch.", "")
            self.worst[kind] = max(self.worst.get(kind, 0.0), err)
            if not err <= rtol:
                self.failures.append(f"{what}: {name} is not the reference scaled (relative error {err:.3g})")

    def done(self) -> None:
        if dist.get_rank() == 0:
            worst = ", ".join(f"{k} {v:.2e}" for k, v in self.worst.items())
            counts = ", ".join(f"{k}: {sorted(v)}" for k, v in self.collectives.items())
            print(f"[{self.where}] max rel. error: {worst}; collectives: {counts}", flush=True)
        if self.failures:
            raise AssertionError(f"{self.where}: {len(self.failures)} failed check(s):\n" + "\n".join(self.failures))


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
    saved = {n: _local(g).detach().clone() for n, g in stepped.grads().items()}

    def put_back() -> None:
        with torch.no_grad():
            for n, g in stepped.grads().items():
                _local(g).copy_(saved[n])

    for p in NORM_TYPES:
        expected = reference_norm(model.values(), p)
        max_norm = expected / 2  # the clip always scales
        with CollectiveCounter() as c:
            ours = clip_grad_norm_(stepped.module, max_norm, p)
        checks.close(f"ours {tag} p={p}", ours, expected, RTOL, f"ours {tag}")
        checks.count(f"ours {tag} p={p}", c)
        coefficient = reference_coefficient(expected, max_norm)
        checks.clipped(f"ours {tag} p={p}", stepped, coefficient, saved, grad_rtol)
        put_back()
        with CollectiveCounter() as c:
            theirs = stepped.built.olmo_class._clip_grad_norm(stepped.module, max_norm, p)
        put_back()
        checks.count(f"OLMo-core {tag} p={p}", c, expected=None, first_sight=False)
        what = _olmo_expected(stepped, model, p)
        checks.close(f"OLMo-core's _clip_grad_norm {tag} p={p}", theirs, what, olmo_rtol, f"OLMo-core {tag}")
        if what != expected:  # its -inf in a pipeline: wrong, and by more than its precision
            checks.close(f"OLMo-core {tag} p={p} vs float64", theirs, expected, math.inf, f"OLMo-core {tag} wrong")
            if abs(float(theirs) - expected) <= olmo_rtol * expected:
                checks.failures.append(f"OLMo-core {tag} p={p}: {float(theirs)} is the model's norm {expected}")
    # The next step: the same call, its options agreed on already: exactly one collective.
    expected = reference_norm(model.values(), 2.0)
    with CollectiveCounter() as c:
        ours = clip_grad_norm_(stepped.module, expected / 2)
    checks.close(f"ours {tag} p=2, again", ours, expected, RTOL, f"ours {tag}")
    checks.count(f"ours {tag} p=2, again", c, first_sight=False)
    put_back()


def drop_in(stepped: Stepped, checks: Checks) -> None:
    """``clip_grad_norm_(train_module, ...)`` and OLMo-core's ``_clip_grad_norm`` on fp32, then bf16, gradients."""
    _compare(stepped, checks, stepped.model, "fp32", OLMO_RTOL, RTOL)
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
    expected = reference_norm(stepped.model.values(), 2.0)
    module.max_grad_norm = expected / 2
    params = {n: p for m in stepped.built.model_parts for n, p in m.named_parameters()}
    before = {n: _local(p).detach().clone() for n, p in params.items()}
    with CollectiveCounter() as c:
        module.optim_step()
    logged = stepped.built.trainer.metrics["optim/total grad norm"]
    checks.close("optim/total grad norm", logged, expected, RTOL, "logged norm")
    checks.count("optim_step", c)
    checks.clipped("optim_step", stepped, reference_coefficient(expected, expected / 2), stepped.saved)
    for optim in stepped.built.optimizers():
        if optim.latest_grad_norm is not logged:
            checks.failures.append(f"{type(optim).__name__}.latest_grad_norm is not the norm optim_step logged")
    if not any(not torch.equal(_local(p), before[n]) for n, p in params.items()):
        checks.failures.append("optim_step did not update the parameters")
    with torch.no_grad():
        for n, p in params.items():
            _local(p).copy_(before[n])
    stepped.restore()


def adaptive_checkpoint(stepped: Stepped, checks: Checks) -> None:
    """The adaptive threshold through ``_clip_grad_norm``; its statistics through OLMo-core's checkpoint."""
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata, load_state_dict, save_state_dict

    module = use_ppclip(stepped.module, adaptive={"warmup": 2})
    expected = reference_norm(stepped.model.values(), 2.0)
    for step in range(3):
        with CollectiveCounter() as c:
            norm = module._clip_grad_norm(expected / 2)
        checks.close(f"adaptive step {step}", norm, expected, RTOL, "adaptive norm")
        checks.count(f"adaptive step {step}", c, first_sight=step == 0)
        stepped.restore()
    want = module.ppclip_state.state_dict()
    if int(want["count"]) != 3:
        checks.failures.append(f"the statistics counted {int(want['count'])} norms, not 3")
    path = gather_objects(tempfile.mkdtemp(prefix="ppclip_olmo_") if dist.get_rank() == 0 else None)[0]
    try:
        save_state_dict(path, module.state_dict_to_save(), save_overwrite=True)
        metadata = get_checkpoint_metadata(path)
        if not any(k.startswith(f"{STATE_KEY}.") for k in metadata.state_dict_metadata):
            checks.failures.append(f"the checkpoint has no {STATE_KEY}.* keys")
        module.__dict__.pop("_ppclip_state")  # a restarted run: fresh statistics, then the checkpoint loaded
        state_dict = module.state_dict_to_load(metadata)
        load_state_dict(path, state_dict)
        module.load_state_dict(state_dict)
        got = module.ppclip_state.state_dict()
        if not all(torch.equal(got[k], want[k]) for k in want):
            checks.failures.append(f"statistics after the checkpoint {got} differ from before it {want}")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        use_ppclip(module)  # back to the fixed threshold
        stepped.restore()


def _case(layout: str, part: Callable[[Stepped, Checks], None]) -> Callable[[int, int], None]:
    """The module-level case ``{layout}__{part}`` (pickled by name into the ranks)."""
    name = f"{layout}__{part.__name__}"

    def case(rank: int, world_size: int) -> None:
        stepped = _stepped(layout)
        checks = Checks(name)
        try:
            part(stepped, checks)
        finally:
            stepped.restore()
        checks.done()

    case.__name__ = case.__qualname__ = name
    globals()[name] = case
    return case


CASES = [
    _case(layout, part)
    for layout in LAYOUTS
    for part in (drop_in, call_site, *((adaptive_checkpoint,) if layout in ADAPTIVE_LAYOUTS else ()))
]

test_on_real_ranks = real_rank_test(CASES, WORLD, case_timeout=120.0)
