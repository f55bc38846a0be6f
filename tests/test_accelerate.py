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
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter
from tests._gather import gather_objects, model_gradient, shared_dir
from tests._trainer_checks import (
    BuiltOnce,
    Checks,
    SteppedLayout,
    all_but,
    as_launched_worker,
    every_rank_meshes,
    layout_case,
    local,
    local_copies,
)

accelerate = pytest.importorskip("accelerate", reason="Accelerate is not installed: pip install accelerate==1.15.0")

from tests._accelerate import ACCELERATE_VERSION, CP_ATTENTION_ON_CPU, Layout, build  # noqa: E402

WORLD = 4
# 2, 1 and inf, and what else Accelerate's clip (torch's on DTensors) accepts: any p, 0 (non-zeros), -inf.
# The -inf norm of these grads is 0 (the embedding rows of tokens not in the batch): checked exactly.
NORM_TYPES = (2.0, 1.0, math.inf, 3.0, 0.0, -math.inf)
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
class Stepped(SteppedLayout):
    """A layout after one step, built by Accelerate; its gradients are its model's."""

    accelerator: Any
    model: torch.nn.Module

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.model.named_parameters()}


def _step(name: str, grad_scale: float | None = None) -> Stepped:
    """Layout ``name`` built and stepped on this rank, the reference unscaled by ``grad_scale``."""
    built = build(LAYOUTS[name], grad_scale=grad_scale)
    grads = {n: p.grad for n, p in built.model.named_parameters()}
    meshes = every_rank_meshes(grads.values())
    assert meshes == GRAD_MESHES[name], meshes
    everyone = gather_objects(all(isinstance(g, DTensor) for g in grads.values()))
    assert all(everyone), f"a gradient is missing or not a DTensor after the step: {everyone}"
    reference = model_gradient(grads)
    if grad_scale is not None:
        reference = {n: g / grad_scale for n, g in reference.items()}
    return Stepped(reference, local_copies(grads), built.accelerator, built.model)


_stepped = BuiltOnce(_step)  # each layout built once, for all its cases


def ours(stepped: Stepped, checks: Checks) -> None:
    """``ppclip_func.accelerate.clip_grad_norm_(accelerator, ...)``: float64-exact, one collective."""
    from ppclip_func import accelerate as ppclip

    def ppclips(max_norm: float, p: float) -> torch.Tensor:
        return ppclip.clip_grad_norm_(stepped.accelerator, stepped.model.parameters(), max_norm, p)

    # The last call repeats the first, as the next step would: its options agreed on already, exactly one.
    for i, p in enumerate((*NORM_TYPES, NORM_TYPES[0])):
        again = i == len(NORM_TYPES)
        what = f"ours p={p}{', again' if again else ''}"
        total = checks.clip(what, stepped, ppclips, p, first_sight=not again)
        checks.that(
            not isinstance(total, DTensor) and total.dtype == torch.float64,
            f"{what}: returned {type(total).__name__} {total.dtype}, not a float64 tensor",
        )


def patched(stepped: Stepped, checks: Checks) -> None:
    """``accelerator.clip_grad_norm_`` after ``patch_accelerator``: Accelerate's call, our clip."""
    from accelerate import Accelerator

    from ppclip_func import accelerate as ppclip

    accelerator = stepped.accelerator
    assert ppclip.patch_accelerator(accelerator) is accelerator
    ppclip.patch_accelerator(accelerator)  # twice: still one clip
    assert Accelerator.clip_grad_norm_.__module__ == "accelerate.accelerator", "the class must stay Accelerate's"

    def as_a_trainer_calls(max_norm: float, p: float) -> torch.Tensor:
        norm_type = {} if p == 2.0 else {"norm_type": p}  # the default, 2, left out
        return accelerator.clip_grad_norm_(stepped.model.parameters(), max_norm, **norm_type)

    try:
        for p in (*NORM_TYPES, NORM_TYPES[0]):
            checks.clip(f"patched p={p}", stepped, as_a_trainer_calls, p, first_sight=True)
        # The next step's call: its options agreed on already, exactly one collective.
        checks.clip("patched p=2.0, again", stepped, as_a_trainer_calls, 2.0)
    finally:
        stepped.restore()
        del accelerator.clip_grad_norm_  # back to Accelerate's, for the next case


def accelerates_own(stepped: Stepped, checks: Checks) -> None:
    """Accelerate's ``accelerator.clip_grad_norm_`` on the same gradients: measured, right to float32 but for p=0."""
    accelerator = stepped.accelerator
    assert "clip_grad_norm_" not in vars(accelerator), "this case measures Accelerate's own clip"
    kinds = set()

    def accelerates(max_norm: float, p: float) -> torch.Tensor:
        return accelerator.clip_grad_norm_(stepped.model.parameters(), max_norm, norm_type=p)

    for p in NORM_TYPES:
        if p == 0:
            # torch's get_total_norm, which Accelerate calls, takes the 0-"norm" of the per-parameter norms:
            # the number of parameters with a non-zero gradient, not of non-zero elements; nothing is clipped.
            expected = stepped.expected(p)
            max_norm = expected / 2
            with CollectiveCounter() as c:
                total = accelerates(max_norm, p)
            checks.count(f"accelerate p={p}", c, expected=None)
            wrong = sum(1 for g in stepped.reference.values() if g.count_nonzero())
            checks.close(f"accelerate p={p} (the parameters with a non-zero gradient)", total, wrong, 0.0)
            checks.notes.append(f"Accelerate's p=0 norm is {float(total):g}, the non-zero elements are {expected:g}")
            unchanged = all(torch.equal(local(g), stepped.saved[n]) for n, g in stepped.grads().items())
            checks.that(unchanged, f"accelerate p=0: clipped by {float(total)} > max_norm {max_norm}")
            stepped.restore()
        else:
            total = checks.clip(f"accelerate p={p}", stepped, accelerates, p, collectives=None, rtol=ACCELERATE_RTOL)
        kinds.add(f"{type(total).__name__} {str(total.dtype).removeprefix('torch.')}")
    checks.notes.append(f"Accelerate returns {', '.join(sorted(kinds))}")


PARTS: tuple[Callable[[Stepped, Checks], None], ...] = (ours, patched, accelerates_own)


def fsdp2_tp2__fp16_grad_scaler(rank: int, world_size: int) -> None:
    """fp16's ``GradScaler``: the grads are unscaled before the norm, as Accelerate's clip does; a parameter subset."""
    from ppclip_func import accelerate as ppclip

    stepped = _stepped("fsdp2_tp2", GRAD_SCALE)
    accelerator, scaler = stepped.accelerator, stepped.accelerator.scaler
    checks = Checks("fsdp2_tp2__fp16_grad_scaler")
    params = list(stepped.model.parameters())
    subset = {n for n, _ in stepped.model.named_parameters() if not n.startswith("head")}

    def rescale() -> None:
        """The step's scaled grads back, and the scaler ready to unscale them again (its scale unchanged)."""
        stepped.restore()
        scaler.update()
        assert float(scaler.get_scale()) == GRAD_SCALE

    # The scaler's found-inf check all-reduces over the grads' mesh (DTensor's handler for its op): counted alone.
    with CollectiveCounter() as c:
        accelerator.unscale_gradients()
    n_scaler = c.count
    checks.notes.append(f"the scaler's unscale_ issues {n_scaler} collective(s): {c.ops}")
    rescale()
    for again in ("", " again"):
        checks.clip(
            f"ours+scaler{again}",
            stepped,
            lambda max_norm, _: ppclip.clip_grad_norm_(accelerator, params, max_norm),
            2.0,
            first_sight=not again,
            collectives=1 + n_scaler,
            scale=GRAD_SCALE,
        )
        rescale()
    checks.clip(
        "accelerate+scaler",
        stepped,
        lambda max_norm, _: accelerator.clip_grad_norm_(params, max_norm),
        2.0,
        collectives=None,
        rtol=ACCELERATE_RTOL,
        scale=GRAD_SCALE,
    )
    rescale()
    # Some of the parameters: ours unscales once and clips them.
    part = [p for n, p in stepped.model.named_parameters() if n in subset]
    expected_part = stepped.expected(2.0, lambda n: n in subset)
    total = ppclip.clip_grad_norm_(accelerator, part, expected_part / 2)
    checks.close("subset: ours", total, expected_part)
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
                local(g).mul_(factor)
        with CollectiveCounter() as c:
            stats = ppclip.adaptive_clip_grad_norm_(accelerator, stepped.model.parameters(), clip, **options)
        checks.close(f"adaptive step {step}", stats.total_norm, stepped.expected(2.0) * factor)
        checks.count(f"adaptive step {step}", c, first_sight=step == 0)
        stepped.restore()
    checks.that(int(clip.state.count) == 4, f"the state counted {int(clip.state.count)} norms, 4 expected")
    saved = [t.clone() for t in clip.state]
    with shared_dir("ppclip_accelerate_") as directory:
        accelerator.save_state(directory)
        ppclip.adaptive_clip_grad_norm_(accelerator, stepped.model.parameters(), clip, **options)  # one step more
        stepped.restore()
        assert int(clip.state.count) == 5
        accelerator.load_state(directory)
        restored = all(torch.equal(a, b) for a, b in zip(clip.state, saved))
        checks.that(restored, f"load_state restored {clip.state}, saved {saved}")
        checks.notes.append(f"state {[float(t) for t in clip.state]} saved and restored")
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

    as_launched_worker(rank, world_size)
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
    *(layout_case(globals(), layout, part, _stepped) for layout in LAYOUTS for part in PARTS),
    cpu_fsdp_plugin_runs_ddp,
    fsdp2_tp2__fp16_grad_scaler,
    hsdp2x2__adaptive_checkpoint,
    fsdp2_cp2__attention,
]
SKIP = {"fsdp2_cp2__attention": CP_ATTENTION_ON_CPU}

# make test-quick runs the DDP case alone on the ranks (about 3 s); the layouts are slow (about 7 s and up).
SLOW = all_but(CASES, "cpu_fsdp_plugin_runs_ddp")

test_on_real_ranks = real_rank_test(CASES, WORLD, case_timeout=60.0, skip=SKIP, slow=SLOW)
