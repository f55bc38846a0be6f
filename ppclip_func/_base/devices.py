"""What a device costs the host: reading a tensor's value, and making a tensor of Python values.

On the CPU a tensor's memory is the host's: a value is read by a load, and
a tensor of Python values (an index, a row of weights) is written in place.
On an accelerator either one is a copy over the bus that waits for the
device: a host sync, which a CUDA graph cannot capture and
``torch.cuda.set_sync_debug_mode("error")`` rejects. So the clip reads
values on the host only where :func:`reads_on_host` says it is free, and
makes its small constant tensors with :func:`constant`, which copies each
one to an accelerator once (in the warm-up steps before a capture) and
hands the same tensor to every later step.

Tests remove ``"cpu"`` from :data:`HOST_MEMORY` to run the accelerator's
branches on a CPU (``tests/test_capture_contract.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .caches import per_process

__all__: list[str] = []

# Device types whose tensors live in the host's memory.
HOST_MEMORY = frozenset({"cpu"})

# The most constants kept per process. None is ever dropped (a captured graph may read it at its address);
# past this many, new ones are made at each call (a configuration that changes every step).
_MAX_CONSTANTS = 4096
_CONSTANTS: dict[tuple, torch.Tensor] = per_process({})


def reads_on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read on the host without a device sync: a plain tensor in host memory."""
    return type(t) is torch.Tensor and t.device.type in HOST_MEMORY


def constant(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``values`` on ``device``; never to be written to.

    In host memory, and while tracing (the compiler makes it a constant of
    the graph), a new tensor. On an accelerator, eagerly, the tensor made
    the first time these values were asked for there: one copy from the
    host, then none, so the steps after the first synchronize nothing and
    can be captured in a CUDA graph.
    """
    if device.type in HOST_MEMORY or torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    key = (tuple(values), dtype, device)
    made = _CONSTANTS.get(key)
    if made is None:
        made = torch.tensor(values, dtype=dtype).to(device)
        if len(_CONSTANTS) < _MAX_CONSTANTS:
            _CONSTANTS[key] = made
    return made


def scalar(value: float | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value``, a Python number or a 0-dim tensor, as a 0-dim tensor on ``device``: a number by a fill
    kernel, not a copy from the host (``torch.as_tensor(1.0, device="cuda")`` copies and synchronizes)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype=dtype, device=device)
    return torch.full((), value, dtype=dtype, device=device)
