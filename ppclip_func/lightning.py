"""PyTorch Lightning's gradient clipping, by the norm of the whole model, with one collective.

One base class is added to the ``LightningModule``; the ``Trainer`` keeps its
arguments (``gradient_clip_val``, ``gradient_clip_algorithm="norm"``)::

    from ppclip_func.lightning import ClipGradNormMixin


    class Model(ClipGradNormMixin, L.LightningModule):  # was: class Model(L.LightningModule)
        ...


    trainer = L.Trainer(strategy=ModelParallelStrategy(...), gradient_clip_val=1.0)

Why a mixin. Every clip in Lightning goes through
``LightningModule.clip_gradients``: the default ``configure_gradient_clipping``
calls it, so does a user's own, and so does a ``training_step`` under manual
optimization. It resolves the arguments against the ``Trainer``'s, checks
them, skips a clip value of 0, clips by value, and hands a clip by norm to
the precision plugin's ``clip_grad_by_norm``: ``torch.nn.utils.clip_grad_norm_``
on the optimizer's parameters. The mixin's :meth:`ClipGradNormMixin.clip_gradients`
runs Lightning's own method and makes only that last step ours, for the one
call, with the mesh Lightning already holds (``self.device_mesh``, the
``ModelParallelStrategy``'s ``("data_parallel", "tensor_parallel")`` mesh).
A precision plugin would replace the plugin the ``Trainer`` picks from
``precision=`` and would not know the mesh; overriding
``configure_gradient_clipping`` would miss a user's own override and manual
optimization. Nothing else changes: clip by value, the Trainer's checks and
the plugins' own checks are Lightning's.

What it fixes under ``ModelParallelStrategy`` (FSDP2 and tensor parallelism on
DTensors), measured on pytorch-lightning 2.6.6 and torch 2.13 (docs/lightning.md):
torch's ``clip_grad_norm_`` raises when the parameters sit on different
meshes, which they do as soon as one module is sharded by FSDP and not by
tensor parallelism (a 1-D ``data_parallel`` mesh beside the 2-D one); where
it runs, ours issues one all-reduce instead of its several. The norm is also
returned and logged (``grad_norm``, on step), which Lightning's clip does
not do, and ``norm_type`` can be 1 or ``inf`` (Lightning's is always 2).
Under other strategies (one device, DDP) the gradients are whole on every
rank and the norm is torch's, with no collective. ``FSDPStrategy`` (FSDP1)
is refused when the run clips by norm, at ``on_fit_start`` and again at the
clip, on every rank: its flat shards carry no layout, so no clip can weigh
them (``ModelParallelStrategy`` runs FSDP2).

The Trainer's classes are read from the Trainer in hand, so the mixins work
the same under the unified package (``import lightning as L``, whose
classes live in ``lightning.pytorch``) and under ``pytorch_lightning``, with
either one installed alone.

:class:`AdaptiveClipGradNormMixin` does the same with the threshold that
follows the run (:func:`ppclip_func.adaptive_clip_grad_norm_`), its state
saved in Lightning's checkpoints.

Nothing of Lightning is imported by this module: the mixins are plain classes,
and only the package the running Trainer comes from is read, inside their
methods. Their options (``gradient_clip_norm_type``, ``adaptive_clip_options``)
are checked when the class is defined, and again when the fit starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from ._clip.adaptive import ClipStats
from ._clip.forms import adaptive_clip_grad_norm_, clip_grad_norm_
from ._clip.stateful import ClipStateful
from ._core.norms import norm_kind
from ._trainers.options import check_options

__all__ = ["AdaptiveClipGradNormMixin", "ClipGradNormMixin"]

# The key of the adaptive state in Lightning's checkpoint dict.
CHECKPOINT_KEY = "ppclip_func.clip_state"


def _check_mixin_options(owner: Any, where: str) -> None:
    """Checks a mixin's class options (``owner`` is the class or the module), naming the attribute at fault."""
    p = owner.gradient_clip_norm_type
    try:
        norm_kind(p)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}.gradient_clip_norm_type: {error}") from None
    key = owner.grad_norm_log_key
    if key is not None and not isinstance(key, str):
        raise TypeError(f"{where}.grad_norm_log_key must be a string or None, got {key!r}")
    options = getattr(owner, "adaptive_clip_options", None)
    if options is not None:
        check_options(
            adaptive_clip_grad_norm_,
            options,
            where=f"{where}.adaptive_clip_options",
            fixed={"max_norm": "Trainer(gradient_clip_val=...)", "norm_type": "gradient_clip_norm_type"},
        )


class ClipGradNormMixin:
    """Makes ``LightningModule.clip_gradients`` clip by the global norm over ``self.device_mesh``, one collective.

    Put it before ``LightningModule`` in the bases. The ``Trainer``'s
    ``gradient_clip_val`` and ``gradient_clip_algorithm`` keep their meaning;
    ``"norm"`` (Lightning's default) is the clip of :func:`ppclip_func.clip_grad_norm_`
    over the module's ``device_mesh`` (``None`` outside ``ModelParallelStrategy``:
    the gradients are then whole on every rank, as under DDP), ``"value"`` is
    Lightning's. A user's own ``configure_gradient_clipping`` that calls
    ``self.clip_gradients`` and a ``training_step`` under manual optimization
    get the same clip.

    Attributes:
        gradient_clip_norm_type: The norm's ``p``: ``2.0`` (Lightning's, the
            default), ``1.0``, ``math.inf``, any ``p > 0``.
        grad_norm_log_key: The name under which the norm is logged with
            ``self.log`` on each step, or ``None`` not to log it. Logging
            issues no collective (the norm is already the same on every
            rank) and reads nothing on the host in the step: Lightning reads
            the value when it writes its logs.

    Example:
        On one process (``ModelParallelStrategy`` gives the module its mesh; here it has none):

        >>> import pytest, torch
        >>> pl = pytest.importorskip("pytorch_lightning")
        >>> from ppclip_func.lightning import ClipGradNormMixin
        >>> class Model(ClipGradNormMixin, pl.LightningModule):  # was: class Model(pl.LightningModule)
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Linear(2, 1, bias=False)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.layer(batch).sum()  # the gradient is the batch, [[3, 4]]
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.0)
        >>> quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, gradient_clip_val=1.0, **quiet)
        >>> model = Model()
        >>> trainer.fit(model, torch.utils.data.DataLoader(torch.tensor([[3.0, 4.0]])))
        >>> trainer.callback_metrics["grad_norm"]
        tensor(5., dtype=torch.float64)
        >>> model.layer.weight.grad  # clipped to norm 1
        tensor([[0.6000, 0.8000]])
    """

    # The LightningModule's, which this is mixed into (declared for the type checker only).
    trainer: Any
    gradient_clip_norm_type: ClassVar[float] = 2.0
    grad_norm_log_key: ClassVar[str | None] = "grad_norm"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_mixin_options(cls, f"class {cls.__name__}")

    def on_fit_start(self) -> None:
        """Lightning's hook; first refuses a strategy the clip cannot serve and checks the options, on every rank."""
        trainer = self.trainer
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
            _refuse_fsdp1(self)
        _check_mixin_options(self, type(self).__name__)
        super().on_fit_start()  # type: ignore[misc]  # a mixin: the LightningModule's method, after it in the MRO

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> torch.Tensor | None:
        """Lightning's ``clip_gradients``, with the clip by norm over the whole model.

        Args:
            optimizer: The optimizer whose parameters' gradients are clipped
                (as Lightning passes it).
            gradient_clip_val: As Lightning's: ``None`` takes the
                ``Trainer``'s; 0 clips nothing.
            gradient_clip_algorithm: ``"norm"`` or ``"value"``, as Lightning's;
                ``None`` takes the ``Trainer``'s, else ``"norm"``.

        Returns:
            The norm of the whole model's gradient before clipping, a 0-dim
            float64 tensor identical on every rank; ``None`` when Lightning
            clipped by value or not at all.

        Raises:
            MisconfigurationException, TypeError: As Lightning's, for its
                arguments.
            TypeError, ValueError: As :func:`ppclip_func.clip_grad_norm_`.
        """
        found: list[torch.Tensor] = []

        def clip_by_norm(optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
            found.append(self._clip_grad_norm(_main_params(plugin, optimizer), clip_val))

        plugin = _precision_plugin_to_patch(self)
        if plugin is not None and gradient_clip_algorithm in (None, "norm"):
            _refuse_fsdp1(self)
        if plugin is None:
            return super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[misc]  # a mixin: the LightningModule's method, after it in the MRO
        with _clip_grad_by_norm_replaced(plugin, clip_by_norm):
            super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[misc]  # a mixin: the LightningModule's method, after it in the MRO
        return found[0] if found else None

    def _clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The clip by norm, in place; logs and returns the norm."""
        total_norm = clip_grad_norm_(parameters, _mesh(self), max_norm, self.gradient_clip_norm_type)
        _log(self, self.grad_norm_log_key, total_norm)
        return total_norm


class AdaptiveClipGradNormMixin(ClipGradNormMixin):
    """:class:`ClipGradNormMixin` with a threshold that follows the run (ZClip), saved in Lightning's checkpoints.

    ``gradient_clip_val`` is :func:`ppclip_func.adaptive_clip_grad_norm_`'s
    ``max_norm``: the threshold during warm-up and the cap after it. Its
    other options are :attr:`adaptive_clip_options`. The statistics live in
    :attr:`clip_state` (a :class:`ppclip_func.ClipStateful`), are written into
    Lightning's checkpoint by ``on_save_checkpoint`` and read back by
    ``on_load_checkpoint`` (a module that overrides those hooks calls
    ``super()``). ``clip_gradients`` returns the norm, as
    :class:`ClipGradNormMixin`'s; the step's :class:`ppclip_func.ClipStats`
    is kept as :attr:`clip_stats`. Its ``skip`` is not applied to the
    optimizer step (:func:`ppclip_func.skip_update_` does that).

    Attributes:
        adaptive_clip_options: Keyword arguments of
            :func:`ppclip_func.adaptive_clip_grad_norm_` other than
            ``max_norm``: ``z``, ``alpha``, ``warmup``, ``mode``, ...
        grad_norm_log_key: As :class:`ClipGradNormMixin`; the threshold is
            logged beside it as ``f"{grad_norm_log_key}_threshold"``.

    Example:
        >>> import pytest, torch
        >>> pl = pytest.importorskip("pytorch_lightning")
        >>> from ppclip_func.lightning import AdaptiveClipGradNormMixin
        >>> class Model(AdaptiveClipGradNormMixin, pl.LightningModule):
        ...     adaptive_clip_options = {"z": 2.5, "warmup": 2}
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Linear(2, 1, bias=False)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.layer(batch).sum()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.0)
        >>> quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, gradient_clip_val=10.0, **quiet)
        >>> model = Model()
        >>> trainer.fit(model, torch.utils.data.DataLoader(torch.tensor([[3.0, 4.0]] * 3)))
        >>> model.clip_state.state.count, model.clip_state.state.mean  # three norms of 5 taken in
        (tensor(3), tensor(5., dtype=torch.float64))
        >>> checkpoint = {}  # what trainer.save_checkpoint writes, and fit(ckpt_path=...) reads back
        >>> model.on_save_checkpoint(checkpoint)
        >>> resumed = Model()
        >>> resumed.on_load_checkpoint(checkpoint)
        >>> resumed.clip_state.state.count
        tensor(3)
    """

    adaptive_clip_options: ClassVar[Mapping[str, Any]] = {}
    clip_stats: ClipStats | None = None

    @property
    def clip_state(self) -> ClipStateful:
        """The adaptive statistics, created on the module's device at first use."""
        holder = self.__dict__.get("_ppclip_clip_state")
        if holder is None:
            holder = self.__dict__["_ppclip_clip_state"] = ClipStateful(_device(self))
        return holder

    def _clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        stats = adaptive_clip_grad_norm_(
            parameters,
            _mesh(self),
            self.clip_state.state,
            self.gradient_clip_norm_type,
            max_norm=max_norm,
            **self.adaptive_clip_options,
        )
        self.clip_state.state = stats.state
        self.clip_stats = stats
        _log(self, self.grad_norm_log_key, stats.total_norm)
        if self.grad_norm_log_key is not None:
            _log(self, f"{self.grad_norm_log_key}_threshold", stats.threshold)
        return stats.total_norm

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Adds the adaptive statistics to Lightning's checkpoint (as CPU tensors)."""
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]  # a mixin: the LightningModule's method, after it in the MRO
        checkpoint[CHECKPOINT_KEY] = {k: v.cpu() for k, v in self.clip_state.state_dict().items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restores the adaptive statistics from Lightning's checkpoint, where it has them."""
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]  # a mixin: the LightningModule's method, after it in the MRO
        if CHECKPOINT_KEY in checkpoint:
            self.clip_state.load_state_dict(checkpoint[CHECKPOINT_KEY])


def _precision_plugin_to_patch(module: Any) -> Any:
    """The Trainer's precision plugin, or ``None`` where Lightning's clip is kept whole.

    Kept whole: a module run by Fabric (``fabric.clip_gradients``) or by no
    Trainer.
    """
    if getattr(module, "_fabric", None) is not None or getattr(module, "_trainer", None) is None:
        return None
    return module.trainer.precision_plugin


# The packages a Trainer may come from: the unified package's ``lightning.pytorch`` and ``pytorch_lightning``.
_LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _lightning_package(trainer: Any) -> str:
    """The package ``trainer``'s class comes from: ``"lightning.pytorch"`` or ``"pytorch_lightning"``.

    Read from the Trainer's own class (or the first Lightning class it derives
    from), never by importing a package: the other one may be missing, or be
    a second copy whose classes are not the Trainer's.
    """
    for cls in type(trainer).__mro__:
        for package in _LIGHTNING_PACKAGES:
            if cls.__module__ == package or cls.__module__.startswith(package + "."):
                return package
    raise TypeError(f"{type(trainer).__name__} is not a Lightning Trainer (from {_LIGHTNING_PACKAGES})")


def _refuse_fsdp1(module: Any) -> None:
    """Raises Lightning's ``MisconfigurationException`` under ``FSDPStrategy`` (FSDP1), on every rank alike.

    FSDP1's flat parameters are plain tensors holding a slice of several
    parameters each: nothing says which, so neither torch's clip nor ours
    can weigh them, and a clip rank by rank would give each rank its own norm.
    """
    trainer = module.trainer
    package = _lightning_package(trainer)
    strategies = importlib.import_module(f"{package}.strategies")
    if isinstance(trainer.strategy, strategies.FSDPStrategy):
        exceptions = importlib.import_module(f"{package}.utilities.exceptions")
        raise exceptions.MisconfigurationException(
            f"{type(module).__name__} clips by the norm of the whole model, which {package}.strategies.FSDPStrategy "
            "(FSDP1) cannot give: its flat gradient shards carry no layout. Use "
            f"{package}.strategies.ModelParallelStrategy (FSDP2 and tensor parallelism on DTensors) and shard in "
            "configure_model, or set gradient_clip_algorithm='value'"
        )


class _clip_grad_by_norm_replaced:
    """``plugin.clip_grad_by_norm`` is ``fn`` inside the ``with`` block, whatever it was before."""

    def __init__(self, plugin: Any, fn: Any) -> None:
        self.plugin, self.fn = plugin, fn
        self.missing = object()

    def __enter__(self) -> None:
        self.before = self.plugin.__dict__.get("clip_grad_by_norm", self.missing)
        self.plugin.clip_grad_by_norm = self.fn

    def __exit__(self, *exc: object) -> None:
        if self.before is self.missing:
            del self.plugin.clip_grad_by_norm
        else:
            self.plugin.clip_grad_by_norm = self.before


def _main_params(plugin: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters Lightning's clip reads (the plugin's ``main_params``), as a list."""
    return list(plugin.main_params(optimizer))


def _mesh(module: Any) -> DeviceMesh | None:
    """The mesh of every rank, as ``ModelParallelStrategy`` gives it to the module, or ``None`` without one."""
    return getattr(module, "device_mesh", None)


def _device(module: Any) -> torch.device:
    device = getattr(module, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def _log(module: Any, key: str | None, value: torch.Tensor) -> None:
    """``self.log(key, value)`` on step, with no sync, where the Trainer is logging."""
    if key is None or getattr(module, "_current_fx_name", None) is None:
        return
    module.log(key, value, on_step=True, on_epoch=False, sync_dist=False)
