"""Count the collectives a piece of code issues, at the dispatcher."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd")
_NOT_COLLECTIVES = ("wait_tensor", "wait", "_wrap_tensor_autograd")


class CollectiveCounter(TorchDispatchMode):
    """Records every collective op (functional or c10d) dispatched inside the ``with`` block.

    ``wait_tensor`` (waits for one) and ``_wrap_tensor_autograd`` (autograd
    bookkeeping) are not collectives and are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        if ns in _COLLECTIVE_NAMESPACES and name not in _NOT_COLLECTIVES:
            self.ops.append(f"{ns}.{name}")
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return len(self.ops)


def norm_bits(t: torch.Tensor) -> int:
    """The raw bits of a 0-dim float tensor, for bitwise comparison across ranks."""
    t = t.detach().cpu()
    return int(t.view(torch.int64 if t.dtype == torch.float64 else torch.int32))
