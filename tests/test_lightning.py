"""The clip in PyTorch Lightning's ``Trainer`` under its ``ModelParallelStrategy``, against float64 and Lightning's own.

Four gloo ranks, started once for every case (``demo/harness.py`` through
``tests/_cases.py``). The ranks look to Lightning like ``torchrun``'s workers
(the torchelastic environment variables), so a real ``Trainer(strategy=
ModelParallelStrategy(...), accelerator="cpu", devices=4)`` uses the process
group already there, builds its ``("data_parallel", "tensor_parallel")``
mesh and calls the module's ``configure_model``, which applies
``parallelize_module`` and ``fully_shard`` (FSDP2) as Lightning's examples
do. ``Trainer.fit`` runs four steps; Lightning calls ``clip_gradients``
through its default ``configure_gradient_clipping``, where the test module
looks at the gradients on the way through (``Probe``):

* the whole model's gradient is gathered in float64 (``tests/_gather.py``);
* Lightning's own clip runs on those gradients first (``LightningModule.clip_gradients``
  unpatched, which is ``torch.nn.utils.clip_grad_norm_`` over the optimizer's
  parameters, norm type 2; for 1 and inf, which Lightning does not offer, the
  same torch call with ``norm_type``), counted, its norm or its error kept,
  and the gradients put back;
* then ours (``ppclip_func.lightning.ClipGradNormMixin``), counted.

The steps use norm types 2, 1, inf and 2 again (the steady state: exactly one
collective; the earlier calls may add the one-time agreement gather). After
the fit: our norms are within 1e-6 of float64, the clipped gradients are the
step's gradients times the float64 coefficient within 1e-6, the logged
``grad_norm`` is the last norm, and Lightning's clip either raises (mixed
meshes) or agrees with float64 within its float32 precision, as each layout
says; torch's inf norm raises on exactly the ranks that hold an empty FSDP2
shard (only its first, local op is run there: the other ranks would wait in
its all-reduce), and ``pytorch_lightning.utilities.grad_norm`` raises on
these DTensor gradients. ``adaptive_checkpoint`` runs ``AdaptiveClipGradNormMixin``, saves a
Lightning checkpoint (a distributed one, as the strategy writes by default)
and resumes from it in a new ``Trainer``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter, steady_count
from tests._gather import gather_objects, model_gradient, shared_dir
from tests._reference import reference_coefficient, reference_norm
from tests._trainer_checks import (
    LIGHTNING_QUIET,
    RTOL,
    all_but,
    as_launched_worker,
    dtensor_meshes,
    local,
    local_copies,
    max_rel_error,
    put_back,
)

pl = pytest.importorskip(
    "pytorch_lightning", reason="pytorch_lightning is not installed (pip install pytorch-lightning)"
)

from lightning_fabric.utilities.load import _METADATA_FILENAME  # noqa: E402

from ppclip_func.lightning import CHECKPOINT_KEY, AdaptiveClipGradNormMixin, ClipGradNormMixin  # noqa: E402

WORLD = 4
# torch's clip is float32 throughout: within this of float64 on these small models it has read the
# layouts right (a replica counted twice or a shard left out is off by far more).
LIGHTNING_RTOL = 1e-5
STEP_NORM_TYPES = (2.0, 1.0, math.inf, 2.0)  # the last step repeats the first: exactly one collective
CLIP_VAL = 1e-3  # below every norm here (checked), so every clip scales
D, H, T, OUT, BATCH = 8, 16, 4, 2, 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """A ``ModelParallelStrategy`` layout and the modules the user's ``configure_model`` gives to tensor parallelism.

    ``lightning_raises``: Lightning's clip is expected to raise here (its
    parameters sit on more than one mesh), else to give the right norm.
    """

    dp: int
    tp: int
    tp_everything: bool
    lightning_raises: bool
    grad_meshes: frozenset[tuple[str, ...]]


LAYOUTS = {
    # Lightning's examples' style, with the norm and the head left to FSDP alone: two meshes.
    "dp2_tp2_mixed": Layout(2, 2, False, True, frozenset({("data_parallel", "tensor_parallel"), ("data_parallel",)})),
    # Every module tensor-parallel (sequence-parallel norm): one 2-D mesh.
    "dp2_tp2": Layout(2, 2, True, False, frozenset({("data_parallel", "tensor_parallel")})),
    # FSDP2 over every rank, no tensor parallelism.
    "dp4": Layout(4, 1, False, False, frozenset({("data_parallel",)})),
}


# ---------------------------------------------------------------------------------------------
# The model, as a Lightning user writes it
# ---------------------------------------------------------------------------------------------


class Body(pl.LightningModule):
    """A small MLP block with a norm and a head; ``configure_model`` parallelizes it over ``self.device_mesh``."""

    def __init__(self, tp_everything: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tp_everything = tp_everything
        self.w1 = torch.nn.Linear(D, H)
        self.w2 = torch.nn.Linear(H, D)
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, OUT)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp_mesh.size() > 1:
            plan: dict[str, Any] = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
            if self.tp_everything:
                plan["w2"] = RowwiseParallel(output_layouts=Shard(1))
                plan["norm"] = SequenceParallel()
                plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
            parallelize_module(self, tp_mesh, plan)
        fully_shard(self, mesh=dp_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.w2(torch.relu(self.w1(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _as_float(t: torch.Tensor) -> float:
    return float(t.full_tensor() if isinstance(t, DTensor) else t)


# ---------------------------------------------------------------------------------------------
# What the test module looks at in each clip
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """One clip: the float64 reference, ours and Lightning's."""

    p: float
    expected: float
    max_norm: float
    ours: float = math.nan
    ours_ops: list[str] = dataclasses.field(default_factory=list)
    clipped_err: float = math.nan
    lightning: float | None = None
    lightning_error: str | None = None
    lightning_ops: list[str] = dataclasses.field(default_factory=list)
    lightning_error_ranks: list[int] = dataclasses.field(default_factory=list)
    empty_shard_ranks: list[int] = dataclasses.field(default_factory=list)
    lightning_error_seen: str | None = None  # the first rank's error, for the summary


class Probe:
    """Put before the mixin: gathers the reference, runs Lightning's clip, then ours, on the same gradients."""

    compare_lightning: ClassVar[bool] = True
    norm_types: ClassVar[tuple[float, ...]] = STEP_NORM_TYPES  # by global step, cycling

    def setup_probe(self) -> None:
        self.steps: list[Step] = []
        self.meshes: set[tuple[str, ...]] = set()

    def clip_gradients(self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None) -> Any:
        p = self.norm_types[self.trainer.global_step % len(self.norm_types)]
        self.gradient_clip_norm_type = p
        grads = {n: q.grad for n, q in self.named_parameters()}
        self.meshes |= dtensor_meshes(grads.values())
        saved = local_copies(grads)
        step = Step(p, reference_norm(model_gradient(grads).values(), p), float(gradient_clip_val))
        if self.compare_lightning and not self.steps:
            self.grad_norm_utility = _grad_norm_utility(self)
        if self.compare_lightning:
            self._lightning_clip(step, optimizer, gradient_clip_val, gradient_clip_algorithm)
            put_back(grads, saved)
        with CollectiveCounter() as c:
            norm = super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        step.ours, step.ours_ops = float(norm), c.ops
        coefficient = reference_coefficient(step.expected, step.max_norm)
        step.clipped_err = max(
            max_rel_error(local(q.grad), saved[n].double() * coefficient) for n, q in self.named_parameters()
        )
        self.steps.append(step)
        return norm

    def _lightning_clip(self, step: Step, optimizer: Any, clip_val: Any, algorithm: Any) -> None:
        """Lightning's clip (norm type 2), or torch's call it makes with ``norm_type`` (1, inf); its norm or error.

        Not for inf where a rank holds an empty shard: see below.
        """
        norms: list[torch.Tensor] = []
        torch_clip = torch.nn.utils.clip_grad_norm_
        params = list(self.trainer.precision_plugin.main_params(optimizer))
        empty = any(not local(q.grad).numel() for q in params)  # an FSDP2 shard with no element on this rank
        step.empty_shard_ranks = [r for r, e in enumerate(gather_objects(empty)) if e]

        def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
            norms.append(torch_clip(*args, **kwargs))
            return norms[-1]

        error = None
        if step.p == math.inf and step.empty_shard_ranks:
            # torch's clip starts with torch._foreach_norm over the local shards, which has no identity for
            # inf: it raises on a rank whose shard is empty, while the others go on into the all-reduce and
            # wait for them. Only that first op is run here, on the local shards, so that no rank is left waiting.
            try:
                torch._foreach_norm([local(q.grad) for q in params], math.inf)
            except RuntimeError as e:
                error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            _record_error(step, error)
            return
        try:
            with CollectiveCounter() as c:
                if step.p == 2.0:
                    torch.nn.utils.clip_grad_norm_ = recorded  # what Lightning's Precision.clip_grad_by_norm calls
                    try:
                        pl.LightningModule.clip_gradients(self, optimizer, clip_val, algorithm)
                    finally:
                        torch.nn.utils.clip_grad_norm_ = torch_clip
                else:
                    norms.append(torch_clip(params, clip_val, norm_type=step.p))
            step.lightning_ops = c.ops
            step.lightning = _as_float(norms[0])
        except Exception as e:  # on every rank (different meshes), before any collective
            error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        _record_error(step, error)


def _grad_norm_utility(module: Any) -> str:
    """What ``pytorch_lightning.utilities.grad_norm`` (the norm Lightning's docs log) does with these gradients."""
    from pytorch_lightning.utilities import grad_norm

    try:
        with CollectiveCounter() as c:
            total = grad_norm(module, 2.0)["grad_2.0_norm_total"]
        return f"{float(total)!r} ({len(c.ops)} collective(s))"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


def _record_error(step: Step, error: str | None) -> None:
    """This rank's error, and which ranks raised (every rank calls it)."""
    errors = gather_objects(error)
    step.lightning_error = error
    step.lightning_error_ranks = [r for r, e in enumerate(errors) if e is not None]
    step.lightning_error_seen = next((e for e in errors if e is not None), None)


class Net(Probe, ClipGradNormMixin, Body):
    def __init__(self, tp_everything: bool = False) -> None:
        super().__init__(tp_everything)
        self.setup_probe()


class AdaptiveNet(Probe, AdaptiveClipGradNormMixin, Body):
    compare_lightning = False
    norm_types = (2.0,)
    adaptive_clip_options: ClassVar[dict[str, Any]] = {"z": 2.5, "warmup": 2}

    def __init__(self) -> None:
        super().__init__(False)
        self.setup_probe()
        self.loaded: dict[str, torch.Tensor] | None = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.loaded = self.clip_state.state_dict()


# ---------------------------------------------------------------------------------------------
# A Trainer inside the ranks
# ---------------------------------------------------------------------------------------------


def _trainer(layout: Layout, max_steps: int) -> Any:
    from pytorch_lightning.strategies import ModelParallelStrategy

    as_launched_worker(dist.get_rank(), dist.get_world_size(), torchrun=True)
    return pl.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=layout.dp, tensor_parallel_size=layout.tp),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=max_steps,
        gradient_clip_val=CLIP_VAL,
        gradient_clip_algorithm="norm",
        **LIGHTNING_QUIET,
    )


def _data(dp: int, steps: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    n = BATCH * dp * steps
    dataset = torch.utils.data.TensorDataset(torch.randn(n, T, D, generator=g), torch.randn(n, T, OUT, generator=g))
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH)


# ---------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------


def _check_steps(where: str, steps: list[Step], layout: Layout | None) -> list[str]:
    """Every failed check of ``steps``; a summary printed on rank 0."""
    failures = []
    seen: set[float] = set()
    for i, s in enumerate(steps):
        what = f"{where} step {i} p={s.p}"
        if not s.expected > s.max_norm:
            failures.append(f"{what}: the clip would not scale (norm {s.expected} <= {s.max_norm})")
        err = abs(s.ours - s.expected) / s.expected
        if not err <= RTOL:
            failures.append(f"{what}: our norm {s.ours!r}, float64 {s.expected!r} (relative error {err:.3g})")
        if not s.clipped_err <= RTOL:
            failures.append(f"{what}: clipped grads off the float64 reference by {s.clipped_err:.3g}")
        n = steady_count(_Ops(s.ours_ops)) if s.p not in seen else len(s.ours_ops)
        seen.add(s.p)
        if n != 1:
            failures.append(f"{what}: ours issued {n} collective(s): {s.ours_ops}")
        if layout is None:
            continue
        every = list(range(dist.get_world_size()))
        if layout.lightning_raises:
            # Parameters on two meshes: torch's norm stacks DTensors of both, and raises on every rank.
            if s.lightning_error_ranks != every or (s.p == 2.0 and "same mesh" not in str(s.lightning_error)):
                failures.append(f"{what}: Lightning's clip was expected to raise on every rank: {s.lightning_error}")
        elif s.p == math.inf and s.empty_shard_ranks:
            # torch's infinity norm raises on a rank whose shard is empty, and only there.
            if s.lightning_error_ranks != s.empty_shard_ranks or (
                dist.get_rank() in s.empty_shard_ranks and "empty tensor" not in str(s.lightning_error)
            ):
                failures.append(
                    f"{what}: torch's inf norm was expected to raise on ranks {s.empty_shard_ranks} (empty shards), "
                    f"raised on {s.lightning_error_ranks}: {s.lightning_error}"
                )
        elif s.lightning_error is not None:
            failures.append(f"{what}: Lightning's clip raised {s.lightning_error}")
        elif not abs(s.lightning - s.expected) / s.expected <= LIGHTNING_RTOL:
            failures.append(f"{what}: Lightning's norm {s.lightning!r}, float64 {s.expected!r}")
    if dist.get_rank() == 0:
        for i, s in enumerate(steps):
            theirs = (
                "not run"
                if layout is None
                else f"raised on ranks {s.lightning_error_ranks} ({s.lightning_error_seen})"
                if s.lightning_error_ranks
                else f"rel. error {abs(s.lightning - s.expected) / s.expected:.2e}"
            )
            print(
                f"[{where}] step {i} p={s.p}: ours rel. error {abs(s.ours - s.expected) / s.expected:.2e}, "
                f"{len(s.ours_ops)} collective(s) {s.ours_ops}; clipped grads {s.clipped_err:.2e}; "
                f"Lightning: {theirs}, {len(s.lightning_ops)} collective(s) {s.lightning_ops}; "
                f"empty shards on ranks {s.empty_shard_ranks}",
                flush=True,
            )
    return failures


class _Ops:
    """The part of a ``CollectiveCounter`` that ``steady_count`` reads."""

    def __init__(self, ops: list[str]) -> None:
        self.ops, self.count = ops, len(ops)


def rank_zero() -> bool:
    return dist.get_rank() == 0


def _fit_layout(name: str) -> None:
    layout = LAYOUTS[name]
    model = Net(layout.tp_everything)
    trainer = _trainer(layout, len(STEP_NORM_TYPES))
    trainer.fit(model, _data(layout.dp, len(STEP_NORM_TYPES)))
    failures = _check_steps(name, model.steps, layout)
    if rank_zero():
        print(f"[{name}] pytorch_lightning.utilities.grad_norm: {model.grad_norm_utility}", flush=True)
    if not model.grad_norm_utility.startswith("RuntimeError"):  # docs/lightning.md says it raises on DTensor grads
        failures.append(f"Lightning's grad_norm utility was expected to raise: {model.grad_norm_utility}")
    if len(model.steps) != len(STEP_NORM_TYPES):
        failures.append(f"{len(model.steps)} clips in {len(STEP_NORM_TYPES)} steps")
    meshes = set().union(*gather_objects(model.meshes))
    if meshes != layout.grad_meshes:
        failures.append(f"the gradients live on {meshes}, the layout says {set(layout.grad_meshes)}")
    logged = trainer.callback_metrics.get("grad_norm")
    if logged is None or float(logged) != model.steps[-1].ours:
        failures.append(f"logged grad_norm {logged!r}, the last clip returned {model.steps[-1].ours!r}")
    assert not failures, "\n".join(failures)


def _case(name: str) -> Any:
    def case(rank: int, world_size: int) -> None:
        _fit_layout(name)

    case.__name__ = case.__qualname__ = name
    globals()[name] = case
    return case


def adaptive_checkpoint(rank: int, world_size: int) -> None:
    """``AdaptiveClipGradNormMixin``: its state in Lightning's (distributed) checkpoint and back in a new Trainer."""
    layout = LAYOUTS["dp2_tp2_mixed"]
    with shared_dir("ppclip_lightning_") as path:
        model = AdaptiveNet()
        trainer = _trainer(layout, 3)
        trainer.fit(model, _data(layout.dp, 4))
        saved = model.clip_state.state_dict()
        ckpt = os.path.join(path, "last.ckpt")
        trainer.save_checkpoint(ckpt)
        failures = _check_steps("adaptive", model.steps, None)
        if int(saved["count"]) != 3:
            failures.append(f"3 steps took {int(saved['count'])} norms in")
        thresholds = trainer.callback_metrics.get("grad_norm_threshold")
        if thresholds is None or float(thresholds) != float(model.clip_stats.threshold):
            failures.append(f"logged grad_norm_threshold {thresholds!r}, the last clip {model.clip_stats.threshold!r}")
        if rank == 0:
            meta = torch.load(os.path.join(ckpt, _METADATA_FILENAME), weights_only=True)
            if set(meta.get(CHECKPOINT_KEY, {})) != {"count", "mean", "var"}:
                failures.append(f"the checkpoint has no clip state: {sorted(meta)}")

        resumed = AdaptiveNet()
        trainer = _trainer(layout, 4)
        trainer.fit(resumed, _data(layout.dp, 4), ckpt_path=ckpt)
        if resumed.loaded is None or any(not torch.equal(resumed.loaded[k], saved[k].cpu()) for k in saved):
            failures.append(f"the resumed state {resumed.loaded} is not the saved {saved}")
        if len(resumed.steps) != 1 or int(resumed.clip_state.state.count) != 4:
            failures.append(f"after one more step: {len(resumed.steps)} clips, count {resumed.clip_state.state.count}")
        failures += _check_steps("adaptive, resumed", resumed.steps, None)
        assert not failures, "\n".join(failures)


CASES = [*(_case(name) for name in LAYOUTS), adaptive_checkpoint]

# make test-quick runs one layout alone on the ranks (about 5 s); the others are slow.
test_on_real_ranks = real_rank_test(CASES, WORLD, case_timeout=60.0, slow=all_but(CASES, "dp4"))


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------


class Manual(ClipGradNormMixin, pl.LightningModule):
    """Manual optimization: ``self.clip_gradients`` in the training step returns the norm."""

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.algorithm = algorithm
        self.layer = torch.nn.Linear(2, 1, bias=False)
        self.returned: list[Any] = []
        self.grads: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.layer(batch).sum())  # the gradient is the batch
        self.returned.append(self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm=self.algorithm))
        self.grads.append(self.layer.weight.grad.clone())
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_optimization_one_process(algorithm: str) -> None:
    """By norm: ours, the norm returned and logged; by value: Lightning's, ``None`` returned."""
    model = Manual(algorithm)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, **LIGHTNING_QUIET)
    trainer.fit(model, torch.utils.data.DataLoader(torch.tensor([[3.0, 4.0]])))
    if algorithm == "norm":
        assert model.returned == [torch.tensor(5.0, dtype=torch.float64)]
        torch.testing.assert_close(model.grads[0], torch.tensor([[0.6, 0.8]]))
        assert float(trainer.callback_metrics["grad_norm"]) == 5.0
    else:
        assert model.returned == [None]
        torch.testing.assert_close(model.grads[0], torch.tensor([[1.0, 1.0]]))
        assert "grad_norm" not in trainer.callback_metrics
    # Lightning's own precision plugin is left as it was.
    assert "clip_grad_by_norm" not in vars(trainer.precision_plugin)


def test_imports_without_lightning() -> None:
    """``ppclip_func.lightning`` and a class using its mixin need no Lightning until a clip runs."""
    code = (
        "import sys; sys.modules['pytorch_lightning'] = None; sys.modules['lightning'] = None\n"
        "import ppclip_func, ppclip_func.lightning as m\n"
        "class Model(m.ClipGradNormMixin, object): pass\n"
        "assert 'pytorch_lightning' not in [k for k, v in sys.modules.items() if v is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
