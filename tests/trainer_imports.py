"""Each trainer integration imported and run once beside its trainer, in a venv with nothing else.

Run by ``make test-trainers`` (``python -m tests.trainer_imports``) in a venv
that has only torch, this package's dependencies, the ``trainers`` extra and
the Makefile's no-deps installs: no pytest, so a package a trainer imports
and the recipe forgot (rich's traceback needs pygments, which pytest used to
bring) fails here.
Each check prints one line; the script exits non-zero if any failed.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable

import torch


def _linear_with_grad() -> torch.nn.Linear:
    layer = torch.nn.Linear(2, 1, bias=False)
    layer.weight.grad = torch.tensor([[3.0, 4.0]])
    return layer


def check_torchtitan() -> str:
    if sys.version_info < (3, 11):
        return "skipped: torchtitan 0.3.0 needs Python >= 3.11"
    # What the integration stands in for. (torchtitan's models import triton through MinimalAsyncEP's
    # kernels, which a CPU build of torch does not bring: the tests stub it, tests/_torchtitan.py.)
    from torchtitan.distributed import ParallelDims  # noqa: F401
    from torchtitan.distributed import utils as dist_utils  # noqa: F401

    from ppclip_func import torchtitan as ppclip

    layer = _linear_with_grad()
    assert float(ppclip.clip_grad_norm_(list(layer.parameters()), 1.0)) == 5.0
    return "clip_grad_norm_ on one process"


def check_olmo_core() -> str:
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14):
        return "skipped: ai2-olmo-core 3.0.0 asks torch < 2.14"
    # As the tests import it: cached-path (cloud SDKs) is left out of the recipe and stood in for.
    from tests._olmo_core import import_olmo_core

    for name in ("olmo_core.nn.transformer", "olmo_core.optim", "olmo_core.train.train_module"):
        import_olmo_core(name)

    from ppclip_func.olmo_core import use_ppclip

    class Module:
        world_mesh = None
        model = _linear_with_grad()

    module = use_ppclip(Module(), adaptive={"warmup": 2})
    assert float(module._clip_grad_norm(1.0)) == 5.0
    return "use_ppclip(adaptive=...) on one process"


def check_accelerate() -> str:
    from accelerate import Accelerator

    from ppclip_func import accelerate as ppclip

    accelerator = ppclip.patch_accelerator(Accelerator(cpu=True))
    model = accelerator.prepare(torch.nn.Linear(2, 1, bias=False))
    model.weight.grad = torch.tensor([[3.0, 4.0]])
    assert float(accelerator.clip_grad_norm_(model.parameters(), 1.0)) == 5.0
    return "patch_accelerator on one process"


def _lightning(package_name: str) -> str:
    package = importlib.import_module(package_name)

    from ppclip_func.lightning import ClipGradNormMixin

    class Model(ClipGradNormMixin, package.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1, bias=False)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).sum()  # the gradient is the batch, [[3, 4]]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    trainer = package.Trainer(
        accelerator="cpu", devices=1, max_steps=1, gradient_clip_val=1.0, enable_model_summary=False, **quiet
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(torch.tensor([[3.0, 4.0]])))
    assert float(trainer.callback_metrics["grad_norm"]) == 5.0
    return f"ClipGradNormMixin in {package_name}.Trainer.fit"


def check_lightning() -> str:
    return _lightning("lightning")


def check_pytorch_lightning() -> str:
    return _lightning("pytorch_lightning")


def check_transformers() -> str:
    import tempfile

    from transformers import Trainer, TrainingArguments

    from ppclip_func.transformers import use_ppclip

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_grad_norm=1.0)
        trainer = use_ppclip(Trainer(model=_linear_with_grad(), args=args))
        assert isinstance(trainer, Trainer)
        assert float(trainer._clip_grad_norm(trainer.model)) == 5.0
    return "use_ppclip(Trainer(...)) and its _clip_grad_norm on one process"


CHECKS: dict[str, Callable[[], str]] = {
    "torchtitan": check_torchtitan,
    "olmo_core": check_olmo_core,
    "accelerate": check_accelerate,
    "lightning": check_lightning,
    "pytorch_lightning": check_pytorch_lightning,
    "transformers": check_transformers,
}


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ppclip_func

    print(
        f"ppclip_func {ppclip_func.__version__} from {os.path.dirname(ppclip_func.__file__)}, torch {torch.__version__}"
    )
    failed = []
    for name, check in CHECKS.items():
        try:
            print(f"{name}: ok ({check()})", flush=True)
        except Exception:
            failed.append(name)
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
    print(
        f"{len(CHECKS) - len(failed)} of {len(CHECKS)} integrations import and run"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
