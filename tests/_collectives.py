"""Count the collectives (and the ops) a piece of code issues, at the dispatcher."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd")
_NOT_COLLECTIVES = ("wait_tensor", "wait", "_wrap_tensor_autograd")


class CollectiveCounter(TorchDispatchMode):
    """Records every collective op (functional or c10d) dispatched inside the ``with`` block.

    Including those a DTensor op issues (as torch's ``CommDebugMode`` counts them).

    ``wait_tensor`` (waits for one) and ``_wrap_tensor_autograd`` (autograd
    bookkeeping) are not collectives and are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.groups: list[str] = []  # the group name each functional collective was issued on
        self.devices: list[str] = []  # the device of its input

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run its op first: the collectives it issues (a full_tensor(), a redistribute)
            # come back through this mode on plain tensors. Run here, with this mode off, they went uncounted.
            return NotImplemented
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        if ns in _COLLECTIVE_NAMESPACES and name not in _NOT_COLLECTIVES:
            self.ops.append(f"{ns}.{name}")
            if ns == "_c10d_functional":
                self.groups.append(args[-1] if isinstance(args[-1], str) else kwargs["group_name"])
                self.devices.append(str(args[0].device))
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return len(self.ops)


def norm_bits(t: torch.Tensor) -> int:
    """The raw bits of a 0-dim float tensor, for bitwise comparison across ranks."""
    t = t.detach().cpu()
    return int(t.view(torch.int64 if t.dtype == torch.float64 else torch.int32))


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched inside the ``with`` block that read or write data.

    Views are not counted: they read nothing, on any device. On an
    accelerator every counted op is host work (a kernel launch).
    """

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


AGREE_GATHER = "c10d._allgather_base_"


def steady_count(counter: CollectiveCounter) -> int:
    """Collectives counted, less the one-time agreement gather (``_core.agreement``: the first sight of a
    configuration on a world group); at most one such gather is allowed."""
    gathers = counter.ops.count(AGREE_GATHER)
    assert gathers <= 1, counter.ops
    return counter.count - gathers
