"""OLMo-core's ``_clip_grad_norm``, same signature and return value, with one collective.

OLMo-core's train modules (``TransformerTrainModule`` and
``TransformerPipelineTrainModule``, ai2-olmo-core 3.0.0) clip in
``optim_step()`` by calling ``self._clip_grad_norm(self.max_grad_norm)``;
the norm it returns is logged as ``optim/total grad norm`` and handed to a
``SkipStepOptimizer`` as ``latest_grad_norm``. Replacing that one method
replaces the clip everywhere it is used. A module built by
``TransformerTrainModuleConfig.build()`` takes one line::

    from ppclip_func.olmo_core import use_ppclip

    train_module = use_ppclip(train_module_config.build(model))

A train module class of your own takes the mixin first::

    class MyTrainModule(PPClipMixin, TransformerTrainModule): ...

The mesh is the module's ``world_mesh`` (its ``"pp"`` dim, when there is one,
is the pipeline); the parameters are those of its ``model`` or, in a pipeline,
of its ``model_parts``. Nothing of OLMo-core is imported here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from ._clip.adaptive import ClipStats
from ._clip.forms import adaptive_clip_grad_norm_
from ._clip.forms import clip_grad_norm_ as _clip_grad_norm_
from ._clip.stateful import ClipStateful
from ._trainers.options import check_options

__all__ = ["STATE_KEY", "PPClipMixin", "clip_grad_norm_", "use_ppclip"]

STATE_KEY = "ppclip"
"""The key of the adaptive threshold's state in the train module's state dict (and so in its checkpoints)."""

# The options of the adaptive clip that OLMo-core's optim_step passes itself.
_SET_BY_OLMO_CORE = {
    "max_norm": "the train module's max_grad_norm (OLMo-core's optim_step passes it)",
    "norm_type": "OLMo-core's _clip_grad_norm(max_grad_norm, norm_type)",
}


def _checked_adaptive(adaptive: Mapping[str, Any] | None, where: str) -> dict[str, Any] | None:
    """``adaptive`` checked as options of :func:`ppclip_func.adaptive_clip_grad_norm_`; ``None`` stays ``None``."""
    if adaptive is None:
        return None
    return check_options(adaptive_clip_grad_norm_, adaptive, where=where, fixed=_SET_BY_OLMO_CORE)


def _parameters(train_module: Any) -> list[nn.Parameter]:
    """Every parameter this rank holds: of ``model_parts`` in a pipeline module, else of ``model``."""
    parts = getattr(train_module, "model_parts", None)
    if parts is None:
        parts = [train_module.model]
    for part in parts:
        if isinstance(part, FullyShardedDataParallel):
            # FSDP1's flat parameters are plain tensors: nothing says how they are sharded.
            raise TypeError(
                f"{type(train_module).__name__} holds an FSDP1 FullyShardedDataParallel model, whose flat "
                "gradient shards carry no layout; use FSDP2 (fully_shard, OLMo-core's default) or keep its clip"
            )
    return [p for part in parts for p in part.parameters()]


@torch.no_grad()
def clip_grad_norm_(
    train_module: Any, max_grad_norm: float, norm_type: float = 2.0, foreach: bool | None = None
) -> torch.Tensor:
    """Clips the gradients of an OLMo-core train module in place by the norm of the whole model.

    ``_clip_grad_norm``'s signature with the module first. OLMo-core takes
    ``torch.nn.utils.get_total_norm`` of the rank's gradients, reduces it with
    ``full_tensor()`` (an all-reduce per sharded mesh dim) and, in the
    pipeline module, with one more all-reduce over its ``pp_group``. Here
    every gradient is weighed by its layout and one all-reduce spans every
    rank of ``train_module.world_mesh``, every stage included; bf16
    gradients are accumulated in float32.

    Args:
        train_module: A ``TransformerTrainModule`` or
            ``TransformerPipelineTrainModule`` (anything with ``world_mesh``
            and ``model`` or ``model_parts``).
        max_grad_norm: The largest norm allowed.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf``.
        foreach: Accepted for the signature; the clip always uses the
            multi-tensor kernels where torch has them.

    Returns:
        The total norm before clipping, what OLMo-core logs as
        ``total grad norm`` and hands to a ``SkipStepOptimizer``: a plain
        0-dim float64 tensor, identical on every rank.

    Raises:
        TypeError: The module holds an FSDP1 model, or as
            :func:`ppclip_func.clip_grad_norm_`.
        ValueError: As :func:`ppclip_func.clip_grad_norm_`.

    Example:
        >>> import types
        >>> import torch
        >>> from ppclip_func import olmo_core as ppclip
        >>> module = types.SimpleNamespace(model=torch.nn.Linear(2, 1, bias=False), world_mesh=None)
        >>> module.model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> ppclip.clip_grad_norm_(module, 1.0)
        tensor(5., dtype=torch.float64)
        >>> module.model.weight.grad
        tensor([[0.6000, 0.8000]])
    """
    del foreach  # what it selects in OLMo-core, the clip decides here
    return _clip_grad_norm_(_parameters(train_module), train_module.world_mesh, max_grad_norm, norm_type)


class PPClipMixin:
    """Gives an OLMo-core train module this clip, and optionally the adaptive threshold, in ``_clip_grad_norm``.

    Put it first among the bases: ``class MyTrainModule(PPClipMixin,
    TransformerTrainModule)``; or convert a built module with
    :func:`use_ppclip`. ``optim_step()`` is OLMo-core's, unchanged: it logs
    the returned norm and hands it to a ``SkipStepOptimizer``.

    With ``ppclip_adaptive`` set to a dict of options of
    :func:`ppclip_func.adaptive_clip_grad_norm_` (``{}`` for its defaults),
    the threshold follows the run, capped at the module's ``max_grad_norm``;
    the last step's :class:`~ppclip_func.ClipStats` is ``ppclip_stats``
    (threshold, z-score, skip), its statistics are ``ppclip_state`` (a
    :class:`~ppclip_func.ClipStateful`), saved and loaded under
    :data:`STATE_KEY` with the module's own state dict, so OLMo-core's
    checkpoints carry them. A checkpoint without them starts fresh
    statistics.

    Example:
        >>> import torch
        >>> from ppclip_func.olmo_core import PPClipMixin
        >>> class Module:  # stands in for OLMo-core's TrainModule
        ...     world_mesh = None
        ...     def __init__(self):
        ...         self.model = torch.nn.Linear(2, 1, bias=False)
        ...     def state_dict(self, *, optim=None):
        ...         return {"model": self.model.state_dict()}
        ...     def load_state_dict(self, state_dict):
        ...         self.model.load_state_dict(state_dict["model"])
        >>> class Clipped(PPClipMixin, Module):
        ...     ppclip_adaptive = {"warmup": 2}
        >>> module = Clipped()
        >>> for g in (3.0, 4.0, 3.5):
        ...     module.model.weight.grad = torch.tensor([[g, 0.0]])
        ...     norm = module._clip_grad_norm(10.0)
        >>> norm, module.ppclip_stats.threshold  # after 2 warm-up steps, the threshold follows the norms, not 10
        (tensor(3.5000, dtype=torch.float64), tensor(4.7500, dtype=torch.float64))
        >>> sorted(module.state_dict()["ppclip"])
        ['count', 'mean', 'var']
    """

    __slots__ = ()  # so that use_ppclip can give a built module this class: the object layout stays its own

    ppclip_adaptive: Mapping[str, Any] | None = None
    ppclip_stats: ClipStats | None = None
    world_mesh: Any  # the train module's, which this is mixed into (declared for the type checker only)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _checked_adaptive(cls.ppclip_adaptive, f"class {cls.__name__}.ppclip_adaptive")

    @property
    def ppclip_state(self) -> ClipStateful:
        """The adaptive threshold's statistics, created on the first use (on ``self.device`` if it has one)."""
        holder = self.__dict__.get("_ppclip_state")
        if holder is None:
            holder = self.__dict__["_ppclip_state"] = ClipStateful(getattr(self, "device", None))
        return holder

    def _clip_grad_norm(
        self, max_grad_norm: float, norm_type: float = 2.0, foreach: bool | None = None
    ) -> torch.Tensor:
        """OLMo-core's ``_clip_grad_norm``: clips in place, returns the norm before clipping."""
        if self.ppclip_adaptive is None:
            return clip_grad_norm_(self, max_grad_norm, norm_type, foreach)
        state = self.ppclip_state
        stats = adaptive_clip_grad_norm_(
            _parameters(self),
            self.world_mesh,
            state.state,
            norm_type,
            max_norm=max_grad_norm,
            **self.ppclip_adaptive,
        )
        state.update_(stats.state)
        self.ppclip_stats = stats  # type: ignore[misc]  # empty __slots__, mixed into a class with a __dict__
        return stats.total_norm

    def _with_clip_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.ppclip_adaptive is not None:
            state_dict[STATE_KEY] = self.ppclip_state.state_dict()
        return state_dict

    def state_dict(self, *, optim: bool | None = None) -> dict[str, Any]:
        """The module's state dict, with the adaptive statistics under :data:`STATE_KEY` when adaptive."""
        return self._with_clip_state(super().state_dict(optim=optim))  # type: ignore[misc]  # a mixin: the train module's method, after it in the MRO

    def state_dict_to_save(self, *, optim: bool | None = None) -> dict[str, Any]:
        """What OLMo-core's checkpointer saves, with the adaptive statistics."""
        return self._with_clip_state(super().state_dict_to_save(optim=optim))  # type: ignore[misc]  # a mixin: the train module's method, after it in the MRO

    def state_dict_to_load(self, metadata: Any, *, optim: bool | None = None) -> dict[str, Any]:
        """What OLMo-core's checkpointer loads into; the statistics only if the checkpoint has them."""
        return _with_saved_clip_state(self, super().state_dict_to_load(metadata, optim=optim), metadata)  # type: ignore[misc]  # a mixin: the train module's method, after it in the MRO

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the module's state; the adaptive statistics, if present, into :attr:`ppclip_state`."""
        _load_clip_state(self, state_dict, super().load_state_dict)  # type: ignore[misc]  # a mixin: the train module's method, after it in the MRO


def _with_saved_clip_state(module: Any, state_dict: dict[str, Any], metadata: Any) -> dict[str, Any]:
    saved = getattr(metadata, "state_dict_metadata", {})
    if any(key.startswith(f"{STATE_KEY}.") for key in saved):
        state_dict = module._with_clip_state(state_dict)
    return state_dict


def _load_clip_state(module: Any, state_dict: dict[str, Any], load: Any) -> None:
    clip_state = state_dict.pop(STATE_KEY, None)
    load(state_dict)
    if clip_state is not None and module.ppclip_adaptive is not None:
        module.ppclip_state.load_state_dict(clip_state)


@functools.cache
def _with_mixin(cls: type) -> type:
    """``cls`` with :class:`PPClipMixin`'s methods. Not ``(PPClipMixin, cls)``: CPython refuses to give a built
    object a class whose first base is another (``object layout differs``), so the subclass has ``cls`` alone."""

    class Converted(cls):
        __slots__ = ()
        ppclip_adaptive: Mapping[str, Any] | None = None
        ppclip_stats: ClipStats | None = None
        ppclip_state = PPClipMixin.ppclip_state
        _clip_grad_norm = PPClipMixin._clip_grad_norm
        _with_clip_state = PPClipMixin._with_clip_state

        def state_dict(self, *, optim: bool | None = None) -> dict[str, Any]:
            return self._with_clip_state(super().state_dict(optim=optim))

        def state_dict_to_save(self, *, optim: bool | None = None) -> dict[str, Any]:
            return self._with_clip_state(super().state_dict_to_save(optim=optim))

        def state_dict_to_load(self, metadata: Any, *, optim: bool | None = None) -> dict[str, Any]:
            return _with_saved_clip_state(self, super().state_dict_to_load(metadata, optim=optim), metadata)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            _load_clip_state(self, state_dict, super().load_state_dict)

    Converted.__name__ = Converted.__qualname__ = f"PPClip{cls.__name__}"
    Converted.__module__ = cls.__module__
    Converted._ppclip_converted = True
    return Converted


def use_ppclip(train_module: Any, *, adaptive: Mapping[str, Any] | None = None) -> Any:
    """Makes a built OLMo-core train module clip with :class:`PPClipMixin`; returns the same object.

    For a module built by ``TransformerTrainModuleConfig.build()``: its class
    becomes a subclass of its own with :class:`PPClipMixin`'s methods, so
    nothing else about it changes.

    Args:
        train_module: A ``TransformerTrainModule`` or ``TransformerPipelineTrainModule``.
        adaptive: Options of :func:`ppclip_func.adaptive_clip_grad_norm_`
            for a threshold that follows the run (``{}`` for its defaults),
            or ``None`` for OLMo-core's fixed ``max_grad_norm``; not
            ``max_norm`` or ``norm_type``, which OLMo-core passes.

    Returns:
        ``train_module``, converted in place.

    Raises:
        TypeError, ValueError: An option of ``adaptive`` is unknown, set by
            OLMo-core, or of the wrong type or range, named in the message;
            the module is left as it was.

    Example:
        >>> import torch
        >>> from ppclip_func.olmo_core import use_ppclip
        >>> class Module:  # stands in for OLMo-core's TransformerTrainModule
        ...     world_mesh = None
        ...     model = torch.nn.Linear(2, 1, bias=False)
        >>> module = use_ppclip(Module())
        >>> isinstance(module, Module), type(module).__name__
        (True, 'PPClipModule')
        >>> module.model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> module._clip_grad_norm(1.0)
        tensor(5., dtype=torch.float64)
    """
    adaptive = _checked_adaptive(adaptive, "use_ppclip(adaptive=...)")  # before anything is changed
    cls: type = type(train_module)  # `type`: type(x) is not Hashable to mypy (functools.cache)
    if not isinstance(train_module, PPClipMixin) and not getattr(cls, "_ppclip_converted", False):
        train_module.__class__ = _with_mixin(cls)
    train_module.ppclip_adaptive = adaptive
    return train_module
