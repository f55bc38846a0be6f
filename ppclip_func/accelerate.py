"""Hugging Face Accelerate's ``Accelerator.clip_grad_norm_``, same arguments and return value, with one collective.

Accelerate 1.15's clip, with FSDP2 and a ``ParallelismConfig``, groups the
gradients by their DTensor mesh and calls torch's ``clip_grad_norm_`` on one
group, or ``get_total_norm`` and ``full_tensor()`` per group and a stack on
several: one all-reduce per sharded mesh dim (two on ``dp_shard`` × ``tp``),
a float32 norm, and a DTensor for a return value when every gradient shares
one mesh. Here the world mesh is read from the accelerator
(``accelerator.torch_device_mesh``) and :func:`ppclip_func.clip_grad_norm_`
issues one all-reduce over it, whatever the layout.

The smallest change is one line after the accelerator is built, with every
call site left as it is (Hugging Face ``Trainer`` calls
``self.accelerator.clip_grad_norm_`` itself, so this is the only way to
reach its clip without editing it)::

    from ppclip_func import accelerate as ppclip

    accelerator = Accelerator(fsdp_plugin=..., parallelism_config=...)
    ppclip.patch_accelerator(accelerator)  # this instance's clip_grad_norm_ is now ours
    ...
    if accelerator.sync_gradients:
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)

or, in a loop of your own, the call named explicitly, with the accelerator
first and Accelerate's arguments after it::

    grad_norm = ppclip.clip_grad_norm_(accelerator, model.parameters(), max_grad_norm)

Before it clips, it unscales the gradients of fp16 mixed precision with
``accelerator.unscale_gradients()``, as Accelerate's clip does (once per
call; Accelerate's calls it twice when the parameters passed are not exactly
the prepared model's, which raises with a ``GradScaler``). Like Accelerate's,
it clips whatever gradients are there: call it where Accelerate's is called,
under ``if accelerator.sync_gradients:``. Refused, with a ``ValueError``
naming the reason (keep ``accelerator.clip_grad_norm_`` there): DeepSpeed and
Megatron-LM (they clip inside their own engines), XLA (Accelerate reduces
the gradients inside its clip there) and FSDP1 (its flat parameters are
plain tensors, whose sharding the clip cannot read).

The adaptive threshold (:func:`adaptive_clip_grad_norm_`) keeps its state in
a :class:`ppclip_func.ClipStateful`; ``accelerator.register_for_checkpointing``
puts it in Accelerate's own checkpoints (``save_state`` / ``load_state``).

Nothing of Accelerate is imported here: the functions read the accelerator
they are given, so the package imports without Accelerate installed.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

import torch

from ._clip.adaptive import ClipStats
from ._clip.forms import adaptive_clip_grad_norm_ as _adaptive_clip_grad_norm_
from ._clip.forms import clip_grad_norm_ as _clip_grad_norm_
from ._clip.stateful import ClipStateful
from ._trainers.accelerator import accelerator_mesh
from ._trainers.options import check_options

__all__ = ["adaptive_clip_grad_norm_", "clip_grad_norm_", "patch_accelerator"]


def clip_grad_norm_(
    accelerator: Any,
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float | torch.Tensor,
    norm_type: float = 2,
    *,
    eps: float = 1e-6,
    nonfinite: str = "propagate",
) -> torch.Tensor:
    """Clips the gradients of ``parameters`` in place by the norm of the whole model; Accelerate's arguments.

    ``accelerator.clip_grad_norm_(parameters, max_norm, norm_type)`` becomes
    ``clip_grad_norm_(accelerator, parameters, max_norm, norm_type)``. The
    gradients are unscaled first (``accelerator.unscale_gradients()``: a
    ``GradScaler``'s, with fp16 mixed precision; nothing otherwise), then
    clipped by :func:`ppclip_func.clip_grad_norm_` over
    ``accelerator.torch_device_mesh``, the mesh Accelerate builds from its
    ``ParallelismConfig`` (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``),
    with one all-reduce. Without a ``ParallelismConfig`` (DDP, FSDP2 on its
    default mesh, one process) the mesh is ``None``: DTensor gradients are
    reduced over their own mesh, plain ones (DDP's, already averaged) are
    taken as they are.

    Args:
        accelerator: The ``accelerate.Accelerator`` the model was prepared with.
        parameters: A tensor or an iterable of tensors (a generator is
            consumed once), as passed to Accelerate's clip.
        max_norm: The largest norm allowed.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf`` (Accelerate's
            default, 2).
        eps: Added to the total norm before dividing (torch's 1e-6).
        nonfinite: What a NaN or infinite norm does: ``"propagate"`` (scale
            anyway, as Accelerate and torch do), ``"zero"``, ``"error"`` or
            ``"abort"`` (see :func:`ppclip_func.clip_grads_with_norm`).

    Returns:
        The total norm before clipping: a plain 0-dim float64 tensor, the
        same on every rank (Accelerate's is float32, and a DTensor when every
        gradient lives on one mesh; ``.item()`` reads either).

    Raises:
        ValueError: The accelerator uses DeepSpeed, Megatron-LM, XLA or FSDP1,
            whose clip stays Accelerate's (the message says why).
        TypeError, RuntimeError: As :func:`ppclip_func.clip_grad_norm_`.

    Example:
        On one process (launched on many, the same call clips by the norm
        of the whole model):

        >>> import torch
        >>> from accelerate import Accelerator
        >>> from ppclip_func import accelerate as ppclip
        >>> accelerator = Accelerator(cpu=True)
        >>> model = accelerator.prepare(torch.nn.Linear(2, 1, bias=False))
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> ppclip.clip_grad_norm_(accelerator, model.parameters(), 1.0)
        tensor(5., dtype=torch.float64)
        >>> model.weight.grad
        tensor([[0.6000, 0.8000]])
    """
    mesh = accelerator_mesh(accelerator)
    accelerator.unscale_gradients()
    return _clip_grad_norm_(parameters, mesh, max_norm, norm_type, eps=eps, nonfinite=nonfinite)


def adaptive_clip_grad_norm_(
    accelerator: Any,
    parameters: torch.Tensor | Iterable[torch.Tensor],
    clip: ClipStateful,
    norm_type: float = 2,
    **options: Any,
) -> ClipStats:
    """Clips in place to a threshold that follows the run (ZClip), its state in ``clip``; one all-reduce.

    :func:`ppclip_func.adaptive_clip_grad_norm_` over the accelerator's mesh,
    after unscaling as :func:`clip_grad_norm_` does. It reads ``clip.state``
    and stores the step's new state back into it. Register ``clip`` once with
    ``accelerator.register_for_checkpointing(clip)``: ``save_state`` then
    saves the statistics beside the model and the optimizer, and
    ``load_state`` restores them, so a resumed run keeps its threshold.

    Args:
        accelerator: The ``accelerate.Accelerator`` the model was prepared with.
        parameters: As :func:`clip_grad_norm_`.
        clip: The holder of the adaptive state, ``ClipStateful(device=accelerator.device)``.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf``.
        **options: The rule and clip options of
            :func:`ppclip_func.adaptive_clip_grad_norm_` (``max_norm``, ``z``,
            ``alpha``, ``warmup``, ``skip_z``, ``eps``, ``nonfinite``, ...).

    Returns:
        The step's :class:`ppclip_func.ClipStats`: ``total_norm`` (what
        Accelerate's clip returns), ``threshold``, ``skip`` (apply it with
        :func:`ppclip_func.skip_update_`, docs/adaptive.md) and ``state``.

    Raises:
        ValueError: As :func:`clip_grad_norm_`.
        TypeError: ``clip`` is not a :class:`ppclip_func.ClipStateful`; or as
            :func:`ppclip_func.adaptive_clip_grad_norm_`.

    Example:
        >>> import torch
        >>> from accelerate import Accelerator
        >>> from ppclip_func import ClipStateful, accelerate as ppclip
        >>> accelerator = Accelerator(cpu=True)
        >>> model = accelerator.prepare(torch.nn.Linear(2, 1, bias=False))
        >>> clip = ClipStateful(device=accelerator.device)
        >>> accelerator.register_for_checkpointing(clip)  # saved by accelerator.save_state
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> stats = ppclip.adaptive_clip_grad_norm_(accelerator, model.parameters(), clip, max_norm=1.0)
        >>> float(stats.total_norm), float(stats.threshold), int(clip.state.count)
        (5.0, 1.0, 1)
    """
    if not isinstance(clip, ClipStateful):
        raise TypeError(f"clip must be a ppclip_func.ClipStateful, got {type(clip).__name__}")
    mesh = accelerator_mesh(accelerator)
    accelerator.unscale_gradients()
    stats = _adaptive_clip_grad_norm_(parameters, mesh, clip.state, norm_type, **options)
    clip.state = stats.state
    return stats


def patch_accelerator(accelerator: Any, *, eps: float = 1e-6, nonfinite: str = "propagate") -> Any:
    """Makes ``accelerator.clip_grad_norm_`` :func:`clip_grad_norm_`, on this instance only; returns it.

    Every call site keeps Accelerate's arguments and return value
    (``accelerator.clip_grad_norm_(parameters, max_norm, norm_type=2)``),
    those inside libraries included (Hugging Face ``Trainer``). Other
    ``Accelerator`` instances and the class are untouched; patching twice
    changes nothing, and ``del accelerator.clip_grad_norm_`` gives the
    instance Accelerate's clip back. ``clip_grad_value_`` stays Accelerate's.

    Args:
        accelerator: The ``accelerate.Accelerator`` to patch.
        eps: As :func:`clip_grad_norm_`, for every call.
        nonfinite: As :func:`clip_grad_norm_`, for every call.

    Returns:
        ``accelerator``, patched.

    Raises:
        TypeError, ValueError: ``eps`` or ``nonfinite`` is not valid for
            :func:`clip_grad_norm_`, or the accelerator runs a layout it
            refuses: here rather than at the first clip, with the
            accelerator left unpatched.

    Example:
        >>> import torch
        >>> from accelerate import Accelerator
        >>> from ppclip_func import accelerate as ppclip
        >>> accelerator = ppclip.patch_accelerator(Accelerator(cpu=True))
        >>> model = accelerator.prepare(torch.nn.Linear(2, 1, bias=False))
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> accelerator.clip_grad_norm_(model.parameters(), 1.0)  # as before, now ours
        tensor(5., dtype=torch.float64)
    """
    # Refuse now, not in the middle of a run, and before anything is patched.
    check_options(_clip_grad_norm_, {"eps": eps, "nonfinite": nonfinite}, where="patch_accelerator")
    accelerator_mesh(accelerator)

    def patched(
        self: Any, parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Accelerate's ``clip_grad_norm_(parameters, max_norm, norm_type=2)``, by ``ppclip_func.accelerate``."""
        return clip_grad_norm_(self, parameters, max_norm, norm_type, eps=eps, nonfinite=nonfinite)

    accelerator.clip_grad_norm_ = types.MethodType(patched, accelerator)
    return accelerator
