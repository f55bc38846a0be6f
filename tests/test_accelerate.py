"""The clip in Hugging Face Accelerate 1.15: FSDP2 with its ``ParallelismConfig``, against float64 and Accelerate's own.

Four gloo ranks, started once for every case (``demo/harness.py`` through
``tests/_cases.py``). Each layout is built by Accelerate, as a training
script builds it (``tests/_accelerate.py``: ``ParallelismConfig``,
``Accelerator`` with an FSDP2 plugin, ``accelerator.prepare``,
``accelerator.backward``): ``dp_shard`` × ``tp`` (2 × 2), ``dp_replicate`` ×
``dp_shard`` (HSDP, 2 × 2) and ``dp_shard`` × ``cp`` (2 × 2). The reference
is the step's gradient gathered from every rank in float64
(``tests/_gather.py``), its norm taken the obvious way. For each layout:

* ``ours``: ``ppclip_func.accelerate.clip_grad_norm_(accelerator, ...)``;
* ``patched``: ``accelerator.clip_grad_norm_(...)`` after
  ``ppclip_func.accelerate.patch_accelerator(accelerator)``;
* ``accelerates_own``: Accelerate's ``accelerator.clip_grad_norm_`` on the
  same gradients, for every norm type it accepts: its norms, clipped
  gradients and collectives, measured and checked to float32 precision.

Ours: norms within 1e-6 relative of float64, clipped gradients the float64
reference scaled by the float64 clip coefficient within 1e-6, exactly one
collective on a call that repeats options already seen (the first may add
the one-time check that every rank passes the same, ``ppclip_func/_core/agreement.py``).
And on one layout each: fp16's ``GradScaler`` unscaled before the clip, as
Accelerate does (and where Accelerate's own clip raises); the adaptive
threshold's state through ``accelerator.save_state`` / ``load_state``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, steady_count
from tests._gather import gather_objects, model_gradient
from tests._reference import reference_coefficient, reference_norm

accelerate = pytest.importorskip("accelerate", reason="Accelerate is not installed: pip install accelerate==1.15.0")

from tests._accelerate import ACCELERATE_VERSION, CP_ATTENTION_ON_CPU, Layout, build  # noqa: E402

WORLD = 4
# 2, 1 and inf, and what else Accelerate's clip (torch's on DTensors) accepts: any p, 0 (non-zeros), -inf.
# The -inf norm of these grads is 0 (the embedding rows of tokens not in the batch): checked exactly.
NORM_TYPES = (2.0, 1.0, math.inf, 3.0, 0.0, -math.inf)
RTOL = 1e-6
# Accelerate's norm is float32 throughout: agreeing with float64 this closely rules out a layout read
# wrongly (a shard or a replica counted twice or not at all), not float32 rounding.
ACCELERATE_RTOL = 1e-5
GRAD_SCALE = 2.0**10  # a power of two: scaling and unscaling are exact

LAYOUTS = {
    "fsdp2_tp2": Layout(dp_shard=2, tp=2),
    "hsdp2x2": Layout(dp_replicate=2, dp_shard=2),
    "fsdp2_cp2": Layout(dp_shard=2, cp=2),
}
# The meshes each layout's gradients live on: the layouts are what they claim to be.
GRAD_MESHES = {
    "fsdp2_tp2": {("dp_shard_cp", "tp")},
    "hsdp2x2": {("dp_replicate", "dp_shard_cp")},
    "fsdp2_cp2": {("dp_shard_cp",)},
}


def test_the_accelerate_these_tests_pin_is_the_one_the_trainers_extra_installs() -> None:
    """The tests are written against ACCELERATE_VERSION: pyproject.toml installs it; another one is named as a skip."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    pins = re.findall(r'"accelerate([^"]*)"', pyproject)  # the trainers extra's one requirement
    assert pins == [f"=={ACCELERATE_VERSION}"], pins
    if accelerate.__version__ != ACCELERATE_VERSION:
        pytest.skip(f"Accelerate {accelerate.__version__} is installed; these tests pin {ACCELERATE_VERSION}")


# ---------------------------------------------------------------------------------------------
# One process: what is refused, and the import without Accelerate
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["DEEPSPEED", "MEGATRON_LM", "XLA"])
def test_refuses_engines_that_clip_themselves(kind: str) -> None:
    from accelerate.utils import DistributedType

    from ppclip_func import accelerate as ppclip

    accelerator = types.SimpleNamespace(distributed_type=DistributedType(kind), is_fsdp2=False, torch_device_mesh=None)
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.full((2,), 3.0)
    with pytest.raises(ValueError, match=kind):
        ppclip.clip_grad_norm_(accelerator, [w], 1.0)
    with pytest.raises(ValueError, match=kind):
        ppclip.patch_accelerator(accelerator)
    assert torch.equal(w.grad, torch.full((2,), 3.0))


def test_refuses_fsdp1() -> None:
    from accelerate.utils import DistributedType

    from ppclip_func import accelerate as ppclip

    accelerator = types.SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False, torch_device_mesh=None)
    with pytest.raises(ValueError, match="FSDP2"):
        ppclip.clip_grad_norm_(accelerator, [], 1.0)


def test_adaptive_needs_a_clip_stateful() -> None:
    from accelerate import Accelerator

    from ppclip_func import accelerate as ppclip
    from ppclip_func import init_clip_state

    with pytest.raises(TypeError, match="ClipStateful"):
        ppclip.adaptive_clip_grad_norm_(Accelerator(cpu=True), [], init_clip_state())


def test_imports_without_accelerate() -> None:
    """``ppclip_func.accelerate`` imports nothing of Accelerate until it is called."""
    import subprocess

    code = "import sys; sys.modules['accelerate'] = None; import ppclip_func.accelerate; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------------------
# On 4 ranks: one build and one step per layout, shared by its cases
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stepped:
    """A layout after one step, with its float64 reference; ``restore()`` undoes an in-place clip."""

    accelerator: Any
    model: torch.nn.Module
    reference: dict[str, torch.Tensor]  # the whole model's gradient in float64, by parameter name
    saved: dict[str, torch.Tensor]  # this rank's local gradients as the step left them

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.model.named_parameters()}

    def expected(self, norm_type: float, names: Callable[[str], bool] = lambda n: True) -> float:
        return reference_norm([g for n, g in self.reference.items() if names(n)], norm_type)

    def restore(self) -> None:
        with torch.no_grad():
            for name, g in self.grads().items():
                _local(g).copy_(self.saved[name])


_STEPPED: dict[str, Stepped | BaseException] = {}


def _stepped(name: str, grad_scale: float | None = None) -> Stepped:
    """Layout ``name`` built and stepped on this rank (once; one layout held at a time)."""
    key = f"{name}/{grad_scale}"
    if key not in _STEPPED:
        _STEPPED.clear()
        try:
            built = build(LAYOUTS[name], grad_scale=grad_scale)
            grads = {n: p.grad for n, p in built.model.named_parameters()}
            meshes = {g.device_mesh.mesh_dim_names for g in grads.values() if isinstance(g, DTensor)}
            everyone = gather_objects((meshes, all(isinstance(g, DTensor) for g in grads.values())))
            assert set().union(*(m for m, _ in everyone)) == GRAD_MESHES[name], everyone
            assert all(every for _, every in everyone), "a gradient is missing or not a DTensor after the step"
            saved = {n: _local(g).detach().clone() for n, g in grads.items()}
            reference = model_gradient(grads)
            if grad_scale is not None:
                reference = {n: g / grad_scale for n, g in reference.items()}
            _STEPPED[key] = Stepped(built.accelerator, built.model, reference, saved)
        except BaseException as e:
            _STEPPED[key] = e
            raise
    stepped = _STEPPED[key]
    if isinstance(stepped, BaseException):
        raise RuntimeError(f"building {name} failed in an earlier case") from stepped
    return stepped


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Checks:
    """Collects failed checks so that every rank reaches the same collectives; keeps what was measured."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.failures: list[str] = []
        self.worst: dict[str, float] = {}
        self.collectives: dict[str, set[int]] = {}
        self.notes: list[str] = []

    def norm(self, what: str, actual: torch.Tensor, expected: float, rtol: float = RTOL) -> None:
        """``actual`` is the float64 norm ``expected`` within ``rtol``, and a plain tensor if it is ours."""
        value = float(actual.full_tensor() if isinstance(actual, DTensor) else actual)
        err = abs(value - expected) / expected if expected else (0.0 if value == 0.0 else math.inf)
        self.worst[what.split(" ")[0]] = max(self.worst.get(what.split(" ")[0], 0.0), err)
        if not err <= rtol:
            self.failures.append(f"{what}: {value!r}, expected {expected!r} (relative error {err:.3g} > {rtol:g})")

    def count(self, what: str, counter: CollectiveCounter, expected: int | None = 1, first_sight: bool = False) -> None:
        """``counter`` saw ``expected`` collectives (any number if ``None``); see test_torchtitan's ``Checks``."""
        n = steady_count(counter) if first_sight else counter.count
        self.collectives.setdefault(what.split(" ")[0], set()).add(n)
        if expected is not None and n != expected:
            self.failures.append(f"{what}: {n} collectives, {expected} expected: {counter.ops}")

    def clipped(self, what: str, stepped: Stepped, coefficient: float, rtol: float = RTOL, scale: float = 1.0) -> None:
        """Every local gradient is the step's gradient (divided by ``scale``) times ``coefficient``."""
        assert coefficient < 1.0, "the clip must scale for this check to mean anything"  # 0 for a norm of 0
        worst = 0.0
        for name, g in stepped.grads().items():
            want = stepped.saved[name].double() / scale * coefficient
            got = _local(g).double()
            err = float(((got - want).abs() / want.abs()).nan_to_num(0.0).max()) if want.numel() else 0.0
            worst = max(worst, err)
        self.worst[f"{what.split(' ')[0]} grads"] = max(self.worst.get(f"{what.split(' ')[0]} grads", 0.0), worst)
        if not worst <= rtol:
            self.failures.append(f"{what}: the clipped grads are not the reference scaled (relative error {worst:.3g})")

    def done(self) -> None:
        if dist.get_rank() == 0:
            errors = ", ".join(f"{k} {v:.2e}" for k, v in self.worst.items())
            counts = ", ".join(f"{k} {sorted(v)}" for k, v in self.collectives.items())
            notes = "".join(f"; {n}" for n in self.notes)
            print(f"[{self.where}] max rel. error vs float64: {errors}; collectives: {counts}{notes}", flush=True)
        if self.failures:
            raise AssertionError(f"{self.where}: {len(self.failures)} failed check(s):\n" + "\n".join(self.failures))


def ours(stepped: Stepped, checks: Checks) -> None:
    """``ppclip_func.accelerate.clip_grad_norm_(accelerator, ...)``: float64-exact, one collective."""
    from ppclip_func import accelerate as ppclip

    # The last call repeats the first, as the next step would: its options agreed on already, exactly one.
    for i, p in enumerate((*NORM_TYPES, NORM_TYPES[0])):
        again = i == len(NORM_TYPES)
        what = f"ours p={p}{', again' if again else ''}"
        expected = stepped.expected(p)
        max_norm = expected / 2  # the clip always scales
        with CollectiveCounter() as c:
            total = ppclip.clip_grad_norm_(stepped.accelerator, stepped.model.parameters(), max_norm, p)
        if isinstance(total, DTensor) or total.dtype != torch.float64:
            checks.failures.append(f"{what}: returned {type(total).__name__} {total.dtype}, not a float64 tensor")
        checks.norm(what, total, expected)
        checks.count(what, c, first_sight=not again)
        checks.clipped(what, stepped, reference_coefficient(expected, max_norm))
        stepped.restore()


def patched(stepped: Stepped, checks: Checks) -> None:
    """``accelerator.clip_grad_norm_`` after ``patch_accelerator``: Accelerate's call, our clip."""
    from accelerate import Accelerator

    from ppclip_func import accelerate as ppclip

    accelerator = stepped.accelerator
    assert ppclip.patch_accelerator(accelerator) is accelerator
    ppclip.patch_accelerator(accelerator)  # twice: still one clip
    assert Accelerator.clip_grad_norm_.__module__ == "accelerate.accelerator", "the class must stay Accelerate's"
    try:
        for p in (*NORM_TYPES, NORM_TYPES[0]):
            expected = stepped.expected(p)
            max_norm = expected / 2
            norm_type = {} if p == 2.0 else {"norm_type": p}  # as a trainer calls it: the default, 2
            with CollectiveCounter() as c:
                total = accelerator.clip_grad_norm_(stepped.model.parameters(), max_norm, **norm_type)
            checks.norm(f"patched p={p}", total, expected)
            checks.count(f"patched p={p}", c, first_sight=True)
            checks.clipped(f"patched p={p}", stepped, reference_coefficient(expected, max_norm))
            stepped.restore()
        # The next step's call: its options agreed on already, exactly one collective.
        with CollectiveCounter() as c:
            total = accelerator.clip_grad_norm_(stepped.model.parameters(), stepped.expected(2.0) / 2)
        checks.norm("patched p=2.0, again", total, stepped.expected(2.0))
        checks.count("patched p=2.0, again", c)
    finally:
        stepped.restore()
        del accelerator.clip_grad_norm_  # back to Accelerate's, for the next case


def accelerates_own(stepped: Stepped, checks: Checks) -> None:
    """Accelerate's ``accelerator.clip_grad_norm_`` on the same gradients: measured, right to float32 but for p=0."""
    accelerator = stepped.accelerator
    assert "clip_grad_norm_" not in vars(accelerator), "this case measures Accelerate's own clip"
    kinds = set()
    for p in NORM_TYPES:
        expected = stepped.expected(p)
        max_norm = expected / 2
        with CollectiveCounter() as c:
            total = accelerator.clip_grad_norm_(stepped.model.parameters(), max_norm, norm_type=p)
        kinds.add(f"{type(total).__name__} {str(total.dtype).removeprefix('torch.')}")
        checks.count(f"accelerate p={p}", c, expected=None)
        if p == 0:
            # torch's get_total_norm, which Accelerate calls, takes the 0-"norm" of the per-parameter norms:
            # the number of parameters with a non-zero gradient, not of non-zero elements; nothing is clipped.
            wrong = sum(1 for g in stepped.reference.values() if g.count_nonzero())
            checks.norm(f"accelerate p={p} (the parameters with a non-zero gradient)", total, wrong, 0.0)
            checks.notes.append(f"Accelerate's p=0 norm is {float(total):g}, the non-zero elements are {expected:g}")
            unchanged = all(torch.equal(_local(g), stepped.saved[n]) for n, g in stepped.grads().items())
            if not unchanged:
                checks.failures.append(f"accelerate p=0: clipped by {float(total)} > max_norm {max_norm}")
        else:
            checks.norm(f"accelerate p={p}", total, expected, ACCELERATE_RTOL)
            checks.clipped(f"accelerate p={p}", stepped, reference_coefficient(expected, max_norm), ACCELERATE_RTOL)
        stepped.restore()
    checks.notes.append(f"Accelerate returns {', '.join(sorted(kinds))}")


PARTS = (ours, patched, accelerates_own)


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


def fsdp2_tp2__fp16_grad_scaler(rank: int, world_size: int) -> None:
    """fp16's ``GradScaler``: the grads are unscaled before the norm, as Accelerate's clip does; a parameter subset."""
    from ppclip_func import accelerate as ppclip

    stepped = _stepped("fsdp2_tp2", grad_scale=GRAD_SCALE)
    accelerator, scaler = stepped.accelerator, stepped.accelerator.scaler
    checks = Checks("fsdp2_tp2__fp16_grad_scaler")
    params = list(stepped.model.parameters())
    subset = {n for n, _ in stepped.model.named_parameters() if not n.startswith("head")}

    def rescale() -> None:
        """The step's scaled grads back, and the scaler ready to unscale them again (its scale unchanged)."""
        stepped.restore()
        scaler.update()
        assert float(scaler.get_scale()) == GRAD_SCALE

    expected = stepped.expected(2.0)
    max_norm = expected / 2
    # The scaler's found-inf check all-reduces over the grads' mesh (DTensor's handler for its op): counted alone.
    with CollectiveCounter() as c:
        accelerator.unscale_gradients()
    n_scaler = c.count
    checks.notes.append(f"the scaler's unscale_ issues {n_scaler} collective(s): {c.ops}")
    rescale()
    for again in ("", " again"):
        with CollectiveCounter() as c:
            total = ppclip.clip_grad_norm_(accelerator, params, max_norm)
        checks.norm(f"ours{again}", total, expected)
        checks.count(f"ours+scaler{again}", c, expected=1 + n_scaler, first_sight=not again)
        checks.clipped(f"ours{again}", stepped, reference_coefficient(expected, max_norm), scale=GRAD_SCALE)
        rescale()
    with CollectiveCounter() as c:
        total = accelerator.clip_grad_norm_(params, max_norm)
    checks.norm("accelerate", total, expected, ACCELERATE_RTOL)
    checks.count("accelerate+scaler", c, expected=None)
    checks.clipped("accelerate", stepped, reference_coefficient(expected, max_norm), ACCELERATE_RTOL, GRAD_SCALE)
    rescale()
    # Some of the parameters: ours unscales once and clips them.
    part = [p for n, p in stepped.model.named_parameters() if n in subset]
    expected_part = stepped.expected(2.0, lambda n: n in subset)
    total = ppclip.clip_grad_norm_(accelerator, part, expected_part / 2)
    checks.norm("subset: ours", total, expected_part)
    rescale()
    # Accelerate's unscales, finds the parameters are not the model's, and unscales again: GradScaler raises.
    try:
        accelerator.clip_grad_norm_(part, expected_part / 2)
        checks.notes.append("Accelerate's clip of a parameter subset with a GradScaler ran")
    except RuntimeError as e:
        assert "unscale_() has already been called" in str(e), e
        checks.notes.append(f"Accelerate's clip of a parameter subset with a GradScaler raises: {e}")
    rescale()
    checks.done()


def hsdp2x2__adaptive_checkpoint(rank: int, world_size: int) -> None:
    """The adaptive threshold's ``ClipStateful`` through ``accelerator.save_state`` / ``load_state``."""
    from ppclip_func import ClipStateful
    from ppclip_func import accelerate as ppclip

    stepped = _stepped("hsdp2x2")
    accelerator = stepped.accelerator
    checks = Checks("hsdp2x2__adaptive_checkpoint")
    clip = ClipStateful(device=accelerator.device)
    accelerator.register_for_checkpointing(clip)
    options = {"max_norm": None, "warmup": 2, "z": 2.5}
    for step in range(4):
        factor = 1.0 + 0.25 * step  # norms that move, so the statistics do
        with torch.no_grad():
            for g in stepped.grads().values():
                _local(g).mul_(factor)
        with CollectiveCounter() as c:
            stats = ppclip.adaptive_clip_grad_norm_(accelerator, stepped.model.parameters(), clip, **options)
        checks.norm(f"adaptive step {step}", stats.total_norm, stepped.expected(2.0) * factor)
        checks.count(f"adaptive step {step}", c, first_sight=step == 0)
        stepped.restore()
    if int(clip.state.count) != 4:
        checks.failures.append(f"the state counted {int(clip.state.count)} norms, 4 expected")
    saved = [t.clone() for t in clip.state]
    directory = gather_objects(tempfile.mkdtemp(prefix="ppclip_accelerate_") if rank == 0 else None)[0]
    try:
        accelerator.save_state(directory)
        ppclip.adaptive_clip_grad_norm_(accelerator, stepped.model.parameters(), clip, **options)  # one step more
        stepped.restore()
        assert int(clip.state.count) == 5
        accelerator.load_state(directory)
        if not all(torch.equal(a, b) for a, b in zip(clip.state, saved)):
            checks.failures.append(f"load_state restored {clip.state}, saved {saved}")
        checks.notes.append(f"state {[float(t) for t in clip.state]} saved and restored")
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    checks.done()


def fsdp2_cp2__attention(rank: int, world_size: int) -> None:
    """Context parallelism with the model's attention (skipped on CPU: ``CP_ATTENTION_ON_CPU``)."""
    built = build(LAYOUTS["fsdp2_cp2"], attention=True)
    reference = model_gradient({n: p.grad for n, p in built.model.named_parameters()})
    assert reference


def cpu_fsdp_plugin_runs_ddp(rank: int, world_size: int) -> None:
    """The docs' form on CPU ranks, ``Accelerator(cpu=True, fsdp_plugin=...)``, runs DDP, as docs/accelerate.md says:
    nothing is sharded, and our clip is torch's norm of the whole gradient with no collective."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    from ppclip_func import accelerate as ppclip

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    ppclip.patch_accelerator(accelerator)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU and not accelerator.is_fsdp2
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(8, 4))
    assert type(model).__name__ == "DistributedDataParallel"
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    accelerator.backward(model(torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))).square().sum())
    grads = [p.grad.detach().double().clone() for p in model.parameters()]
    with CollectiveCounter() as counter:
        norm = accelerator.clip_grad_norm_(model.parameters(), 1e-3)
    assert counter.count == 0, counter.ops
    expected = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    assert abs(float(norm) - expected) <= 1e-6 * expected, (float(norm), expected)
    assert len(set(gather_objects(float(norm)))) == 1  # DDP averaged the grads: whole and alike on every rank


CASES = [
    *(_case(layout, part) for layout in LAYOUTS for part in PARTS),
    cpu_fsdp_plugin_runs_ddp,
    fsdp2_tp2__fp16_grad_scaler,
    hsdp2x2__adaptive_checkpoint,
    fsdp2_cp2__attention,
]
SKIP = {"fsdp2_cp2__attention": CP_ATTENTION_ON_CPU}

test_on_real_ranks = real_rank_test(CASES, WORLD, case_timeout=60.0, skip=SKIP)
