"""The Lightning mixins under both of Lightning's packages, and their options checked where they are given.

Lightning ships twice: the unified ``lightning`` (``import lightning as L``,
its classes in ``lightning.pytorch``, what docs/lightning.md shows) and
``pytorch_lightning``. Their classes are different objects, so a check made
against one package's ``FSDPStrategy`` misses the other's Trainer. Spec:

* under either package, ``FSDPStrategy`` (FSDP1) with a clip by norm is
  refused at the start of ``fit`` on every rank, naming the strategy and
  ``ModelParallelStrategy``, before any optimizer step;
* the docs' snippet (``ClipGradNormMixin, L.LightningModule``,
  ``L.Trainer(strategy=ModelParallelStrategy(...))``) clips by the float64
  norm of the whole model with one collective;
* the integration runs with only one of the two packages installed;
* a bad ``adaptive_clip_options`` or ``gradient_clip_norm_type`` raises when
  the class is defined, naming the option.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter
from tests._gather import gather_objects, model_gradient
from tests._reference import reference_coefficient, reference_norm
from tests._trainer_checks import LIGHTNING_QUIET, all_but, as_launched_worker, dtensor_meshes, local

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install lightning)")
pl = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")

from ppclip_func.lightning import AdaptiveClipGradNormMixin, ClipGradNormMixin  # noqa: E402

WORLD = 2
CLIP_VAL = 1e-3  # below every norm here, so every clip scales
D, H, OUT, BATCH, STEPS = 8, 16, 2, 2, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _body(base: type) -> type:
    """The docs' model on ``base`` (a ``LightningModule`` of one package), its head left to FSDP alone."""

    class Body(ClipGradNormMixin, base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.w1, self.w2, self.head = torch.nn.Linear(D, H), torch.nn.Linear(H, D), torch.nn.Linear(D, OUT)
            self.seen: list[tuple[float, float, float]] = []  # (float64 norm, ours, largest clipped-grad error)
            self.ops: list[int] = []
            self.steps_run = 0

        def configure_model(self) -> None:
            mesh = getattr(self, "device_mesh", None)
            if mesh is None:
                # FSDPStrategy: FSDP1 wraps each layer here, as its docs show; on a CPU torch's FSDP1 needs
                # device_id given (Lightning passes the device's index, None on a CPU), so it is given here.
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

                for name in ("w1", "w2", "head"):
                    setattr(self, name, FSDP(getattr(self, name), device_id=torch.device("cpu")))
                return
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self, mesh["tensor_parallel"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            fully_shard(self, mesh=mesh["data_parallel"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.w2(torch.relu(self.w1(x))))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.steps_run += 1
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def clip_gradients(self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None):
            grads = {n: q.grad for n, q in self.named_parameters()}
            saved = {n: local(g).detach().double() for n, g in grads.items()}
            expected = reference_norm(model_gradient(grads).values(), 2.0)
            with CollectiveCounter() as counter:
                norm = super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            coefficient = reference_coefficient(expected, CLIP_VAL)
            err = max(
                float((local(q.grad).double() - saved[n] * coefficient).abs().max()) for n, q in self.named_parameters()
            )
            self.seen.append((expected, float(norm), err))
            self.ops.append(counter.count)
            return norm

    return Body


def _fit(package: Any, strategy: Any, model: Any) -> Any:
    as_launched_worker(dist.get_rank(), dist.get_world_size(), torchrun=True)
    trainer = package.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=STEPS,
        gradient_clip_val=CLIP_VAL,
        **LIGHTNING_QUIET,
    )
    g = torch.Generator().manual_seed(1)
    n = BATCH * dist.get_world_size() * STEPS
    data = torch.utils.data.TensorDataset(torch.randn(n, D, generator=g), torch.randn(n, OUT, generator=g))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return trainer


def docs_snippet_unified(rank: int, world_size: int) -> None:
    """``import lightning as L`` and ``ModelParallelStrategy``: the float64 norm, clipped grads, one collective."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    model = _body(L.LightningModule)()
    trainer = _fit(L, ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), model)
    assert len(model.seen) == STEPS, model.seen
    for expected, ours, err in model.seen:
        assert expected > CLIP_VAL
        assert abs(ours - expected) <= 1e-6 * expected, (ours, expected)
        assert err <= 1e-6 * CLIP_VAL, err
    assert model.ops[-1] == 1, model.ops
    assert float(trainer.callback_metrics["grad_norm"]) == model.seen[-1][1]
    # The gradients mixed two meshes (the head on FSDP's alone): where torch's own clip raises.
    meshes = dtensor_meshes(model.parameters())
    assert meshes == {("data_parallel", "tensor_parallel"), ("data_parallel",)}, meshes
    # Every rank holds the same norm, bit for bit.
    assert len(set(gather_objects(model.seen[-1][1]))) == 1


def _fsdp1_refused(package: Any, strategies: Any) -> None:
    # Lightning refuses FSDPStrategy itself on a CPU (`type(strategy) is FSDPStrategy`), not a subclass of it: the
    # subclass runs FSDP1 on these gloo ranks, as FSDPStrategy does on GPUs, and is refused by the mixin the same way.
    cpu_fsdp1 = type("CPUFSDPStrategy", (strategies.FSDPStrategy,), {})
    model = _body(package.LightningModule)()
    try:
        _fit(package, cpu_fsdp1(), model)
    except Exception as error:
        message = str(error)
    else:
        message = ""
    messages = gather_objects(message)
    name = strategies.__name__.rsplit(".", 1)[0]
    for m in messages:  # every rank
        assert f"{name}.strategies.FSDPStrategy" in m and "ModelParallelStrategy" in m, messages
    assert model.steps_run == 0 and not model.seen, f"refused after {model.steps_run} training steps"


def fsdp1_refused_unified(rank: int, world_size: int) -> None:
    """``lightning.pytorch.strategies.FSDPStrategy`` is refused at the start of fit, on every rank."""
    import lightning.pytorch.strategies as strategies

    _fsdp1_refused(L, strategies)


def fsdp1_refused_pytorch_lightning(rank: int, world_size: int) -> None:
    """``pytorch_lightning.strategies.FSDPStrategy``: the same refusal."""
    import pytorch_lightning.strategies as strategies

    _fsdp1_refused(pl, strategies)


CASES = [docs_snippet_unified, fsdp1_refused_unified, fsdp1_refused_pytorch_lightning]

# make test-quick runs the docs' snippet alone on the ranks (about 5 s); the refusals are slow.
test_on_real_ranks = real_rank_test(CASES, WORLD, case_timeout=60.0, slow=all_but(CASES, "docs_snippet_unified"))


# One package alone: the other is made unimportable in a fresh interpreter.
_ONE_PACKAGE = """
import sys
sys.modules[{hidden!r}] = None
import torch
import {module} as package
from ppclip_func.lightning import ClipGradNormMixin

class Model(ClipGradNormMixin, package.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1, bias=False)
    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()  # the gradient is the batch, [[3, 4]]
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

trainer = package.Trainer(accelerator="cpu", devices=1, max_steps=1, gradient_clip_val=1.0, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Model()
trainer.fit(model, torch.utils.data.DataLoader(torch.tensor([[3.0, 4.0]])))
assert float(trainer.callback_metrics["grad_norm"]) == 5.0
torch.testing.assert_close(model.layer.weight.grad, torch.tensor([[0.6, 0.8]]))
assert sys.modules.get({hidden!r}) is None
print("ok")
"""


@pytest.mark.parametrize(("module", "hidden"), [("lightning", "pytorch_lightning"), ("pytorch_lightning", "lightning")])
def test_one_package_alone(module: str, hidden: str) -> None:
    """With only ``module`` importable, the mixin clips by norm and never reaches for ``hidden``."""
    code = textwrap.dedent(_ONE_PACKAGE.format(module=module, hidden=hidden))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"max_norm": 3.0}, TypeError, "'max_norm' is set by Trainer(gradient_clip_val=...)"),
        ({"norm_type": 1.0}, TypeError, "'norm_type' is set by gradient_clip_norm_type"),
        ({"warmupp": 2}, TypeError, "'warmupp' is not an option of adaptive_clip_grad_norm_ (did you mean 'warmup'?)"),
        ({"alpha": 1.5}, ValueError, "alpha must be a number in (0, 1)"),
        ({"mode": "median"}, ValueError, "mode must be one of"),
        ({"nonfinite": "bogus"}, ValueError, "nonfinite must be one of"),
        ({"overflow_safe": "yes"}, TypeError, "overflow_safe must be a bool"),
        (["z"], TypeError, "options must be a mapping"),
    ],
)
def test_bad_adaptive_options_raise_at_class_definition(options: Any, error: type, message: str) -> None:
    """A bad ``adaptive_clip_options`` raises when the class is written, naming the class and the option."""
    with pytest.raises(error) as raised:

        class Model(AdaptiveClipGradNormMixin, L.LightningModule):
            adaptive_clip_options: ClassVar[Any] = options

    assert "class Model.adaptive_clip_options: " in str(raised.value)
    assert message in str(raised.value)


@pytest.mark.parametrize("p", [-1.0, "2", math.nan])
def test_bad_norm_type_raises_at_class_definition(p: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=r"class Model\.gradient_clip_norm_type: norm_type must be"):

        class Model(ClipGradNormMixin, L.LightningModule):
            gradient_clip_norm_type: ClassVar[Any] = p


def test_options_set_on_the_instance_are_checked_when_the_fit_starts() -> None:
    """Options set after the class (in ``__init__``) are checked at ``on_fit_start``, before any step."""

    class Model(AdaptiveClipGradNormMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.adaptive_clip_options = {"zscore_epss": 1.0}
            self.layer = torch.nn.Linear(2, 1, bias=False)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1.0)

    model = Model()
    before = model.layer.weight.detach().clone()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, gradient_clip_val=1.0, **LIGHTNING_QUIET)
    with pytest.raises(TypeError, match=r"Model\.adaptive_clip_options: 'zscore_epss' is not an option"):
        trainer.fit(model, torch.utils.data.DataLoader(torch.tensor([[3.0, 4.0]])))
    assert torch.equal(model.layer.weight, before)
    assert model.clip_stats is None
