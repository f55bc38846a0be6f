"""Hugging Face ``transformers.Trainer``'s gradient clip and its logged ``grad_norm``, with one collective.

One line after the ``Trainer`` is built (any ``Trainer`` subclass: trl's
``SFTTrainer`` as well); ``TrainingArguments(max_grad_norm=...)`` stays the
threshold, and ``train()``, ``resume_from_checkpoint`` and the logs are the
Trainer's own::

    from ppclip_func.transformers import use_ppclip

    trainer = use_ppclip(Trainer(model=model, args=args, train_dataset=train_dataset))
    trainer.train()

A ``Trainer`` subclass of your own takes the mixin first instead:
``class MyTrainer(PPClipMixin, Trainer)``.

Why these two methods. transformers 5.23's training loop measures the norm
in exactly two places, both methods of the ``Trainer``: ``_clip_grad_norm(model)``
when ``max_grad_norm > 0`` and ``_get_grad_norm(model, grad_norm)`` (the norm
with ``max_norm=inf`` when it is 0); the ``grad_norm`` it logs is what they
return. Each has the same two paths inside: gradients that mix DTensors and
plain tensors, or DTensors on several meshes (tensor or expert parallelism
from ``from_pretrained(..., distributed_config=DistributedConfig(...))``), go
to the Trainer's ``_mixed_mesh_grad_norm`` (torch's ``get_total_norm`` and a
``full_tensor()`` per mesh, an L2 of the stack: one collective per mesh and
sharded dim, float32, and the norm of a pipeline's other stages left out);
everything else goes to ``accelerator.clip_grad_norm_``. :class:`PPClipMixin`
overrides both methods, so both paths become :func:`ppclip_func.clip_grad_norm_`
(or :func:`ppclip_func.adaptive_clip_grad_norm_`) over the mesh of every rank:
the model's own (``model._device_mesh``, ``("pp", "fsdp", "tp")``) when
transformers sharded it at load time, else Accelerate's
(``accelerator.torch_device_mesh``; ``None`` for DDP and Accelerate's FSDP2
without a ``ParallelismConfig``). ``patch_accelerator`` alone
(:mod:`ppclip_func.accelerate`) reaches only the second path.

Before the norm, fp16's ``GradScaler`` is unscaled with
``accelerator.unscale_gradients()`` (a no-op without one), as Accelerate's
clip does. Refused when the Trainer is built, with a ``ValueError`` saying
why: DeepSpeed, Megatron-LM and XLA (they clip inside their own engines) and
FSDP1 (its flat shards carry no layout), as in :mod:`ppclip_func.accelerate`.
SageMaker model parallelism with fp16 keeps the Trainer's clip (its optimizer
clips its own master gradients).

With ``adaptive=`` the threshold follows the run (ZClip), capped at
``max_grad_norm``; its statistics are written beside the optimizer in every
checkpoint the Trainer saves (``ppclip_state.pt``) and read back by
``train(resume_from_checkpoint=...)``.

Every option is checked where it is given (by :func:`use_ppclip`, or when a
:class:`PPClipMixin` trainer is built), through the same check the clip
itself runs: an unknown name, one the Trainer sets itself, a wrong type or
an unknown rule raises there, naming the option, before anything is changed.

Nothing of transformers is imported here: the mixin is a plain class, and
the trainer it is given is only read.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._clip.adaptive import ClipStats
from ._clip.forms import adaptive_clip_grad_norm_, clip_grad_norm_, global_grad_norm
from ._clip.stateful import ClipStateful
from ._trainers.accelerator import accelerator_mesh
from ._trainers.options import check_options

__all__ = ["STATE_NAME", "PPClipMixin", "use_ppclip"]

STATE_NAME = "ppclip_state.pt"
"""The file, in each checkpoint folder the Trainer saves, that holds the adaptive threshold's statistics."""

# Options the Trainer integration sets itself, and what sets them.
_FIXED = {"max_norm": "TrainingArguments.max_grad_norm"}
_FIXED_CLIP = {
    **_FIXED,
    "groups": "the Trainer, which takes one norm back (ppclip_func.global_grad_norm gives a norm per group)",
}
_FIXED_ADAPTIVE = {"max_norm": "TrainingArguments.max_grad_norm (the cap on the adaptive threshold)"}
# The options of global_grad_norm, which measures the norm when the Trainer does not clip (max_grad_norm=0).
_MEASURE_OPTIONS = frozenset(inspect.signature(global_grad_norm).parameters) - {"grads", "mesh"}


class _Config(NamedTuple):
    """What a trainer clips with: the checked options, and whether they are the adaptive form's."""

    options: dict[str, Any]
    adaptive: bool


def _checked(
    options: Mapping[str, Any] | None, adaptive: Mapping[str, Any] | None, *, where_options: str, where_adaptive: str
) -> _Config:
    """The options checked once, by ``check_options`` (the same checks the clip runs at every step)."""
    if adaptive is None:
        return _Config(check_options(clip_grad_norm_, options, where=where_options, fixed=_FIXED_CLIP), False)
    if options:
        raise TypeError(
            f"{where_options} and {where_adaptive} are both given: the adaptive form takes every option of the "
            f"clip, so give them all in {where_adaptive}"
        )
    return _Config(check_options(adaptive_clip_grad_norm_, adaptive, where=where_adaptive, fixed=_FIXED_ADAPTIVE), True)


def _check_trainer(trainer: Any, config: _Config, where: str) -> None:
    """Refuses, now, a trainer whose clip this cannot replace (the message says why)."""
    accelerator_mesh(trainer.accelerator)  # DeepSpeed, Megatron-LM, XLA, FSDP1: a ValueError naming it
    max_grad_norm = trainer.args.max_grad_norm
    if config.adaptive and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(
            f"{where}: the adaptive threshold needs TrainingArguments.max_grad_norm > 0 (its cap; float('inf') for "
            f"none), got {max_grad_norm!r}: with 0 the Trainer never calls its clip"
        )


class PPClipMixin:
    """Gives a ``transformers.Trainer`` this clip in ``_clip_grad_norm`` and ``_get_grad_norm``: both its paths.

    Put it first among the bases: ``class MyTrainer(PPClipMixin, Trainer)``,
    or convert a built trainer with :func:`use_ppclip`. The options are class
    attributes, checked when the trainer is built (before the ``Trainer``'s
    own ``__init__`` runs), as :func:`use_ppclip` checks its arguments.

    The returned norm, the one the Trainer logs as ``grad_norm``, is a plain
    0-dim float64 tensor, the same on every rank. With
    :attr:`ppclip_adaptive` set, the last step's :class:`ppclip_func.ClipStats`
    is :attr:`ppclip_stats` (threshold, z-score, ``skip``: not applied to
    the optimizer step) and the statistics are :attr:`ppclip_state`, saved
    in the Trainer's checkpoints as :data:`STATE_NAME` and restored on
    ``train(resume_from_checkpoint=...)``.

    Attributes:
        ppclip_options: Options of :func:`ppclip_func.clip_grad_norm_` other
            than ``max_norm`` (``TrainingArguments.max_grad_norm``) and
            ``groups``: ``norm_type``, ``eps``, ``nonfinite``, ``overflow_safe``, ...
        ppclip_adaptive: ``None`` for the fixed threshold, or options of
            :func:`ppclip_func.adaptive_clip_grad_norm_` other than
            ``max_norm`` (``{}`` for its defaults): ``z``, ``alpha``,
            ``warmup``, ``mode``, ``norm_type``, ... With it,
            ``max_grad_norm`` is the cap and must be above 0.

    Raises:
        TypeError, ValueError: When the trainer is built, for a bad option
            (naming it) or a trainer whose clip stays its own (DeepSpeed,
            Megatron-LM, XLA, FSDP1).

    Example:
        >>> import pytest, tempfile, torch
        >>> transformers = pytest.importorskip("transformers")
        >>> from ppclip_func.transformers import PPClipMixin
        >>> class Trainer(PPClipMixin, transformers.Trainer):
        ...     ppclip_adaptive = {"warmup": 2}
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), use_cpu=True, max_grad_norm=10.0, report_to=[])
        >>> trainer = Trainer(model=torch.nn.Linear(2, 1, bias=False), args=args)
        >>> for g in (3.0, 4.0, 3.5):
        ...     trainer.model.weight.grad = torch.tensor([[g, 0.0]])
        ...     norm = trainer._clip_grad_norm(trainer.model)  # what Trainer.train() calls at each step
        >>> norm, trainer.ppclip_stats.threshold  # after 2 warm-up steps, the threshold follows the norms, not 10
        (tensor(3.5000, dtype=torch.float64), tensor(4.7500, dtype=torch.float64))
        >>> trainer.ppclip_state.state.count
        tensor(3)
    """

    ppclip_options: ClassVar[Mapping[str, Any] | None] = None
    ppclip_adaptive: ClassVar[Mapping[str, Any] | None] = None
    ppclip_stats: ClipStats | None = None
    # The Trainer's, which this is mixed into (declared for the type checker only).
    args: Any
    accelerator: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        config = _checked(
            self.ppclip_options,
            self.ppclip_adaptive,
            where_options=f"{name}.ppclip_options",
            where_adaptive=f"{name}.ppclip_adaptive",
        )
        super().__init__(*args, **kwargs)
        _check_trainer(self, config, name)
        self._ppclip_config = config

    @property
    def ppclip_state(self) -> ClipStateful:
        """The adaptive threshold's statistics, created on ``args.device`` at the first use."""
        holder = self.__dict__.get("_ppclip_state")
        if holder is None:
            holder = self.__dict__["_ppclip_state"] = ClipStateful(self.args.device)
        return holder

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The Trainer's ``_clip_grad_norm``: clips in place to ``max_grad_norm``, returns the norm before."""
        if _keeps_its_clip(self):
            return super()._clip_grad_norm(model)  # type: ignore[misc]  # a mixin: the Trainer's method, after it in the MRO
        config = self._ppclip_config
        parameters = list(model.parameters())
        mesh = _mesh(self)
        self.accelerator.unscale_gradients()
        max_norm = self.args.max_grad_norm
        if not config.adaptive:
            return clip_grad_norm_(parameters, mesh, max_norm, **config.options)
        state = self.ppclip_state
        stats = adaptive_clip_grad_norm_(parameters, mesh, state.state, max_norm=max_norm, **config.options)
        state.update_(stats.state)
        self.ppclip_stats = stats
        return stats.total_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The Trainer's ``_get_grad_norm``: the norm it logs; measured here when nothing was clipped."""
        if grad_norm is not None or _keeps_its_clip(self):
            return super()._get_grad_norm(model, grad_norm)  # type: ignore[misc]  # a mixin: the Trainer's method, after it in the MRO
        options = {k: v for k, v in self._ppclip_config.options.items() if k in _MEASURE_OPTIONS}
        grads = [p.grad for p in model.parameters()]
        mesh = _mesh(self)
        self.accelerator.unscale_gradients()
        return global_grad_norm(grads, mesh, **options)

    def _save_scaler(self, output_dir: str) -> None:
        """The Trainer's save of the small state beside the optimizer, with the adaptive statistics."""
        super()._save_scaler(output_dir)  # type: ignore[misc]  # a mixin: the Trainer's method, after it in the MRO
        if self._ppclip_config.adaptive and self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            torch.save({k: v.cpu() for k, v in self.ppclip_state.state_dict().items()}, _state_file(output_dir))

    def _load_scaler(self, checkpoint: str | None) -> None:
        """The Trainer's load of that state on resume; the adaptive statistics where the checkpoint has them."""
        super()._load_scaler(checkpoint)  # type: ignore[misc]  # a mixin: the Trainer's method, after it in the MRO
        if checkpoint is None or not self._ppclip_config.adaptive or not os.path.isfile(_state_file(checkpoint)):
            return
        self.ppclip_state.load_state_dict(torch.load(_state_file(checkpoint), map_location="cpu", weights_only=True))


def _state_file(directory: str) -> str:
    return os.path.join(directory, STATE_NAME)


def _keeps_its_clip(trainer: Any) -> bool:
    """SageMaker model parallelism with fp16: its optimizer clips its own master gradients."""
    return bool(trainer.args.fp16) and _sagemaker_mp_enabled()


def _sagemaker_mp_enabled() -> bool:
    from transformers.utils import is_sagemaker_mp_enabled

    return bool(is_sagemaker_mp_enabled())


def _mesh(trainer: Any) -> DeviceMesh | None:
    """The mesh of every rank: the model's, when transformers sharded it at load time, else Accelerate's."""
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        model = trainer.model
        model = getattr(model, "module", model)  # a wrapper around it keeps the mesh on the model it wraps
        mesh = getattr(model, "_device_mesh", None)
        if mesh is not None:
            return mesh
    return accelerator_mesh(trainer.accelerator)


@functools.cache
def _with_mixin(cls: type) -> type:
    """``cls`` with :class:`PPClipMixin` first among its bases, for a trainer built as a ``cls``."""
    return type(f"PPClip{cls.__name__}", (PPClipMixin, cls), {"__module__": cls.__module__})


def use_ppclip(
    trainer: Any, *, options: Mapping[str, Any] | None = None, adaptive: Mapping[str, Any] | None = None
) -> Any:
    """Makes a built ``transformers.Trainer`` clip (and log ``grad_norm``) with :class:`PPClipMixin`; returns it.

    The trainer's class becomes a subclass of its own with the mixin first,
    so nothing else about it changes (``isinstance`` still holds). Every
    argument is checked before anything is changed: on an error, the
    trainer is left as it was.

    Args:
        trainer: A ``transformers.Trainer`` (or a subclass), built.
        options: Options of :func:`ppclip_func.clip_grad_norm_` other than
            ``max_norm`` (``TrainingArguments.max_grad_norm``) and ``groups``:
            ``norm_type``, ``eps``, ``nonfinite``, ``overflow_safe``, ...
        adaptive: Options of :func:`ppclip_func.adaptive_clip_grad_norm_`
            other than ``max_norm`` for a threshold that follows the run
            (``{}`` for its defaults; every option goes here then), capped at
            ``max_grad_norm``; ``None`` for the Trainer's fixed threshold.

    Returns:
        ``trainer``, converted in place.

    Raises:
        TypeError: An option is unknown (the closest names are suggested),
            is one the Trainer sets, is given in both ``options`` and
            ``adaptive``, or has the wrong type.
        ValueError: An option is out of range or names no known rule; the
            trainer uses DeepSpeed, Megatron-LM, XLA or FSDP1; the adaptive
            form with ``max_grad_norm`` 0.

    Example:
        >>> import pytest, tempfile, torch
        >>> transformers = pytest.importorskip("transformers")
        >>> from ppclip_func.transformers import use_ppclip
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), use_cpu=True, max_grad_norm=1.0, report_to=[])
        >>> trainer = use_ppclip(transformers.Trainer(model=torch.nn.Linear(2, 1, bias=False), args=args))
        >>> isinstance(trainer, transformers.Trainer), type(trainer).__name__
        (True, 'PPClipTrainer')
        >>> trainer.model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> trainer._clip_grad_norm(trainer.model)  # what Trainer.train() calls, and logs as grad_norm
        tensor(5., dtype=torch.float64)
        >>> trainer.model.weight.grad
        tensor([[0.6000, 0.8000]])
        >>> use_ppclip(trainer, options={"nonfinte": "zero"})
        Traceback (most recent call last):
        ...
        TypeError: use_ppclip(options=...): 'nonfinte' is not an option of clip_grad_norm_ (did you mean 'nonfinite'?)
    """
    config = _checked(
        options, adaptive, where_options="use_ppclip(options=...)", where_adaptive="use_ppclip(adaptive=...)"
    )
    _check_trainer(trainer, config, "use_ppclip")
    if not isinstance(trainer, PPClipMixin):
        cls: type = type(trainer)  # `type`: type(x) is not Hashable to mypy (functools.cache)
        trainer.__class__ = _with_mixin(cls)
    trainer._ppclip_config = config
    return trainer
