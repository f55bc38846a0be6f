"""Hugging Face ``transformers.Trainer`` 5.23 on gloo CPU ranks: a tiny Llama, its layouts, and a probe of each clip.

:func:`tiny_llama` builds a ``LlamaForCausalLM`` from a config and saves it
in a temporary folder (no download: ``HF_HUB_OFFLINE=1``); each layout loads
it as a user does, with ``from_pretrained(folder, distributed_config=...)``
for transformers' own tensor parallelism and FSDP2, or plainly for DDP and
Accelerate's FSDP2. :func:`training_arguments` makes the Trainer see the
harness's ranks (the ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` a launcher
sets; the process group is the harness's).

One run-time adjustment makes a layout that Accelerate builds for GPUs run
on CPU ranks, as in ``tests/_accelerate.py`` (no file of transformers or
Accelerate is edited): with ``cpu_as_gpu=True``, ``PartialState``'s
distributed type is set to ``MULTI_GPU`` before the Trainer is built, and
``TrainingArguments(accelerator_config={"use_configured_state": True})``
keeps it. Accelerate refuses a ``ParallelismConfig`` (which the Trainer
builds for a tensor-parallel model) and selects FSDP only for accelerator
device types, never ``MULTI_CPU``. The device stays ``cpu``, the process
group gloo.

:class:`Probe` wraps a trainer's ``_clip_grad_norm`` and ``_get_grad_norm``
on the instance, so that at each step, on the step's own gradients, it
records the float64 reference (the whole model's gradient gathered from
every rank), what the Trainer's own method returns and leaves in the
gradients, and then what the trainer's method (ours, after ``use_ppclip``)
returns, leaves and issues (collectives counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests._collectives import CollectiveCounter, steady_count
from tests._gather import model_gradient, shared_dir
from tests._reference import reference_coefficient, reference_norm
from tests._trainer_checks import as_launched_worker, local, local_copies, max_rel_error, put_back

TRANSFORMERS_VERSION = "5.23.0"
VOCAB, SEQ = 64, 8


def tiny_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


@contextlib.contextmanager
def tiny_llama() -> Iterator[str]:
    """The folder of a tiny Llama saved by rank 0 (``save_pretrained``), from a config and a fixed seed."""
    from transformers import LlamaForCausalLM

    with shared_dir("ppclip_tiny_llama_") as path:
        if dist.get_rank() == 0:
            torch.manual_seed(0)
            LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
        dist.barrier()
        yield path


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences, each its own labels."""

    def __init__(self, n: int = 32) -> None:
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def training_arguments(output_dir: str, *, cpu_as_gpu: bool = False, **kwargs: Any) -> Any:
    """``TrainingArguments`` for this rank of the harness's process group (see the module docstring)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from transformers import TrainingArguments

    as_launched_worker(dist.get_rank(), dist.get_world_size())
    AcceleratorState._reset_state(reset_partial_state=True)
    if cpu_as_gpu:
        PartialState(cpu=True)  # joins the harness's gloo process group
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        kwargs["accelerator_config"] = {"use_configured_state": True}
    defaults = dict(
        use_cpu=True,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_level="error",
    )
    return TrainingArguments(output_dir, **{**defaults, **kwargs})


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@dataclasses.dataclass
class Step:
    """What one step's clip did, ours beside the Trainer's own, on the same gradients."""

    method: str  # "_clip_grad_norm" or "_get_grad_norm"
    path: str  # the Trainer's own path: "_mixed_mesh_grad_norm" or "accelerator.clip_grad_norm_"
    grad_kinds: set[tuple[str, Any]]  # (type, mesh dim names) of the gradients
    reference: float  # float64, over the whole model's gradient, for the trainer's norm type
    reference_p2: float  # float64, p=2: what the Trainer's own computes
    ours: torch.Tensor
    theirs: float
    collectives: int  # ours, less the one-time agreement gather
    theirs_collectives: int  # the Trainer's own, on the same gradients
    ours_grads_error: float  # max relative error of ours' clipped grads vs the reference scaled
    theirs_grads_error: float
    clipped: bool  # the clip scaled (coefficient < 1)


class Probe:
    """Records every clip of ``trainer`` (see the module docstring); install after ``use_ppclip``."""

    def __init__(self, trainer: Any, norm_type: float = 2.0) -> None:
        from transformers import Trainer

        self.trainer, self.norm_type, self.steps = trainer, norm_type, []
        ours_clip, ours_get = trainer._clip_grad_norm, trainer._get_grad_norm  # the class's: ours

        def clip(model: torch.nn.Module) -> torch.Tensor:
            return self._step(model, "_clip_grad_norm", lambda: Trainer._clip_grad_norm(trainer, model), ours_clip)

        def get(model: torch.nn.Module, grad_norm: Any = None) -> Any:
            if grad_norm is not None:
                return ours_get(model, grad_norm)
            return self._step(model, "_get_grad_norm", lambda: Trainer._get_grad_norm(trainer, model), ours_get)

        trainer._clip_grad_norm, trainer._get_grad_norm = clip, get

    def _step(self, model: torch.nn.Module, method: str, theirs_fn: Any, ours_fn: Any) -> torch.Tensor:
        grads = _grads(model)
        saved = local_copies(grads)
        full = model_gradient(grads)
        reference = reference_norm(full.values(), self.norm_type)
        reference_p2 = reference_norm(full.values(), 2.0)
        clipping = method == "_clip_grad_norm"
        max_norm = self.trainer.args.max_grad_norm

        def error(expected_norm: float) -> float:
            coefficient = reference_coefficient(expected_norm, max_norm) if clipping else 1.0
            errors = [max_rel_error(local(g), saved[n].double() * coefficient) for n, g in _grads(model).items()]
            return max(errors, default=0.0)

        path = "_mixed_mesh_grad_norm" if self.trainer._has_mixed_mesh_grads(model) else "accelerator.clip_grad_norm_"
        with CollectiveCounter() as theirs_counter:
            theirs = theirs_fn()
        theirs = float(theirs.full_tensor() if isinstance(theirs, DTensor) else theirs)
        theirs_error = error(reference_p2)
        put_back(_grads(model), saved)
        with CollectiveCounter() as counter:
            ours = ours_fn(model)
        kinds = {
            (type(g).__name__, g.device_mesh.mesh_dim_names if isinstance(g, DTensor) else None) for g in grads.values()
        }
        self.steps.append(
            Step(
                method,
                path,
                kinds,
                reference,
                reference_p2,
                ours.detach().clone(),
                theirs,
                steady_count(counter),
                theirs_counter.count,
                error(reference),
                theirs_error,
                clipping and reference_coefficient(reference, max_norm) < 1.0,
            )
        )
        return ours


def logs_callback() -> Any:
    """A ``TrainerCallback`` keeping, in ``.logs``, every dict the Trainer logs (``grad_norm`` at each step)."""
    from transformers import TrainerCallback

    class Logs(TrainerCallback):
        def __init__(self) -> None:
            self.logs: list[dict[str, float]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            self.logs.append(dict(logs or {}))

    return Logs()
