"""What the trainer integration tests share: a layout stepped once, the checks a case collects, the case itself.

The tests of torchtitan, Accelerate, OLMo-core, transformers and Lightning
each build a trainer's layouts on gloo ranks, take one step and hold the clip
to the float64 reference (``tests/_gather.py``, ``tests/_reference.py``):

* :class:`SteppedLayout`: a layout after its step, the whole model's
  gradient in float64 beside this rank's local gradients as the step left
  them; a test's subclass says where its trainer keeps the gradients.
  :class:`BuiltOnce` builds one per rank and keeps it for every case of that
  layout; :func:`layout_case` makes the module-level case ``{layout}__{part}``.
* :class:`Checks`: failed checks collected rather than raised, so that every
  rank reaches the same collectives; the worst errors printed, every failure
  raised at the end. :meth:`Checks.clip` is the check each clip call gets:
  its norm against float64, its collectives counted, the clipped gradients
  the reference scaled.
* :func:`all_but`: every case but the cheap one is slow, left out of
  ``make test-quick``, which still starts each integration's ranks once
  (but Lightning's: ``tests/conftest.py`` leaves its cheap cases out too).
* :func:`as_launched_worker`: the environment a launcher gives its workers,
  for trainers that read it (the process group is already the harness's).

Everything that gathers or compares across ranks must be called by every
rank in the same order.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests._collectives import CollectiveCounter, steady_count
from tests._gather import gather_objects
from tests._reference import reference_coefficient, reference_norm

RTOL = 1e-6  # ours against float64, relative: the norm and every clipped gradient

# The Lightning Trainer's arguments that keep a test's fit from logging, checkpointing or printing progress.
LIGHTNING_QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}

Case = Callable[[int, int], None]
T = TypeVar("T")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (its local shard if a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of each local tensor (gradients, parameters), by name, to put back later (:func:`put_back`)."""
    return {name: local(t).detach().clone() for name, t in tensors.items()}


def put_back(tensors: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> None:
    """Copies ``saved`` into each local tensor of ``tensors``, in place (after an in-place clip or step)."""
    with torch.no_grad():
        for name, t in tensors.items():
            local(t).copy_(saved[name])


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest element-wise relative error of ``got`` against ``want``, in float64 (0 where both are 0)."""
    if not want.numel():
        return 0.0
    want = want.double()
    return float(((got.double() - want).abs() / want.abs()).nan_to_num(0.0, posinf=math.inf).max())


def dtensor_meshes(tensors: Iterable[Any]) -> set[tuple[str, ...]]:
    """The dim names of the meshes the DTensors among ``tensors`` live on."""
    return {t.device_mesh.mesh_dim_names for t in tensors if isinstance(t, DTensor)}


def every_rank_meshes(tensors: Iterable[Any]) -> set[tuple[str, ...]]:
    """:func:`dtensor_meshes` over every rank's ``tensors`` (a gather)."""
    return set().union(*gather_objects(dtensor_meshes(tensors)))


def all_but(cases: Iterable[Case], quick: str) -> list[str]:
    """The names of ``cases`` other than ``quick``: ``real_rank_test(slow=...)``, so that ``make test-quick``
    starts the ranks for one cheap case of the integration, ``quick``, and the whole suite runs them all."""
    names = [case.__name__ for case in cases]
    if quick not in names:
        raise ValueError(f"{quick} is not one of the cases {names}")
    return [name for name in names if name != quick]


def as_launched_worker(rank: int, world_size: int, *, torchrun: bool = False) -> None:
    """The environment a launcher gives its workers, read by trainers that look for one.

    The process group is already the harness's: the address and port are
    read, not used. ``torchrun=True`` adds torchelastic's variables, with
    which Lightning uses the process group already started.
    """
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if torchrun:
        os.environ.update(TORCHELASTIC_RUN_ID="ppclip-test", GROUP_RANK="0")


@dataclasses.dataclass
class SteppedLayout:
    """A layout after one step, with its float64 reference; ``restore()`` undoes an in-place clip."""

    reference: dict[str, torch.Tensor]  # the whole model's gradient in float64, by parameter name
    saved: dict[str, torch.Tensor]  # this rank's local gradients as the step left them

    def grads(self) -> dict[str, Any]:
        """This rank's gradients as the layout holds them now, by parameter name."""
        raise NotImplementedError

    def expected(self, norm_type: float, names: Callable[[str], bool] = lambda name: True) -> float:
        """The float64 norm of the whole model's gradient (of the parameters ``names`` keeps)."""
        return reference_norm([g for n, g in self.reference.items() if names(n)], norm_type)

    def restore(self) -> None:
        put_back(self.grads(), self.saved)


class BuiltOnce(Generic[T]):
    """``build(*key)`` on the first call with ``key`` on this rank, kept for the cases after it; one key held at a time.

    A build that raised is kept as its error: every later case that asks
    for it fails, saying so.
    """

    def __init__(self, build: Callable[..., T]) -> None:
        self._build = build
        self._held: dict[tuple[Any, ...], T | BaseException] = {}

    def __call__(self, *key: Any) -> T:
        if key not in self._held:
            self._held.clear()
            try:
                self._held[key] = self._build(*key)
            except BaseException as e:
                self._held[key] = e
                raise
        held = self._held[key]
        if isinstance(held, BaseException):
            raise RuntimeError(f"building {key} failed in an earlier case") from held
        return held


S = TypeVar("S", bound=SteppedLayout)


def layout_case(
    namespace: dict[str, Any], layout: str, part: Callable[[S, Checks], None], stepped: Callable[[str], S]
) -> Case:
    """The case ``{layout}__{part}``: ``part`` on ``stepped(layout)``, its checks done, the step's gradients put back.

    The case becomes a module-level name of ``namespace`` (the test
    module's ``globals()``), so that it is pickled by name into the ranks.
    """
    name = f"{layout}__{part.__name__}"

    def case(rank: int, world_size: int) -> None:
        held = stepped(layout)
        checks = Checks(name)
        try:
            part(held, checks)
        finally:
            held.restore()
        checks.done()

    case.__name__ = case.__qualname__ = name
    case.__module__ = namespace["__name__"]
    namespace[name] = case
    return case


class Checks:
    """Collects failed checks so that every rank reaches the same collectives; keeps what was measured.

    ``done()`` prints the worst errors (rank 0) and raises with every failure.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.failures: list[str] = []
        self.worst: dict[str, float] = {}  # the largest relative error of each kind
        self.collectives: dict[str, set[int]] = {}
        self.notes: list[str] = []

    def that(self, ok: bool, what: str) -> None:
        """``ok`` holds; ``what`` says what failed if not."""
        if not ok:
            self.failures.append(what)

    def error(self, what: str, err: float, rtol: float, kind: str | None = None) -> None:
        """A relative error ``err`` is at most ``rtol``; the worst is kept under ``kind`` (``what``'s first word)."""
        self._keep(kind or what.split(" ")[0], err)
        self.that(err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}")

    def close(
        self, what: str, actual: torch.Tensor | float, expected: float, rtol: float = RTOL, kind: str | None = None
    ) -> None:
        """``actual`` (a DTensor read whole) is ``expected`` within ``rtol`` relative, exactly where ``expected`` is 0."""
        value = float(actual.full_tensor() if isinstance(actual, DTensor) else actual)
        if expected == 0:  # a -inf norm where some element is 0 (an embedding row no token used)
            err = 0.0 if value == 0 else math.inf
        else:
            err = abs(value - expected) / abs(expected)
        self._keep(kind or what.split(" ")[0], err)
        self.that(err <= rtol, f"{what}: {value!r}, expected {expected!r} (relative error {err:.3g} > {rtol:g})")

    def count(
        self, what: str, counter: CollectiveCounter, expected: int | None = 1, *, first_sight: bool = False
    ) -> None:
        """``counter`` saw ``expected`` collectives (any number if ``None``).

        ``first_sight``: the call may be the first with its options on this world group, which also
        issues the one-time agreement gather (``ppclip_func/_core/agreement.py``); at most that one is not counted.
        A call repeating options already seen must issue exactly ``expected``.
        """
        n = steady_count(counter) if first_sight else counter.count
        self.collectives.setdefault(what.split(" ")[0], set()).add(n)
        self.that(expected is None or n == expected, f"{what}: {n} collectives, {expected} expected: {counter.ops}")

    def clipped(
        self,
        what: str,
        stepped: SteppedLayout,
        coefficient: float,
        rtol: float = RTOL,
        *,
        saved: Mapping[str, torch.Tensor] | None = None,
        scale: float = 1.0,
    ) -> None:
        """Every local gradient is the step's (or ``saved``), divided by ``scale``, times the float64 ``coefficient``."""
        self.that(
            coefficient < 1.0, f"{what}: coefficient {coefficient}: the clip must scale for this check to mean anything"
        )
        saved = stepped.saved if saved is None else saved
        for name, g in stepped.grads().items():
            err = max_rel_error(local(g), saved[name].double() / scale * coefficient)
            self._keep(f"{what.split(' ')[0]} clipped {str(saved[name].dtype).removeprefix('torch.')}", err)
            self.that(err <= rtol, f"{what}: {name} is not the reference scaled (relative error {err:.3g})")

    def clip(
        self,
        what: str,
        stepped: SteppedLayout,
        call: Callable[[float, float], torch.Tensor],
        norm_type: float,
        *,
        first_sight: bool = False,
        collectives: int | None = 1,
        rtol: float = RTOL,
        scale: float = 1.0,
    ) -> torch.Tensor:
        """``call(max_norm, norm_type)`` at half the float64 norm (so that it scales), checked; returns its norm.

        The norm within ``rtol`` of float64, ``collectives`` counted (see
        :meth:`count`), the clipped gradients the reference scaled within
        ``rtol``; then the step's gradients are put back.
        """
        expected = stepped.expected(norm_type)
        max_norm = expected / 2
        with CollectiveCounter() as counter:
            total = call(max_norm, norm_type)
        self.close(what, total, expected, rtol)
        self.count(what, counter, collectives, first_sight=first_sight)
        self.clipped(what, stepped, reference_coefficient(expected, max_norm), rtol, scale=scale)
        stepped.restore()
        return total

    def done(self) -> None:
        """Prints what was measured (on rank 0); raises with every failed check."""
        if dist.get_rank() == 0:
            errors = ", ".join(f"{k} {v:.2e}" for k, v in self.worst.items())
            counts = ", ".join(f"{k} {sorted(v)}" for k, v in self.collectives.items())
            notes = "".join(f"; {n}" for n in self.notes)
            print(f"[{self.where}] max rel. error vs float64: {errors}; collectives: {counts}{notes}", flush=True)
        if self.failures:
            raise AssertionError(f"{self.where}: {len(self.failures)} failed check(s):\n" + "\n".join(self.failures))

    def _keep(self, kind: str, err: float) -> None:
        self.worst[kind] = max(self.worst.get(kind, 0.0), err)
