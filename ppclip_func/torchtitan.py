"""torchtitan's ``clip_grad_norm_``, same signature and return value, with one collective.

A trainer written for torchtitan keeps the arguments of its call to
``torchtitan.distributed.utils.clip_grad_norm_`` and adds one import::

    from ppclip_func import torchtitan as ppclip

    grad_norm = ppclip.clip_grad_norm_(  # was: dist_utils.clip_grad_norm_(
        [p for m in model_parts for p in m.parameters()],
        max_norm,
        foreach=True,
        pp_mesh=parallel_dims.get_optional_mesh("pp"),
        ep_enabled=parallel_dims.ep_enabled,
    )

Nothing of torchtitan is imported here: the function takes what its call
site passes and hands it to :func:`ppclip_func.clip_grad_norm_`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh

from ._clip.forms import clip_grad_norm_ as _clip_grad_norm_

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
    ep_enabled: bool = False,
) -> torch.Tensor:
    """Clips the gradients of ``parameters`` in place by the norm of the whole model; torchtitan's signature.

    torchtitan computes the norm with ``get_total_norm``, reduces it with
    ``full_tensor()`` (one all-reduce per partially reduced mesh dim, again
    for the expert parameters when ``ep_enabled``) and then over ``pp_mesh``.
    Here every gradient is weighed by its layout and one all-reduce spans
    every stage; the norm is accumulated in float32 for bf16 gradients.

    Args:
        parameters: A tensor or an iterable of tensors (a generator is
            consumed once), as torchtitan's trainer passes them.
        max_norm: The largest norm allowed.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf``.
        error_if_nonfinite: Raise ``RuntimeError`` on every rank if the norm
            is NaN or infinite, before any gradient is scaled (a host read,
            as in torch).
        foreach: Accepted for the signature; the clip always uses the
            multi-tensor kernels where torch has them.
        pp_mesh: The pipeline mesh (``parallel_dims.get_optional_mesh("pp")``),
            or ``None`` without pipeline parallelism. Every rank's stage is
            read from its layout; no collective is spent on it.
        ep_enabled: Accepted for the signature; expert parameters are
            weighed by their own mesh and placements, in the same collective.

    Returns:
        The total norm before clipping: a plain 0-dim tensor, identical on
        every rank.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
        TypeError, ValueError: As :func:`ppclip_func.clip_grad_norm_`.

    Example:
        >>> import torch
        >>> from ppclip_func import torchtitan as ppclip
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> ppclip.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True, pp_mesh=None)
        tensor(5., dtype=torch.float64)
        >>> model.weight.grad
        tensor([[0.6000, 0.8000]])
    """
    del foreach, ep_enabled  # what they select in torchtitan, the layouts decide here
    nonfinite = "error" if error_if_nonfinite else "propagate"
    return _clip_grad_norm_(parameters, None, max_norm, norm_type, pp_mesh=pp_mesh, nonfinite=nonfinite)
