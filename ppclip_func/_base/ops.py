"""The package's torch operators, ``torch.ops.ppclip_func.*``: every one declared here.

Three steps of a clip run as opaque operators in a compiled graph, each for
a reason its schema states:

* ``cpu_statistic``: a CPU bucket's local statistic computed by the eager
  code (scratch buffer, packing, row norms) at step time, rather than a
  reduction inductor generates and compiles for each leaf (``_core.statistics``). It
  reads the gradients, writes nothing and returns a new 0-dim float64 tensor.
* ``write_back_``: state written in place (``_clip.write_back``). Its schema declares
  the mutation (``Tensor(a!)[] dst``), so functionalization and inductor run
  it after every kernel that reads the old values.
* ``record_``: one step of :class:`~ppclip_func.ClipRecorder` written into
  its ring at its device-side counter (``_clip.record``), mutations declared alike.

They are defined with torch.library's schema API (one ``Library`` fragment,
``define`` and ``register_fake`` here), which costs a fraction of
``custom_op``'s host time per call; each implementation is registered beside
its code with :func:`implements`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__: list[str] = []

F = TypeVar("F", bound=Callable[..., Any])

LIBRARY = torch.library.Library("ppclip_func", "FRAGMENT")
LIBRARY.define("cpu_statistic(Tensor[] tensors, float p, str op, bool overflow_safe) -> Tensor")
LIBRARY.define("write_back_(Tensor(a!)[] dst, Tensor[] src) -> ()")
LIBRARY.define("record_(Tensor(a!) ring, Tensor(b!) count, Tensor row, Tensor(c!)[] stats, Tensor[] new_stats) -> ()")


@torch.library.register_fake("ppclip_func::cpu_statistic", lib=LIBRARY)
def _(tensors: list[torch.Tensor], p: float, op: str, overflow_safe: bool) -> torch.Tensor:
    return tensors[0].new_empty((), dtype=torch.float64)


@torch.library.register_fake("ppclip_func::write_back_", lib=LIBRARY)
def _(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    return None


@torch.library.register_fake("ppclip_func::record_", lib=LIBRARY)
def _(
    ring: torch.Tensor, count: torch.Tensor, row: torch.Tensor, stats: list[torch.Tensor], new_stats: list[torch.Tensor]
) -> None:
    return None


def implements(name: str) -> Callable[[F], F]:
    """Registers the decorated function as the implementation of ``torch.ops.ppclip_func.<name>``, on every device."""

    def register(fn: F) -> F:
        LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register
