"""AdamW as torch's functional ``adamw`` on explicit state: an optimizer step that compiles as one graph.

``torch.optim.AdamW.step`` cannot be traced with ``fullgraph=True``: it
breaks the graph on purpose around its no-grad region. Its functional form,
``torch.optim.adamw.adamw``, applies the same update and has no such break,
so a clip and the update compile together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch.optim.adamw import adamw

__all__ = ["AdamWConfig", "FunctionalAdamW"]


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """AdamW's hyperparameters, as ``torch.optim.AdamW`` names them."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-2
    eps: float = 1e-8

    def torch_optimizer(self, params: Iterable[torch.Tensor]) -> torch.optim.AdamW:
        """``torch.optim.AdamW`` with these hyperparameters: the eager reference for :class:`FunctionalAdamW`."""
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay, eps=self.eps, foreach=True
        )


class FunctionalAdamW:
    """AdamW moments and step counts, one per parameter (DTensors for DTensor parameters).

    Compiled, :meth:`step` runs ``capturable=True``: the step counts stay
    tensors, so no step number is read on the host. They are float64
    because the capturable bias corrections are computed in the step
    count's dtype, and ``1 - 0.999`` in float32 is off by 1.3e-5 (eager
    computes it with Python floats). Eager torch refuses ``capturable=True``
    on CPU, so eager steps run without it.

    Args:
        params: The parameters to update.
        cfg: The hyperparameters.
    """

    def __init__(self, params: list[torch.Tensor], cfg: AdamWConfig) -> None:
        self.params = params
        self.cfg = cfg
        self.exp_avgs = [torch.zeros_like(p) for p in params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in params]
        self.steps = [torch.zeros((), dtype=torch.float64) for _ in params]

    def step(self, grads: list[torch.Tensor] | None = None) -> None:
        """Updates the parameters in place with ``grads`` (default: each parameter's ``.grad``)."""
        adamw(
            self.params,
            [p.grad for p in self.params] if grads is None else grads,
            self.exp_avgs,
            self.exp_avg_sqs,
            [],
            self.steps,
            foreach=True,
            capturable=torch.compiler.is_compiling(),
            amsgrad=False,
            beta1=self.cfg.betas[0],
            beta2=self.cfg.betas[1],
            lr=self.cfg.lr,
            weight_decay=self.cfg.weight_decay,
            eps=self.cfg.eps,
            maximize=False,
        )
